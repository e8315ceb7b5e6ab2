"""The routed experts' FFN for few rows: its plain reference, the input checks and the row threshold below which
``grouped.grouped_ffn`` runs the fused kernels of ``experts_small_triton`` (inference only).

Letters: R rows sorted by expert, E experts, ℓ latent width, F expert width; ``offs [E]`` int32 cumulative group
ends (rows ``offs[e-1]:offs[e]`` go through expert e), ``w1, w3 [E, F, ℓ]``, ``w2 [E, ℓ, F]``.
"""

from __future__ import annotations

import torch

from k3.ops.moe.situ import situ_bound, situ_glu_reference

__all__ = ["SMALL_ROWS", "check_ffn_inputs", "grouped_ffn_reference"]

# Rows up to which an inference call of ``grouped_ffn`` takes the fused small-row kernels (experts_small_triton.py)
# instead of grouped_mm. Below it the mean rows per expert stay at most 8 at 128 experts (decode batches up to 128
# tokens at top-8): far under the ~200 rows per expert where a GEMM over one expert's weights stops being
# memory-bound, so both paths move the same weight bytes and the fused one saves grouped_mm's launches and its
# tiles over empty groups. Above it (prefill) CUTLASS's tiling of large groups wins. `python -m k3.bench moe
# --only small` times both at R = 8 … 2048 (bench/gpu/moedecode.sh), which is where to check the crossover.
SMALL_ROWS = 1024


def check_ffn_inputs(x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                     beta1: float = 4.0, beta2: float = 25.0, rows: torch.Tensor | None = None) -> None:
    """``ValueError`` naming the argument unless ``x [R, ℓ]`` float, ``offs [E]`` int32 (non-decreasing in [0, R],
    checked only where it costs no device sync: on the CPU), ``w1, w3 [E, F, ℓ]``, ``w2 [E, ℓ, F]`` on one device;
    with ``rows`` (the token of each sorted row): ``x [m, ℓ]``, ``rows [R]`` int64 in [0, m) (values checked on the
    CPU), R = its length."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor [R, ℓ], got {getattr(x, 'dtype', type(x))} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if w1.dim() != 3 or w1.shape[2] != x.shape[1]:
        raise ValueError(f"w1 must be [E, F, ℓ={x.shape[1]}], got {tuple(w1.shape)}")
    E, Fw, L = w1.shape
    if w3.shape != w1.shape:
        raise ValueError(f"w3 must have w1's shape {tuple(w1.shape)}, got {tuple(w3.shape)}")
    if w2.shape != (E, L, Fw):
        raise ValueError(f"w2 must be [E={E}, ℓ={L}, F={Fw}], got {tuple(w2.shape)}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.shape != (E,):
        raise ValueError(f"offs must be an int32 tensor [E={E}] of cumulative group ends, got "
                         f"{getattr(offs, 'dtype', type(offs))} {tuple(getattr(offs, 'shape', ()))}")
    if len({t.device for t in (x, offs, w1, w3, w2)}) != 1:
        raise ValueError(f"x, offs, w1, w3 and w2 must be on one device, got {x.device}, {offs.device}, "
                         f"{w1.device}, {w3.device}, {w2.device}")
    R = x.shape[0]
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64 \
                or rows.device != x.device:
            raise ValueError(f"rows must be a 1-D int64 tensor on x's device, got {getattr(rows, 'dtype', type(rows))} "
                             f"{tuple(getattr(rows, 'shape', ()))}")
        if rows.device.type == "cpu" and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= x.shape[0]):
            raise ValueError(f"rows must index x's {x.shape[0]} tokens, got values in "
                             f"[{int(rows.min())}, {int(rows.max())}]")
        R = rows.shape[0]
    if offs.device.type == "cpu" and E:
        o = offs.long()
        if o[0] < 0 or bool((o[1:] < o[:-1]).any()) or o[-1] > R:
            raise ValueError(f"offs must be non-decreasing in [0, R={R}], got {offs.tolist()[:16]}")
    if not (beta1 > 0 and beta2 > 0):
        raise ValueError(f"beta1 and beta2 must be > 0, got {beta1}, {beta2}")


def grouped_ffn_reference(x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                          beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """The plain per-expert loop (reads ``offs`` on the host): gate and up products in fp32 (fp64 for fp64 inputs),
    SiTU-GLU, h rounded to x.dtype, the down product in fp32; rows past ``offs[-1]`` zero. Returns x.dtype.
    SiTU's output is clamped strictly inside ±β1·β2 in x.dtype (``situ_bound``), as the stored h must be."""
    check_ffn_inputs(x, offs, w1, w3, w2, beta1, beta2)
    ct = torch.promote_types(x.dtype, torch.float32)
    lim = situ_bound(beta1, beta2, x.dtype)
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=ct, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            xe = x[start:end].to(ct)
            h = situ_glu_reference(xe @ w1[e].to(ct).t(), xe @ w3[e].to(ct).t(), beta1, beta2).clamp(-lim, lim)
            y[start:end] = h.to(x.dtype).to(ct) @ w2[e].to(ct).t()
        start = end
    return y.to(x.dtype)
