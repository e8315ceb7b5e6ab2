"""The engine in its own process (``EngineProcess``, a real spawned child over a real pipe): outputs equal the
in-process engine's for concurrent requests, the parent validates and bounds requests before anything crosses, a
cancelled request ends, a sink that raises harms no other request, a load that fails in the child is raised in the
parent with its reason, a child that dies ends every open request with an error (and the same object can start a
new one), and stopping cancels what is still running."""

import threading

import pytest
from starlette.testclient import TestClient

from k3.ckpt.run import find_checkpoint, load_checkpoint, load_tokenizer
from k3.infer.sampling import SamplingParams
from k3.serve.api import create_app
from k3.serve.chat import chat_format
from k3.serve.engine import Engine, QueueFull
from k3.serve.process import EngineProcess
from k3.serve.server import load_engine_model

KW = dict(max_batch=3, max_queue=2, prefill_chunk=16, capacity=256)


def _source(run):
    return ("run", str(find_checkpoint(run)))


@pytest.fixture(scope="module")
def proc(tiny_run):
    eng = EngineProcess(load_engine_model, (_source(tiny_run), "cpu", None, False, None), load_tokenizer(tiny_run),
                        **KW).start()
    yield eng
    eng.stop()


def _collect(ticket, timeout=120):
    text, ids = [], []
    while True:
        ev = ticket.events.get(timeout=timeout)
        text.append(ev.text)
        ids += ev.token_ids
        if ev.finish_reason is not None:
            return "".join(text), ids, ev


def test_outputs_equal_the_in_process_engine(proc, tiny_run):
    assert proc.alive and proc.capacity == 256 and proc.max_batch == 3 and proc.device == "cpu"
    ck = load_checkpoint(tiny_run)
    local = Engine(ck["model"], ck["tokenizer"], **KW).start()
    try:
        prompts = [ck["tokenizer"].encode(f"request {i}: " + "ab" * i) for i in range(5)]  # 5 > 3 slots: 2 wait
        params = [SamplingParams(max_tokens=9 + i, temperature=0) if i % 2 else
                  SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=i) for i in range(5)]
        tickets = [proc.submit(p, sp) for p, sp in zip(prompts, params)]
        want = [local.generate(p, sp) for p, sp in zip(prompts, params)]
        got = [_collect(t) for t in tickets]
    finally:
        local.stop()
    for (text, ids, ev), (wtext, wids, wev) in zip(got, want):
        assert ids == wids and text == wtext
        assert (ev.finish_reason, ev.prompt_tokens, ev.completion_tokens) == \
            (wev.finish_reason, wev.prompt_tokens, wev.completion_tokens)
    assert proc.load() == {"running": 0, "waiting": 0, "slots": 3}


def test_bad_input_and_the_queue_bound_are_checked_in_the_parent(proc):
    with pytest.raises(ValueError, match="params"):
        proc.submit([1, 2], {"max_tokens": 3})
    with pytest.raises(ValueError, match="at least one token"):
        proc.submit([], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="token ids"):
        proc.submit([proc.vocab_size], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="context"):
        proc.submit([1] * 250, SamplingParams(max_tokens=10))
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    tickets = [proc.submit([1, 2, 3], long) for _ in range(5)]  # 3 slots + 2 queue places
    try:
        with pytest.raises(QueueFull):
            proc.submit([1, 2, 3], long)
    finally:
        for t in tickets:
            proc.cancel(t)
    ends = [_collect(t)[2] for t in tickets]
    assert all(ev.finish_reason in ("cancelled", "length") for ev in ends)
    assert sum(ev.finish_reason == "cancelled" for ev in ends) >= 1
    out = proc.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))  # room again
    assert len(out[1]) == 3 and out[2].finish_reason == "length"


def test_a_sink_that_raises_does_not_stop_the_others(proc):
    def bad(ev):
        raise RuntimeError("a broken sink")

    proc.submit([5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), bad)
    out = proc.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[1]) == 4 and proc.alive


def test_sinks_get_every_event_on_one_thread(proc):
    seen, threads, done = [], set(), threading.Event()

    def sink(ev):
        seen.append(ev)
        threads.add(threading.get_ident())
        if ev.finish_reason is not None:
            done.set()

    proc.submit([5, 6, 7], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True), sink)
    assert done.wait(120)
    assert sum(len(ev.token_ids) for ev in seen) == 7 and seen[-1].finish_reason == "length"
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_a_load_error_in_the_child_is_raised_here(tmp_path, tiny_run):
    eng = EngineProcess(load_engine_model, (("run", str(tmp_path / "missing")), "cpu", None, False, None),
                        load_tokenizer(tiny_run), **KW)
    with pytest.raises(ValueError, match="missing"):
        eng.start()
    assert not eng.alive
    with pytest.raises(ValueError, match="max_batch"):
        EngineProcess(load_engine_model, (), None, max_batch=0)


def test_a_dead_child_ends_open_requests_and_stop_cancels(tiny_run):
    args = (_source(tiny_run), "cpu", None, False, None)
    eng = EngineProcess(load_engine_model, args, load_tokenizer(tiny_run), **KW).start()
    long = SamplingParams(max_tokens=240, temperature=0, ignore_eos=True)
    t = eng.submit([1, 2, 3], long)
    assert t.events.get(timeout=120).token_ids  # running
    eng._proc.kill()
    last = _collect(t)[2]
    assert last.finish_reason == "error" and "exited" in last.error
    assert not eng.alive
    with pytest.raises(RuntimeError, match="not running"):
        eng.submit([1], SamplingParams(max_tokens=1))
    eng.stop()

    eng.start()  # the same object starts a new child after its first one died
    assert eng.alive
    t = eng.submit([1, 2, 3], long)
    assert t.events.get(timeout=120).token_ids
    eng.stop()
    assert _collect(t)[2].finish_reason == "cancelled"
    assert not eng.alive


def test_the_app_answers_503_once_the_engine_process_died(tiny_run):
    tok = load_tokenizer(tiny_run)
    eng = EngineProcess(load_engine_model, (_source(tiny_run), "cpu", None, False, None), tok, **KW).start()
    body = {"model": "tiny", "prompt": "The ", "max_tokens": 3, "temperature": 0}
    with TestClient(create_app(eng, "tiny", chat_format(tok))) as client:
        assert client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
        eng._proc.kill()
        eng._proc.join()
        eng._reader.join(timeout=30)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert client.get("/health").status_code == 503
