"""User data readers (.txt/.jsonl/.bin, parquet when pyarrow is there) and the resumable window loader."""

import json

import numpy as np
import pytest
import torch

from k3.data import text_streams
from k3.data.files import load_tokens, read_bin_shard, write_bin_shard
from k3.data.loader import RecallLoader, TokenStream, WindowLoader, eval_windows
from k3.data.recall import RecallTask
from k3.data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def test_bin_shard_round_trip_and_truncation(tmp_path):
    ids = np.arange(1000) % 300
    p = write_bin_shard(tmp_path / "a.bin", ids, vocab_size=300)
    arr = read_bin_shard(p)
    assert arr.dtype == np.uint16 and np.array_equal(arr, ids)
    big = write_bin_shard(tmp_path / "b.bin", [0, 70_000, 5])
    assert read_bin_shard(big).dtype == np.uint32
    data = p.read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-3])
    with pytest.raises(ValueError, match="truncated"):
        read_bin_shard(tmp_path / "cut.bin")
    (tmp_path / "raw.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="K3TOKENS"):
        read_bin_shard(tmp_path / "raw.bin")


def test_text_jsonl_and_bin_tokens(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "ab"}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    (tmp_path / "c.bin").write_bytes(b"")
    write_bin_shard(tmp_path / "c.bin", [1, 2, 3])
    parts = load_tokens(tmp_path, TOK)  # a directory: every data file inside
    assert [p.tolist() for p in parts] == [[1, 2, 3], [256, *b"hello", 257, 256, *b"ab", 257, 256, *b"c", 257]]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="text-field"):
        load_tokens(tmp_path / "bad.jsonl", TOK)
    assert load_tokens(tmp_path / "bad.jsonl", TOK, text_field="body")[0].tolist() == [256, 120, 257]
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_tokens(tmp_path / "empty.txt", TOK)
    with pytest.raises(ValueError, match="not a file"):
        load_tokens(tmp_path / "nope.txt", TOK)
    write_bin_shard(tmp_path / "big.bin", [5000])
    with pytest.raises(ValueError, match="vocab"):
        load_tokens(tmp_path / "big.bin", TOK)


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", "two"]}), tmp_path / "d.parquet")
    assert load_tokens(tmp_path / "d.parquet", TOK)[0].tolist() == [256, *b"one", 257, 256, *b"two", 257]


def test_token_stream_reads_across_parts():
    s = TokenStream([np.arange(5), np.arange(5, 7), np.arange(7, 20)])
    assert s.read(3, 10).tolist() == list(range(3, 13))
    train, val = s.split(0.1, min_val=4)
    assert len(train) == 16 and val.read(0, 4).tolist() == [16, 17, 18, 19]
    with pytest.raises(IndexError):
        val.read(2, 3)


def test_window_loader_is_resumable_and_covers_every_window():
    s = TokenStream([np.arange(101)])
    a = WindowLoader(s, batch_size=3, seq_len=10, seed=5)
    seen = [a.next_batch() for _ in range(4)]  # 12 windows: crosses into epoch 2 (10 windows per epoch)
    x, y = seen[0]
    assert x.shape == (3, 10) and torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))
    starts = [int(r[0]) for x, _ in seen for r in x][:10]
    assert sorted(starts) == list(range(0, 100, 10))  # one epoch = every window once
    state = a.state_dict()
    b = WindowLoader(s, batch_size=3, seq_len=10, seed=5)
    b.load_state_dict(json.loads(json.dumps(state)))
    for _ in range(3):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))
    with pytest.raises(ValueError, match="same --data"):
        WindowLoader(s, batch_size=3, seq_len=9, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="fewer than one window"):
        WindowLoader(TokenStream([np.arange(5)]), 1, 10, 0)


def test_recall_loader_resumes_and_eval_windows_are_fixed():
    task = RecallTask.for_seq_len(17, 260, 256)
    a = RecallLoader(task, 2, seed=3)
    a.next_batch()
    b = RecallLoader(task, 2, seed=3)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    s = TokenStream([np.arange(50)])
    first = [x for x, _ in eval_windows(s, 2, 8, max_batches=2)]
    assert [x[:, 0].tolist() for x in first] == [[0, 8], [16, 24]]


def test_embedded_streams():
    train, val = text_streams("embedded", TOK, 64)
    assert len(train) > 500_000 and len(val) > 10_000
    assert train.read(0, 1).tolist() == [256]  # every document starts with bos
