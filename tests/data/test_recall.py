"""The multi-query associative recall generator and its accuracy metric."""

import numpy as np
import pytest
import torch

from k3.data.recall import IGNORE, RecallTask, recall_accuracy


def _answers_by_lookup(tokens: np.ndarray, task: RecallTask) -> np.ndarray:
    """A perfect memory: for every query key, the value it was paired with in the context."""
    off = int(task.bos_id is not None)
    out = np.full(tokens.shape, IGNORE)
    for b, row in enumerate(tokens):
        ctx = row[off:off + 2 * task.num_pairs]
        table = dict(zip(ctx[0::2], ctx[1::2]))
        for t in range(off + 2 * task.num_pairs, len(row), 2):
            out[b, t] = table[row[t]]
    return out


def test_structure_and_targets():
    task = RecallTask(num_pairs=6, num_queries=9, num_keys=10, num_values=7, key_offset=20, value_offset=40,
                      bos_id=3)
    tokens, targets = task.sample(5, np.random.default_rng(0))
    assert tokens.shape == targets.shape == (5, task.seq_len) and task.seq_len == 1 + 2 * (6 + 9)
    assert (tokens[:, 0] == 3).all()
    keys = tokens[:, 1:13:2]
    assert all(len(set(r)) == 6 for r in keys)  # keys distinct within a sequence
    assert ((keys >= 20) & (keys < 30)).all()
    assert ((tokens[:, 2:13:2] >= 40) & (tokens[:, 2:13:2] < 47)).all()
    # targets: exactly at the query keys, equal to the value stored for that key; nothing else is scored
    np.testing.assert_array_equal(targets, _answers_by_lookup(tokens, task))
    assert (targets != IGNORE).sum() == 5 * 9
    # each answer also appears as the next input token (teacher forcing)
    q = np.nonzero(targets[0] != IGNORE)[0]
    np.testing.assert_array_equal(tokens[0, q + 1], targets[0, q])


def test_batches_are_a_function_of_seed_and_index():
    task = RecallTask.for_seq_len(33, vocab_size=260, bos_id=256)
    assert task.seq_len <= 33 and task.num_pairs == 8
    a1, t1 = task.batch(4, seed=1, index=7)
    a2, t2 = task.batch(4, seed=1, index=7)
    b, _ = task.batch(4, seed=1, index=8)
    assert torch.equal(a1, a2) and torch.equal(t1, t2) and not torch.equal(a1, b)


def test_accuracy_metric():
    targets = torch.tensor([[IGNORE, 5, IGNORE, 6], [7, IGNORE, IGNORE, 8]])
    preds = torch.tensor([[0, 5, 0, 1], [7, 0, 0, 8]])
    assert recall_accuracy(preds, targets) == pytest.approx(3 / 4)  # IGNORE positions never count
    logits = torch.nn.functional.one_hot(preds, 10).float()
    assert recall_accuracy(logits, targets) == pytest.approx(3 / 4)
    # the perfect lookup solves the task; a constant guess gets about 1 / num_values
    task = RecallTask.for_seq_len(64, vocab_size=260, bos_id=256)
    tokens, tg = task.sample(64, np.random.default_rng(1))
    assert recall_accuracy(torch.from_numpy(_answers_by_lookup(tokens, task)), torch.from_numpy(tg)) == 1.0
    guess = torch.full_like(torch.from_numpy(tg), task.value_offset)
    assert recall_accuracy(guess, torch.from_numpy(tg)) < 0.1


def test_bad_input():
    with pytest.raises(ValueError, match="num_pairs"):
        RecallTask(num_pairs=10, num_keys=5)
    with pytest.raises(ValueError, match="disjoint"):
        RecallTask(key_offset=0, value_offset=10, num_keys=20)
    with pytest.raises(ValueError, match="seq_len"):
        RecallTask.for_seq_len(3, 260, 256)
    with pytest.raises(ValueError, match="logits_or_preds"):
        recall_accuracy(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="no scored"):
        recall_accuracy(torch.zeros(1, 2, dtype=torch.long), torch.full((1, 2), IGNORE))
