"""Engine: requests join and leave a running batch and still get their single-request outputs, long prompts prefill in
chunks between decode steps, stop strings / stop ids / max_tokens / cancellation, seeded sampling independent of the
batch, the bounded queue, input checks; TextStream's hold-back of possible stop strings."""

import threading
import time

import pytest
import torch

from k3.config import K3Config
from k3.data.tokenizers import ByteTokenizer
from k3.infer.generate import generate_ids
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM
from k3.serve.engine import Engine, QueueFull, TextStream

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.from_preset("tiny"))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 1.0)
    return m.eval()


@pytest.fixture
def engine(model):
    eng = Engine(model, TOK, max_batch=3, max_queue=4, prefill_chunk=16, capacity=512).start()
    yield eng
    eng.stop()


def prompt(i: int, n: int = 6) -> list[int]:
    return [256] + list(f"request {i}: {'ab' * i}".encode())[:n + i]


def collect(req):
    text, ids = [], []
    while True:
        ev = req.events.get(timeout=60)
        text.append(ev.text)
        ids += ev.token_ids
        if ev.finish_reason is not None:
            return "".join(text), ids, ev


_REFS: dict = {}


def ref(model, ids: list[int], n: int) -> list[int]:
    """Greedy single-request output (one run per prompt, sliced: greedy outputs are prefixes of longer ones)."""
    key = tuple(ids)
    if len(_REFS.get(key, ())) < n:
        _REFS[key] = generate_ids(model, ids, max(n, 24), temperature=0)[0]
    return _REFS[key][:n]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_join_and_leave_mid_batch(engine, model):
    """Five requests with different lengths, submitted while others run (3 slots): each equals its own run."""
    lens = [7, 2, 10, 4, 8]
    reqs = []
    for i, n in enumerate(lens):
        reqs.append(engine.submit(prompt(i), greedy(n)))
        time.sleep(0.05 * i)
    for i, (r, n) in enumerate(zip(reqs, lens)):
        _, ids, ev = collect(r)
        assert ev.finish_reason == "length" and ev.completion_tokens == n and ev.prompt_tokens == len(prompt(i))
        assert ids == ref(model, prompt(i), n)
    assert engine.load() == {"running": 0, "waiting": 0, "slots": 3}


def test_long_prompt_prefills_in_chunks_between_decodes(engine, model):
    long_prompt = [256] + list(b"a long prompt, many chunks " * 5)  # 136 tokens, chunks of 16
    short = engine.submit(prompt(1), greedy(60))  # long enough to still be decoding through the 9 prefill chunks
    deadline = time.monotonic() + 30
    while engine.stats["decode_steps"] < 2 and time.monotonic() < deadline:  # the short one is decoding
        time.sleep(0.005)
    steps_before = engine.stats["decode_steps"]
    long = engine.submit(long_prompt, greedy(5))
    first = long.events.get()  # the long prompt's first token: all 9 chunks were fed before it
    assert engine.stats["decode_steps"] - steps_before >= 5  # decodes kept running while the prompt was fed
    _, ids_long, _ = collect(long)
    _, ids_short, _ = collect(short)
    assert first.token_ids + ids_long == ref(model, long_prompt, 5)
    assert ids_short == ref(model, prompt(1), 60)


def test_stop_strings_stop_ids_and_max_tokens(engine, model):
    want = ref(model, prompt(2), 20)
    text = TOK.decode(want)
    cut = next(i for i in range(3, len(text)) if text[i] not in text[:i] and text[i] != "\ufffd")
    stop = text[cut:cut + 2]
    out, _, ev = collect(engine.submit(prompt(2), greedy(20, stop=(stop,))))
    assert ev.finish_reason == "stop" and out == text[:cut] and stop not in out
    stop_id = want[5]
    first = want.index(stop_id)
    out, ids, ev = collect(engine.submit(prompt(2), greedy(20, stop_token_ids=(stop_id,))))
    assert ev.finish_reason == "stop" and ids == want[:first + 1] and out == TOK.decode(want[:first])
    out, ids, ev = collect(engine.submit(prompt(2), greedy(4)))
    assert ev.finish_reason == "length" and ids == want[:4]


def test_cancellation_frees_the_slot(engine, model):
    other = engine.submit(prompt(4), greedy(12))
    victim = engine.submit(prompt(3), greedy(400))
    victim.events.get(timeout=60)  # running
    engine.cancel(victim)
    _, _, ev = collect(victim)
    assert ev.finish_reason == "cancelled" and ev.completion_tokens < 400
    _, ids, _ = collect(other)
    assert ids == ref(model, prompt(4), 12)
    assert engine.load()["running"] == 0


def test_seeded_sampling_does_not_depend_on_neighbours(engine):
    hot = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    alone = collect(engine.submit(prompt(5), hot))[1]
    noisy = [engine.submit(prompt(i), SamplingParams(max_tokens=8, temperature=1.3, ignore_eos=True))
             for i in range(2)]
    again = collect(engine.submit(prompt(5), hot))[1]
    for r in noisy:
        collect(r)
    assert again == alone
    other_seed = collect(engine.submit(prompt(5), SamplingParams(max_tokens=10, temperature=1.0, top_k=50,
                                                                 top_p=0.95, seed=99, ignore_eos=True)))[1]
    assert other_seed != alone


def test_queue_bound_and_bad_input(model):
    eng = Engine(model, TOK, max_batch=1, max_queue=1, capacity=64)  # not started: nothing leaves the queue
    with pytest.raises(ValueError, match="context"):
        eng.submit([1] * 60, greedy(10))
    with pytest.raises(ValueError, match="token ids"):
        eng.submit([1, 260], greedy(1))
    with pytest.raises(ValueError, match="at least one"):
        eng.submit([], greedy(1))
    eng._active[0] = object()  # the only slot taken
    eng.submit([1], greedy(1))
    with pytest.raises(QueueFull):
        eng.submit([1], greedy(1))
    with pytest.raises(ValueError, match="max_queue"):
        Engine(model, TOK, max_queue=-1)


def test_concurrent_submitters(engine, model):
    results = {}

    def client(i):
        results[i] = collect(engine.submit(prompt(i), greedy(8)))[1]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(5):
        assert results[i] == ref(model, prompt(i), 8)


def test_text_stream_holds_back_possible_stop_strings():
    ts = TextStream(TOK, stops=("END", "xy"))
    out = [ts.feed(b) for b in b"abcEN"]
    assert "".join(t for t, _ in out) == "abc" and not any(s for _, s in out)  # "EN" may start "END"
    assert ts.feed(ord("D")) == ("", True)
    ts = TextStream(TOK, stops=("END",))
    assert "".join(ts.feed(b)[0] for b in b"abEN") + ts.finish()[0] == "abEN"  # never completed: all of it
    ts = TextStream(TOK)
    assert [ts.feed(b)[0] for b in "é".encode()] == ["", "é"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graph engine needs a GPU")
def test_engine_on_gpu_with_graphs():
    """The whole loop on CUDA (graphs for every bucket and sampling mode, pinned read-backs one step behind): mixed
    greedy / sampled / stop-string requests joining a running batch all finish as asked."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = K3ForCausalLM(K3Config.from_preset("tiny", dtype="bfloat16")).eval()
    eng = Engine(m, TOK, max_batch=4, max_queue=8, prefill_chunk=32, capacity=256, cuda_graphs=True).start()
    try:
        kinds = [greedy(12), SamplingParams(max_tokens=9, temperature=0.9, top_k=20, seed=3, ignore_eos=True),
                 SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True)]
        reqs = [eng.submit(prompt(i, n=6 + 9 * i), kinds[i % 3]) for i in range(7)]
        for i, r in enumerate(reqs):
            _, ids, ev = collect(r)
            assert ev.finish_reason == "length" and len(ids) == kinds[i % 3].max_tokens, (i, ev)
        assert eng.error is None and eng.runner.use_graphs and len(eng.runner._graphs) == 3 * 3
    finally:
        eng.stop()


def test_prompts_of_one_length_prefill_together(model):
    """Requests admitted together whose prompts have one length are prefilled as the rows of one batch (one runner
    call, forwards of at most prefill_chunk tokens in all) and still get their single-request outputs."""
    eng = Engine(model, TOK, max_batch=3, max_queue=4, prefill_chunk=16, prefill_budget=64, capacity=128)
    prompts = [[256] + list(f"same {c}-len".encode()) for c in "xyz"]  # 11 tokens each
    other = prompt(7)  # another length: its own call
    reqs = [eng.submit(p, greedy(6)) for p in prompts]
    eng.start()
    try:
        outs = [collect(r)[1] for r in reqs]
        assert eng.stats["prefill_calls"] == 1 and eng.stats["prefill_tokens"] == 33
        assert collect(eng.submit(other, greedy(6)))[1] == ref(model, other, 6)
    finally:
        eng.stop()
    assert outs == [ref(model, p, 6) for p in prompts]
