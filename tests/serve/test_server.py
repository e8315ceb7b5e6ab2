"""``k3 serve`` as a real subprocess on a tiny trained run, talked to by the real ``openai`` client and raw HTTP:
greedy completions equal ``k3 generate --temperature 0``; 16 concurrent streams each get their own single-request
output; a malformed body, an unknown model, missing fields, out-of-range values and an over-long prompt get HTTP 400
with OpenAI's error object while a stream keeps going; a client that disconnects mid-stream frees its slot; a full
queue answers 429; CLI mistakes are one line and exit 2."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

import k3
import k3_runs
from k3.ckpt.run import load_checkpoint
from k3.infer.generate import generate
from k3.serve.chat import chat_format

MAX_BATCH, MAX_QUEUE = 4, 12
REPO = Path(k3.__file__).resolve().parents[1]


class Server:
    def __init__(self, run: Path) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "k3", "serve", "--run", str(run), "--port", "0", "--max-batch", str(MAX_BATCH),
             "--max-queue", str(MAX_QUEUE), "--device", "cpu"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # "k3: serving 'NAME' on http://127.0.0.1:PORT (…)"
        if "http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.name = line.split("'")[1]
        self.url = line.split("http://")[1].split()[0]
        self.base = f"http://{self.url}"
        for _ in range(600):
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=120)

    def post(self, path: str, body, **kw) -> httpx.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(f"{self.base}{path}", content=data, headers={"content-type": "application/json"},
                          timeout=120, **kw)

    def load(self) -> dict:
        return httpx.get(f"{self.base}/health", timeout=30).json()

    def wait_idle(self, timeout: float = 60) -> dict:
        end = time.time() + timeout
        while time.time() < end:
            h = self.load()
            if h["running"] == 0 and h["waiting"] == 0:
                return h
            time.sleep(0.1)
        raise AssertionError(f"server still busy: {self.load()}")

    def stop(self) -> None:
        self.client.close()  # no idle keep-alive connection for the graceful shutdown to wait for
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(tiny_run):
    s = Server(tiny_run)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local(tiny_run):
    ck = load_checkpoint(tiny_run)
    return ck["model"], ck["tokenizer"]


def reference(local, prompt: str, n: int) -> str:
    model, tok = local
    return generate(model, tok, prompt, max_new_tokens=n, temperature=0.0, stream=None, report=None)


def test_models_health_and_unknown_routes(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [server.name]
    assert server.load() == {"status": "ok", "running": 0, "waiting": 0, "slots": MAX_BATCH}
    r = httpx.get(f"{server.base}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_greedy_completion_equals_k3_generate(server, tiny_run, local):
    out = server.client.completions.create(model=server.name, prompt="The ", max_tokens=16, temperature=0)
    code, stdout, _ = k3_runs.run_cli("generate", "--run", str(tiny_run), "--prompt", "The ", "--max-new-tokens",
                                      "16", "--temperature", "0")
    assert code == 0 and stdout == "The " + out.choices[0].text + "\n"
    assert out.usage.prompt_tokens == 5 and out.usage.total_tokens == 5 + out.usage.completion_tokens
    # token-id prompts, and the same text streamed
    ids = [256, *b"The "]
    r = server.post("/v1/completions", {"model": server.name, "prompt": ids, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == out.choices[0].text
    chunks = server.client.completions.create(model=server.name, prompt="The ", max_tokens=16, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_chat_multi_turn_streaming_and_usage(server, local):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And?"}]
    full = server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=12, temperature=0)
    n_prompt = len(chat_format(local[1]).render(messages))
    assert full.usage.prompt_tokens == n_prompt and full.choices[0].message.role == "assistant"
    stream = server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=12,
                                                   temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


def test_sixteen_concurrent_streams_get_their_own_outputs(server, local):
    server.wait_idle()
    prompts = [f"{i}: the {'cat' if i % 2 else 'dog'} " * (1 + i % 3) for i in range(16)]
    got: dict[int, str] = {}

    def client(i: int) -> None:
        stream = server.client.completions.create(model=server.name, prompt=prompts[i], max_tokens=8, temperature=0,
                                                  stream=True)
        got[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {i: reference(local, p, 8) for i, p in enumerate(prompts)}


def _long_stream(server, results: dict, key: str, n: int = 16) -> threading.Thread:
    def run():
        stream = server.client.completions.create(model=server.name, prompt="Keep going ", max_tokens=n,
                                                  temperature=0, stream=True)
        results[key] = "".join(c.choices[0].text for c in stream)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_bad_requests_get_400_while_a_stream_continues(server, local):
    server.wait_idle()
    results: dict = {}
    t = _long_stream(server, results, "ok")
    m = server.name
    cases = [
        ("{not json", None, "invalid_json"),
        ([1, 2], None, "invalid_json"),
        ({"model": "gpt-4", "prompt": "x"}, "model", "model_not_found"),
        ({"prompt": "x"}, "model", "missing_required_parameter"),
        ({"model": m}, "prompt", "missing_required_parameter"),
        ({"model": m, "prompt": [256] * 5000}, "prompt", "context_length_exceeded"),
        ({"model": m, "prompt": "x", "max_tokens": 10**6}, "prompt", "context_length_exceeded"),
        ({"model": m, "prompt": "x", "temperature": 5}, "temperature", None),
        ({"model": m, "prompt": "x", "top_p": 0}, "top_p", None),
        ({"model": m, "prompt": "x", "max_tokens": 0}, "max_tokens", None),
        ({"model": m, "prompt": "x", "n": 2}, "n", "unsupported_parameter"),
        ({"model": m, "prompt": "x", "logprobs": 3}, "logprobs", "unsupported_parameter"),
        ({"model": m, "prompt": "x", "stop": 7}, "stop", None),
        ({"model": m, "prompt": [999]}, "prompt", None),
        ({"model": m, "prompt": "x", "stream": "yes"}, "stream", None),
    ]
    for body, param, code in cases:
        r = server.post("/v1/completions", body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error", (body, r.text)
        assert err["param"] == param and err["code"] == code and err["message"], (body, err)
    r = server.post("/v1/chat/completions", {"model": m})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = server.post("/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="nope", prompt="x")
    t.join()
    assert results["ok"] == reference(local, "Keep going ", 16)


def test_disconnect_mid_stream_frees_the_slot(server, local):
    server.wait_idle()
    results: dict = {}
    t = _long_stream(server, results, "ok", n=12)
    body = {"model": server.name, "prompt": "Disconnect me ", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(x.startswith("data: ") for x in got)
    t.join()
    assert server.wait_idle(timeout=30)["running"] == 0
    assert results["ok"] == reference(local, "Keep going ", 12)


def _raw_stream_request(server, n: int) -> socket.socket:
    host, port = server.url.rsplit(":", 1)
    # ignore_eos: a stream that ended on its own would free a slot and make room in the queue mid-test
    body = json.dumps({"model": server.name, "prompt": f"queue {n} ", "max_tokens": 3000, "stream": True,
                       "ignore_eos": True}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def test_full_queue_answers_429_and_closed_clients_leave_it(server):
    server.wait_idle()
    socks = [_raw_stream_request(server, i) for i in range(MAX_BATCH + MAX_QUEUE)]
    try:
        # every request has arrived once the queue is full; the engine admits the first MAX_BATCH between two of
        # its iterations, so wait for that state rather than read a moment of the admission
        want = {"status": "ok", "running": MAX_BATCH, "waiting": MAX_QUEUE, "slots": MAX_BATCH}
        end = time.time() + 60
        while server.load() != want and time.time() < end:
            time.sleep(0.1)
        assert server.load() == want
        r = server.post("/v1/completions", {"model": server.name, "prompt": "one too many", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    finally:
        for s in socks:
            s.close()
    server.wait_idle(timeout=60)
    out = server.client.completions.create(model=server.name, prompt="after", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_cli_mistakes_are_one_line(tiny_run, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        for argv, text in [
            (["--run", str(tiny_run), "--port", str(busy.getsockname()[1])], "cannot listen"),
            (["--run", str(tmp_path / "missing"), "--port", "0"], "missing"),
            (["--run", str(tiny_run), "--port", "70000"], "port"),
            (["--run", str(tiny_run), "--dtype", "float32", "--port", "0"], "--dtype"),
            (["--port", "0"], "--run"),
            (["--run", str(tiny_run), "--host", "no.such.host.invalid", "--port", "0"], "host"),
        ]:
            code, _, err = k3_runs.run_cli("serve", *argv)
            assert code == 2 and err.startswith("k3: error:") and err.count("\n") == 1 and text in err, (argv, err)
    finally:
        busy.close()


def test_benchmark_load_client_reads_the_streams(server):
    """The serving benchmark's own HTTP client (``k3/bench/_serve_client.py``): every stream's usage and first text
    chunk, parsed from the chunked SSE body."""
    server.wait_idle()
    client = REPO / "k3" / "bench" / "_serve_client.py"
    out = subprocess.run([sys.executable, str(client), server.base, server.name, "3", "5", "4", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 3 and all(r["status"] == 200 and "error" not in r for r in rows), rows
    assert all(r["tokens"] == 4 and 0 < r["ttft"] <= r["end"] - r["start"] for r in rows), rows
    bad = subprocess.run([sys.executable, str(client), server.base, "no-such-model", "1", "5", "4", "0"],
                         capture_output=True, text=True, timeout=120)
    row = json.loads(bad.stdout)
    assert row["status"] == 400 and "model" in row["error"]
