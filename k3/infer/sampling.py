"""Sampling on the device: per-request parameters, and a counter-based random stream per request.

``SamplingParams`` is what a request asks for. ``sample_tokens`` draws the next token of every row of a batch from
``logits [B, V]`` with per-row tensors (temperature, top-k, top-p, seed, step), all on the device and with static
shapes, so a decode step that samples can be captured in a CUDA graph and never waits for the host.

The draw is ``k3.ops.sampling.gumbel_argmax``: the Gumbel-max trick keyed by the request's seed and step, so a
row's randomness depends on its own seed and step alone and a seeded request gets the same tokens whatever other
requests share its batch (and whichever pool slot it lands in).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3.ops.sampling import gumbel_argmax

__all__ = ["SamplingParams", "sample_tokens", "sampling_mode", "SEED_LIMIT"]

SEED_LIMIT = 1 << 63  # seeds are kept as int64 on the device


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the stop rules.

    - ``max_tokens``: tokens to generate at most (≥ 1).
    - ``temperature``: 0 = greedy; else logits / temperature (≤ 100).
    - ``top_k``: sample among the k likeliest (0 = off). ``top_p``: the smallest set of likeliest tokens whose
      probability reaches top_p (1 = off).
    - ``seed``: the request's random stream (None: the engine draws one); same seed, same tokens.
    - ``stop``: strings that end the generation (not included in the output); ``stop_token_ids``: ids that end it
      (the tokenizer's stop ids are added unless ``ignore_eos``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "a positive integer")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "a number in [0, 100]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "a non-negative integer (0 = off)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "an integer or None")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a sequence of non-empty strings")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_token_ids):
            raise bad("stop_token_ids", "a sequence of non-negative integers")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p restricts the candidates."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


def sampling_mode(params: list[SamplingParams]) -> str:
    """The cheapest sampler that serves every row: "greedy", "sample" (temperature only) or "filtered"."""
    if all(p.temperature == 0 for p in params):
        return "greedy"
    return "filtered" if any(p.filtered for p in params) else "sample"


# --- the sampler ------------------------------------------------------------------------------------------------------
def _filter(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (−inf) what top-k (per row, 0 = off) and top-p (1 = off) exclude from ``x [B, V]`` (scaled logits)."""
    V = x.shape[1]
    sx, _ = torch.sort(x, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    probs = torch.softmax(sx, dim=-1)
    before = probs.cumsum(-1) - probs  # mass of the likelier tokens
    in_k = torch.arange(V, device=x.device)[None, :] < k[:, None]
    keep = in_k & ((before < top_p[:, None]) | (top_p[:, None] >= 1))
    keep[:, 0] = True  # the likeliest token always stays
    cut = torch.where(keep, sx, float("inf")).amin(-1, keepdim=True)  # the smallest kept value
    return x.masked_fill(x < cut, float("-inf"))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seeds: torch.Tensor, steps: torch.Tensor, mode: str = "filtered") -> torch.Tensor:
    """Next token ``[B]`` int64 of each row of ``logits [B, V]``; per-row ``temperature`` (0 = greedy), ``top_k``,
    ``top_p``, ``seeds``, ``steps`` (``[B]`` tensors on the logits' device). ``mode`` ("greedy", "sample",
    "filtered", see :func:`sampling_mode`) skips work no row needs; every mode gives every row its own answer."""
    greedy = logits.argmax(-1)
    if mode == "greedy":
        return greedy
    if mode not in ("sample", "filtered"):
        raise ValueError(f"mode must be 'greedy', 'sample' or 'filtered', got {mode!r}")
    hot = temperature > 0
    x = logits.float() / torch.where(hot, temperature, 1.0)[:, None]
    if mode == "filtered":
        x = _filter(x, top_k, top_p)
    return torch.where(hot, gumbel_argmax(x, seeds, steps), greedy)
