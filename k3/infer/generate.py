"""Text generation from a prompt: ``ModelRunner``'s chunked prefill, then one token per decode step.

``generate_ids`` runs one sequence through a :class:`k3.infer.runner.ModelRunner` of one slot: the prompt in
bounded-memory chunks (only the last position reaches ``lm_head``), then the decode step (a CUDA graph on GPU) with
sampling on the device (temperature, top-k, top-p; a Philox stream keyed by the seed, so the same seed gives the
same text). Text is streamed as it is produced; ``StreamDecoder`` holds back bytes of a character that a byte-level
tokenizer has not finished yet, so nothing is printed as U+FFFD that would have been valid.
"""

from __future__ import annotations

import codecs
import sys
import time
from typing import Any, Callable, Sequence, TextIO

import torch

from k3.infer.runner import ModelRunner
from k3.infer.sampling import SamplingParams

__all__ = ["StreamDecoder", "generate_ids", "generate", "prompt_ids"]


class StreamDecoder:
    """Turn a growing list of ids into text increments, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self._bytes = hasattr(tokenizer, "decode_bytes") and tokenizer.decode_bytes([]) is not None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._emitted = 0  # characters already returned (re-decoding path)

    def feed(self, token: int) -> str:
        """Text that became final with ``token`` (may be empty)."""
        if self._bytes:
            return self._utf8.decode(self.tok.decode_bytes([token]))
        self.ids.append(int(token))
        text = self.tok.decode(self.ids)
        end = len(text)
        while end > self._emitted and text[end - 1] == "\ufffd":  # maybe an unfinished character: wait
            end -= 1
        out = text[self._emitted:end]
        self._emitted = end
        return out

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end becomes U+FFFD)."""
        if self._bytes:
            return self._utf8.decode(b"", final=True)
        text = self.tok.decode(self.ids)
        out = text[self._emitted:]
        self._emitted = len(text)
        return out


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 stop_ids: Sequence[int] | set[int] = (), on_token: Callable[[int], None] | None = None,
                 device: torch.device | str | None = None,
                 vocab_limit: int | None = None) -> tuple[list[int], dict[str, float]]:
    """Generate up to ``max_new_tokens`` ids after ``prompt`` (stops after a stop id, which is included).

    ``vocab_limit``: never sample ids ≥ it (the model's vocabulary is padded past the tokenizer's to a multiple
    of 64; those rows mean nothing).

    Returns ``(new ids, timing)`` with ``prefill_s``, ``decode_s``, ``prompt_tokens``, ``new_tokens``.
    """
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    if len(prompt) == 0:
        raise ValueError("prompt must hold at least one token id")
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    if max_len is not None and len(prompt) + max_new_tokens > max_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_seq_len {max_len}")
    if max_new_tokens == 0:
        return [], {"prefill_s": 0.0, "decode_s": 0.0, "prompt_tokens": len(prompt), "new_tokens": 0}
    where = model.model.embed_tokens.weight.device
    if device is not None and torch.device(device).type != where.type:
        raise ValueError(f"device {device} differs from the model's {where}")
    params = SamplingParams(max_tokens=max_new_tokens, temperature=float(temperature), top_k=top_k or 0,
                            top_p=float(top_p) if top_p is not None else 1.0, seed=int(seed))
    stops = {int(s) for s in stop_ids}
    out: list[int] = []
    was_training = model.training
    try:
        runner = ModelRunner(model, max_batch=1, capacity=len(prompt) + max_new_tokens, vocab_limit=vocab_limit)
        runner.admit(0, params, seed=int(seed))
        t0 = time.perf_counter()
        tok = runner.prefill(0, prompt).tokens()[0]
        t1 = time.perf_counter()
        for i in range(max_new_tokens):
            out.append(tok)  # needed on the host anyway: to stream text and to stop
            if on_token is not None:
                on_token(tok)
            if tok in stops or i == max_new_tokens - 1:
                break
            tok = runner.decode([0]).tokens()[0]
        t2 = time.perf_counter()
    finally:
        model.train(was_training)
    return out, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prompt_tokens": len(prompt), "new_tokens": len(out)}


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """``bos`` (when the tokenizer has one) + the encoded prompt."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
    bos = getattr(tokenizer, "bos_id", None)
    ids = ([bos] if bos is not None else []) + tokenizer.encode(prompt)
    if not ids:
        raise ValueError("prompt is empty and the tokenizer has no bos token; pass --prompt TEXT")
    return ids


def generate(model: torch.nn.Module, tokenizer: Any, prompt: str | Sequence[int], max_new_tokens: int = 200,
             temperature: float = 0.8, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stream: TextIO | None = None, device: torch.device | str | None = None,
             report: TextIO | None = sys.stderr, echo_prompt: bool = True) -> str:
    """Generate text after ``prompt`` (a string, or ids already rendered, e.g. a chat prompt).

    Streams the prompt (when ``echo_prompt`` and it is a string) and each finished piece of text to ``stream``;
    writes the token rate to ``report`` (stderr by default; ``None`` for silence). Returns the generated text.
    """
    ids = prompt_ids(tokenizer, prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    dec = StreamDecoder(tokenizer)
    pieces: list[str] = []
    stops = set(getattr(tokenizer, "stop_ids", ()) or ())

    def emit(tok: int) -> None:
        if tok in stops:
            return
        s = dec.feed(tok)
        if s:
            pieces.append(s)
            if stream is not None:
                stream.write(s)
                stream.flush()

    if stream is not None and echo_prompt and isinstance(prompt, str):
        stream.write(prompt)
        stream.flush()
    new, t = generate_ids(model, ids, max_new_tokens, temperature, top_k, top_p, seed, stops, emit, device,
                          vocab_limit=getattr(tokenizer, "vocab_size", None))
    tail = dec.flush()
    if tail:
        pieces.append(tail)
        if stream is not None:
            stream.write(tail)
    if stream is not None:
        stream.flush()
    if report is not None:
        rate = t["new_tokens"] / t["decode_s"] if t["decode_s"] > 0 else float("inf")
        report.write(f"\nk3: {t['new_tokens']} tokens in {t['decode_s']:.2f} s ({rate:.1f} tok/s); prefill "
                     f"{t['prompt_tokens']} tokens in {t['prefill_s']:.3f} s\n")
        report.flush()
    return "".join(pieces)
