"""ModelRunner: chunked prefill equals one-call prefill (logits and every state), decode over the slot pool equals a
full recompute, slots are independent and reset on admission, bad input is refused before anything runs; on GPU the
CUDA-graph decode step equals the eager step bitwise."""

import pytest
import torch

import k3_runs

from k3.config import K3Config
from k3.infer.runner import ModelRunner, auto_prefill_chunk, batch_buckets
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM
from k3.state import KDAState

GREEDY = SamplingParams(max_tokens=64, temperature=0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def tiny(seed: int = 0, device: str = "cpu", **kw) -> K3ForCausalLM:
    return k3_runs.tiny_model(seed, device, **kw).eval()


def _state_rows(state, slot: int, n: int) -> list[torch.Tensor]:
    """Every per-slot tensor of ``state`` at ``slot`` (MLA: the first n cached latents)."""
    out = []
    for s in state.layers:
        if isinstance(s, KDAState):
            out += [s.recurrent[slot], *(t[slot] for t in s.conv)]
        else:
            out.append(s.buf[slot, :n])
    return out


@pytest.mark.parametrize("chunk", [8, 13, 37, 64])
def test_chunked_prefill_equals_one_call(chunk):
    """Chunk sizes that divide the prompt, do not, equal it and exceed it; the prompt lands in slot 1 of 3."""
    model = tiny(1)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_state = model.init_state(1, capacity=64)
        ref = model(ids, state=ref_state).logits[:, -1]
    runner = ModelRunner(model, max_batch=3, capacity=64, prefill_chunk=chunk)
    runner.admit(1, GREEDY, seed=0)
    logits = model.lm_head(runner.feed(1, ids[0].tolist()))
    assert rel(logits, ref) <= 1e-5
    for got, want in zip(_state_rows(runner.state, 1, 40), _state_rows(ref_state, 0, 40)):
        assert rel(got, want) <= 1e-5
    assert runner.state.lengths.tolist() == [0, 40, 0, 0] and runner.length(1) == 40


def test_decode_equals_full_recompute_and_slots_are_independent():
    model = tiny(2)
    runner = ModelRunner(model, max_batch=4, capacity=96, prefill_chunk=7)
    g = torch.Generator().manual_seed(1)
    prompts = {s: torch.randint(0, 256, (n,), generator=g).tolist() for s, n in ((3, 11), (0, 5))}
    out = {}
    for slot, p in prompts.items():
        runner.admit(slot, GREEDY, seed=0)
        out[slot] = runner.prefill(slot, p).tokens()
    for step in range(6):
        slots = [3, 0] if step % 2 else [0, 3]  # order and membership of the batch do not matter
        for s, t in zip(slots, runner.decode(slots).tokens()):
            out[s].append(t)
    # a slot reused by a new sequence starts from scratch
    runner.admit(3, GREEDY, seed=0)
    again = runner.prefill(3, prompts[3]).tokens() + runner.decode([3]).tokens()
    assert again == out[3][:2]
    for slot, p in prompts.items():
        ids = list(p)
        with torch.no_grad():
            for _ in range(7):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out[slot] == ids[len(p):]


@pytest.mark.parametrize("chunk", [9, 64])
def test_batched_prefill_equals_one_slot_at_a_time(chunk):
    """Three slots prefilled as the rows of one batch (a slot that already holds a prefix among them, chunks that
    split the rows' pieces or not) give each slot the logits, states and first token of its own prefill."""
    model = tiny(4)
    g = torch.Generator().manual_seed(2)
    head = torch.randint(0, 256, (6,), generator=g).tolist()
    pieces = [torch.randint(0, 256, (13,), generator=g).tolist() for _ in range(3)]
    one = ModelRunner(model, max_batch=4, capacity=32, prefill_chunk=chunk)
    many = ModelRunner(model, max_batch=4, capacity=32, prefill_chunk=chunk)
    for r in (one, many):
        for slot in (0, 2, 3):
            r.admit(slot, GREEDY, seed=0)
        r.prefill(2, head, last=False)  # slot 2 continues a sequence: its row starts at position 6
    want = {slot: one.prefill(slot, p).tokens() for slot, p in zip((3, 0, 2), pieces)}
    got = many.prefill_batch([3, 0, 2], pieces).tokens()
    assert got == [want[3][0], want[0][0], want[2][0]]
    for slot, n in ((3, 13), (0, 13), (2, 19)):
        assert many.length(slot) == one.length(slot) == n
        for a, b in zip(_state_rows(many.state, slot, n), _state_rows(one.state, slot, n)):
            assert rel(a, b) <= 1e-5
    h_one = one.feed(0, [5, 6, 7])
    h_many = many.feed(0, [5, 6, 7])
    assert rel(h_many, h_one) <= 1e-5
    with pytest.raises(ValueError, match="one length"):
        many.prefill_batch([2, 3], [[1, 2], [3]])
    with pytest.raises(ValueError, match="distinct"):
        many.prefill_batch([2, 2], [[1], [3]])


def test_bad_input_is_refused_before_running():
    model = tiny(3)
    runner = ModelRunner(model, max_batch=2, capacity=16)
    with pytest.raises(ValueError, match="slot"):
        runner.admit(2, GREEDY, seed=0)  # the scratch row is not a slot
    with pytest.raises(ValueError, match="admitted"):
        runner.prefill(0, [1, 2])
    runner.admit(0, GREEDY, seed=0)
    with pytest.raises(ValueError, match="ids"):
        runner.prefill(0, [1, 260])
    with pytest.raises(ValueError, match="capacity"):
        runner.prefill(0, list(range(17)))
    with pytest.raises(ValueError, match="prefilled"):
        runner.decode([0])
    runner.prefill(0, [1, 2, 3])
    with pytest.raises(ValueError, match="distinct"):
        runner.decode([0, 0])
    assert runner.state.lengths.tolist() == [3, 0, 0]
    for kw in ({"max_batch": 0}, {"prefill_chunk": 0}, {"cuda_graphs": "yes"}, {"capacity": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            ModelRunner(model, **kw)


def test_decode_fills_the_capacity_and_no_further():
    """A slot decodes until prompt + generated tokens = capacity; the next step is refused on the host and changes
    nothing. A step run outside the runner's bookkeeping (the benchmark's back-to-back replays) that would write a
    latent past the capacity raises on CPU — on a GPU that write is an out-of-bounds index_put that poisons the
    CUDA context."""
    model = tiny(5)
    runner = ModelRunner(model, max_batch=2, capacity=12)
    runner.admit(1, GREEDY, seed=0)
    runner.prefill(1, list(range(1, 9)))
    for _ in range(4):
        runner.decode([1]).tokens()
    assert runner.length(1) == 12 and runner.state.lengths.tolist() == [0, 12, 0]
    with pytest.raises(ValueError, match="full"):
        runner.decode([1])
    assert runner.state.lengths.tolist() == [0, 12, 0]
    runner._bind_batch((1,))
    with pytest.raises(ValueError, match="capacity"), torch.no_grad():
        runner._step(1, "greedy")


def test_bench_decode_replays_stay_within_the_capacity():
    """The benchmark's decode row (capacity = prompt + steps + 8) times the steps as the engine runs them, then the
    same number of back-to-back steps again: the slots' lengths are put back in between, never past the capacity."""
    from k3.bench.serve import _runner_decode

    model = tiny(6)
    row = _runner_decode(model, B=2, prompt_len=16, steps=12, device="cpu")
    assert row["steps"] == 12 and row["replay_ms"] > 0 and row["tok_s"] > 0


def test_buckets_and_auto_chunk():
    assert batch_buckets(1) == [1] and batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(12) == [1, 2, 4, 8, 12]
    small = K3ForCausalLM(K3Config.from_preset("tiny"))
    c = auto_prefill_chunk(small, torch.device("cpu"), budget_bytes=64 << 20)
    assert c % 64 == 0 and 64 <= c <= 65536
    assert auto_prefill_chunk(small, torch.device("cpu"), budget_bytes=1) == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode_params", [GREEDY, SamplingParams(max_tokens=64, temperature=0.8, top_k=20, top_p=0.9)])
def test_cuda_graph_decode_equals_eager_step_bitwise(mode_params):
    """Two runners fed alike, one replaying graphs, one running the same padded step eagerly: identical tokens and
    identical state pools, step after step (bf16 model)."""
    model = tiny(4, device="cuda", dtype="bfloat16")
    runners = [ModelRunner(model, max_batch=4, capacity=128, cuda_graphs=g) for g in (True, False)]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 30, 17)]
    for r in runners:
        for s, p in enumerate(prompts):
            r.admit(s, mode_params, seed=100 + s)
            r.prefill(s, p)
    graph, eager = runners
    for _ in range(8):
        got = graph.decode([0, 1, 2]).tokens()
        eager._bind_batch((0, 1, 2, eager.scratch))  # the graph's padded bucket, run eagerly
        with torch.no_grad():
            eager._step(4, "greedy" if mode_params.temperature == 0 else "filtered")
        assert got == eager._out[:3].tolist()
        for a, b in zip(_state_rows(graph.state, slice(0, 3), 128), _state_rows(eager.state, slice(0, 3), 128)):
            assert torch.equal(a, b)
    assert graph.use_graphs and (4, "greedy" if mode_params.temperature == 0 else "filtered") in graph._graphs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_warmup_leaves_no_trace(device):
    """A warmed runner (a chunk and a tail prefilled on the scratch row) serves exactly what a fresh one does, and
    its scratch row is empty again."""
    model = tiny(6, device=device)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(7)).tolist()
    warm, fresh = (ModelRunner(model, max_batch=2, capacity=64, prefill_chunk=8, cuda_graphs=False) for _ in "ab")
    warm.warmup()
    assert warm.state.lengths.tolist() == [0, 0, 0] and warm.length(warm.scratch) == 0
    assert all(not r.any() for r in _state_rows(warm.state, warm.scratch, 0) if r.numel())
    out = []
    for r in (warm, fresh):
        r.admit(1, GREEDY, seed=0)
        toks = r.prefill(1, ids).tokens() + [r.decode([1]).tokens()[0] for _ in range(5)]
        out.append(toks)
    assert out[0] == out[1]
