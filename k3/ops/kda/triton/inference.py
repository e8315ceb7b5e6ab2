"""Inference prefill (no gradients): windows of chunk buffers, so working memory does not grow with T.

Two flows, chosen per call by :func:`use_c16`:

- the 16-token flow (``inference_prep`` + ``inference_state``) for bounded gates once its state pass has enough
  programs (``InferencePlan.c16_min_programs``): its light prep and wgmma-shaped state pass win there;
- the 64-token flow (``prep`` + ``fwd_state``, T not stored) otherwise: unbounded gates (the 16-token prep's right
  factor k e^{−G} needs the bound) and few heads, where the 64-token state pass is faster per token.

On CUDA with more than one window, the prep of window w + 1 runs on a side stream beside the state pass of window w
(two window buffers; ``_common.pipelined``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from k3.ops.kda.triton._common import ChunkTable, alloc_output_state, next_pow2, pipelined, store_dtype
from k3.ops.kda.triton.fwd_state import launch_state
from k3.ops.kda.triton.inference_prep import alloc_c16_buffers, c16_window_chunks, launch_c16_prep
from k3.ops.kda.triton.inference_state import launch_c16_state, state_blocks
from k3.ops.kda.triton.prep import alloc_chunk_buffers, chunk_bytes, launch_prep

__all__ = ["InferencePlan", "kda_fwd_inference", "use_c16", "unsplit_windows"]

_WINDOW_BUFFERS = 2  # window buffers taking turns when the prep runs one window ahead


@dataclass(frozen=True)
class InferencePlan:
    """``window_bytes``: chunk buffers per window (1 GiB). ``c16_min_programs``: the 16-token flow from this many
    state-pass programs (sequences × heads × V-blocks of 64); H200, B=1 T=1M: at H = 32 (64 programs) 49.4 against
    62.4 ms for the 64-token flow, at 32 programs 5.11 against 4.91."""

    window_bytes: int = 1 << 30
    c16_min_programs: int = 64


def use_c16(lower_bound, flags: dict, heads: int, BVP: int, plan: InferencePlan, BK: int = 128) -> bool:
    """Whether inference runs the 16-token flow: a bounded gate and ``heads`` (sequences × heads) × V-blocks of the
    padded V width ``BVP`` ≥ ``plan.c16_min_programs``."""
    if lower_bound is None or flags["exact_diag"]:
        return False
    return heads * state_blocks(BVP, BK) >= plan.c16_min_programs


def unsplit_windows(lens: list[int], H: int, K: int, V: int, dtype: torch.dtype,
                    plan: InferencePlan = InferencePlan()) -> int:
    """Windows of the 64-token flow's buffers for sequences of ``lens`` tokens (the split's cost model compares its
    overlapped windows against the split)."""
    ncw = max(1, plan.window_bytes // chunk_bytes(H, next_pow2(K), next_pow2(V), store_dtype(dtype)))
    return -(-sum(-(-n // 64) for n in lens) // ncw)


def kda_fwd_inference(q, k, v, g, beta, A_log, dt_bias, scale: float, initial_state, tab: ChunkTable, lower_bound,
                      flags: dict, plan: InferencePlan = InferencePlan()) -> tuple[torch.Tensor, torch.Tensor]:
    """The windowed forward: ``(o [B, T, H, V] in q's dtype, final states [N, H, K, V] fp32)``."""
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(q.dtype)
    o, ht = alloc_output_state(q, v, initial_state, tab)
    if tab.NC == 0:
        return o, ht
    if use_c16(lower_bound, flags, tab.N * H, BVP, plan, BK):
        ncw = c16_window_chunks(tab.NC, plan.window_bytes, H, BK, BVP, dt)
        run_windows(tab.NC, ncw, q.device,
                    lambda: alloc_c16_buffers(H, ncw, BK, BVP, dt, q.device),
                    lambda b, c0, n: launch_c16_prep(q, k, v, g, beta, A_log, dt_bias, b, tab, c0, n, scale,
                                                     lower_bound, flags),
                    lambda b, c0, n: launch_c16_state(b, o, ht, tab, c0, c0 + n, H, K, V))
        return o, ht
    ncw = max(1, min(tab.NC, plan.window_bytes // chunk_bytes(H, BK, BVP, dt)))
    run_windows(tab.NC, ncw, q.device,
                lambda: alloc_chunk_buffers(H, ncw, BK, BVP, dt, q.device, store_t=False),
                lambda b, c0, n: launch_prep(q, k, v, g, beta, A_log, dt_bias, b, tab, c0, n, scale, lower_bound,
                                             flags, False),
                lambda b, c0, n: launch_state(b, o, None, ht, tab, c0, c0 + n, H, K, V))
    return o, ht


def run_windows(NC: int, ncw: int, device: torch.device, alloc: Callable[[], dict],
                prep: Callable[[dict, int, int], None], state: Callable[[dict, int, int], None]) -> None:
    """``prep(bufs, c0, n)`` fills a window's buffers, ``state(bufs, c0, n)`` runs the state pass over them. On CUDA
    with more than one window the prep runs on a side stream one window ahead (``_common.pipelined``)."""
    if not (device.type == "cuda" and NC > ncw):
        bufs = alloc()
        for c0 in range(0, NC, ncw):
            n = min(ncw, NC - c0)
            prep(bufs, c0, n)
            state(bufs, c0, n)
        return
    spans = [(c0, min(ncw, NC - c0)) for c0 in range(0, NC, ncw)]
    pipelined(spans, [alloc() for _ in range(_WINDOW_BUFFERS)], lambda sp, b: prep(b, *sp),
              lambda sp, b: state(b, *sp), device)
