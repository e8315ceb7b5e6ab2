"""Gumbel-max sampling with a counter-based random stream per row (Philox4x32-10), on the device.

``argmax(x + G)`` with ``G = −log(−log U)`` draws from ``softmax(x)`` exactly. U is Philox4x32-10 keyed by the row's
64-bit seed at counter ``(c0 = vocabulary index, c1 = step, 0, 0)``, so a row's noise depends on its own seed and
step alone: reproducible per request whatever shares the batch, and no generator state to carry (a step counter
per row is the whole state).

``gumbel_argmax_reference`` is the plain PyTorch form (Philox in int64 arithmetic), used on CPU and as ground truth;
``gumbel_argmax`` runs the fused Triton kernel on CUDA (``gumbel_triton.py``: the noise never touches memory).
"""

from __future__ import annotations

import torch

__all__ = ["philox4x32", "philox_uniform", "gumbel_argmax_reference", "gumbel_argmax"]

_M32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key increments (Weyl sequence)


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of ``a · m`` for ``a`` in [0, 2³²) (int64) and a 32-bit constant m, without overflow."""
    t_lo = (a & 0xFFFF) * m  # < 2^48
    t_hi = (a >> 16) * m  # < 2^48
    mid = t_lo + ((t_hi & 0xFFFF) << 16)  # < 2^49
    return (t_hi >> 16) + (mid >> 32), mid & _M32


def philox4x32(c: tuple[torch.Tensor, ...], k: tuple[torch.Tensor, torch.Tensor],
               rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox4x32-``rounds`` of counter words ``c`` (four int64 tensors in [0, 2³²)) under key words ``k`` (two);
    returns the four output words (Random123's generator, as Triton's ``tl.randint4x``)."""
    c0, c1, c2, c3 = c
    k0, k1 = k
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi2, lo2 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
    return c0, c1, c2, c3


def philox_uniform(seeds: torch.Tensor, steps: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n]`` fp32 uniforms in (0, 1): Philox4x32-10 with key = seed (64 bits) at counter
    ``(c0 = column, c1 = step, 0, 0)``, first output word, its top 24 bits + ½, times 2⁻²⁴."""
    seed = seeds.to(torch.int64)
    c0 = torch.arange(n, device=seeds.device, dtype=torch.int64)[None, :].expand(seed.shape[0], n)
    c1 = (steps.to(torch.int64) & _M32)[:, None].expand_as(c0)
    zero = torch.zeros_like(c0)
    r = philox4x32((c0, c1, zero, zero), ((seed & _M32)[:, None], ((seed >> 32) & _M32)[:, None]))[0]
    return ((r >> 8).to(torch.float32) + 0.5) * (2.0 ** -24)


def gumbel_argmax_reference(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``argmax(x + G)`` per row, ``G = −log(−log U)`` with U from :func:`philox_uniform`; x ``[B, V]`` fp32
    (−inf = excluded). Returns ``[B]`` int64."""
    u = philox_uniform(seeds, steps, x.shape[1])
    return (x - torch.log(-torch.log(u))).argmax(-1)


def gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """:func:`gumbel_argmax_reference`, fused in one Triton kernel on CUDA."""
    if x.is_cuda:
        from k3.ops.sampling.gumbel_triton import gumbel_argmax_triton

        return gumbel_argmax_triton(x, seeds, steps)
    return gumbel_argmax_reference(x, seeds, steps)
