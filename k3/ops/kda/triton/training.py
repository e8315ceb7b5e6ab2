"""Training: the 64-token forward over every chunk at once (buffers kept) and the backward's four stages.

Forward: ``prep.launch_prep`` (storing T) over all chunks, then ``fwd_state.launch_state`` (storing each chunk's
entry state and V'). Backward, in order: the reverse state pass (``bwd_state``), the WY backward (``bwd_wy``), the
intra-chunk backward and the dG → dg + gate backward (``bwd_intra``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from k3.ops.kda.triton._common import BC, BT, ChunkTable, dot_precision, next_pow2, store_dtype
from k3.ops.kda.triton.bwd_intra import launch_intra
from k3.ops.kda.triton.bwd_state import bwd_state_pass
from k3.ops.kda.triton.bwd_wy import launch_wy
from k3.ops.kda.triton.fwd_state import launch_state
from k3.ops.kda.triton.prep import alloc_chunk_buffers, launch_prep

__all__ = ["TrainPlan", "prep_all", "state_all", "kda_bwd", "intra_precision"]


@dataclass(frozen=True)
class TrainPlan:
    """Launch choices of the backward that tests may vary. ``intra_bk``: the intra-chunk backward's K-slice (all of
    K up to 128 in one slice; larger K walks slices through fp32 scratch rows)."""

    intra_bk: int = 128


def prep_all(q, k, v, g, beta, A_log, dt_bias, scale: float, tab: ChunkTable, lower_bound, flags: dict) -> dict:
    """The chunk buffers (W, U, kg, qg, A_qk, γ, T) of every chunk at once, kept for the backward."""
    BK, BVP = next_pow2(q.shape[-1]), next_pow2(v.shape[-1])
    bufs = alloc_chunk_buffers(q.shape[2], tab.NC, BK, BVP, store_dtype(q.dtype), q.device, store_t=True)
    launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs, tab, 0, tab.NC, scale, lower_bound, flags, True)
    for scratch in ("LD", "TOT", "KR"):  # the backward does not need the prep's scratches
        bufs.pop(scratch)
    return bufs


def state_all(bufs: dict, o, ht, tab: ChunkTable, H: int, K: int, V: int) -> dict:
    """The state pass over every chunk from ``ht`` (updated in place to the final states), writing ``o``, the
    per-chunk entry states (``HS``) and V' (``VN``, in place of U, which the backward then does not need); returns
    what the backward reads."""
    BK, BVP = bufs["W"].shape[-1], bufs["U"].shape[-1]
    hs = torch.empty(H, tab.NC, BK, BVP, dtype=bufs["W"].dtype, device=o.device)
    vn = torch.empty_like(bufs["U"])
    launch_state(bufs, o, hs, ht, tab, 0, tab.NC, H, K, V, vn=vn)
    return dict({n: b for n, b in bufs.items() if n != "U"}, HS=hs, VN=vn)


def intra_precision(dtype: torch.dtype, one_slice: bool, interp: bool) -> tuple[str, str, torch.dtype]:
    """``(diagonal-block precision, off-diagonal precision, dq/dk share dtype)`` of the intra-chunk backward.

    dG is a sum of row and column shares that cancel strongly when decays are strong: fp32 inputs keep exact dots;
    bf16 inputs tf32 on the diagonal blocks, one bf16 pass off them, and 16-bit dq/dk shares when the intra kernel
    reads them once (all of K in one slice; fp16 under the interpreter, which cannot load bf16). fp16 inputs carry 3
    more mantissa bits than bf16 and fla's fp16 tolerances are tighter (dg 1.5%, ddt_bias 0.5%): they take exact
    dots and fp32 shares (fp16 ones could overflow). On fla's fp16 varlen case (softplus gate in the kernel, 90% of
    gates −1000; on an H200) tf32 dots left ddt_bias 1.0% off and dA_log 4.3% (fla's error ratio); exact dots 0.04% and
    0.06%."""
    if dtype != torch.bfloat16:
        return "ieee", "ieee", torch.float32
    if interp:  # no bf16 products or loads in the interpreter (it computes the dots in fp32 anyway)
        return "tf32", "tf32x3", torch.float16 if one_slice else torch.float32
    return "tf32", "bf16", torch.bfloat16 if one_slice else torch.float32


def kda_bwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale: float, do, dht, saved: dict, tab: ChunkTable,
            lower_bound, flags: dict, state_grads: tuple | None = None, plan: TrainPlan = TrainPlan()):
    """Gradients (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0) of chunk KDA; ``saved`` from :func:`state_all`.
    ``state_grads``: the result of :func:`bwd_state_pass` for this ``do``/``dht`` when the caller already ran it."""
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    N, NC = tab.N, tab.NC
    # empty, not zeros: every kernel writes each element it owns once, so a missed write shows up as garbage (NaN
    # in the tests, which poison torch.empty) instead of hiding as a plausible zero gradient
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g)
    dv, db = torch.empty_like(v), torch.empty_like(beta)
    dA = torch.zeros_like(A_log) if A_log is not None else None
    ddt = torch.zeros_like(dt_bias) if dt_bias is not None else None
    if NC == 0:
        dh0 = torch.zeros(N, H, K, V, dtype=torch.float32, device=dev)
        if dht is not None:
            dh0.copy_(dht)
        return dq, dk, dv, dg, db, dA, ddt, (dh0 if initial_state is not None else None)
    do = do.contiguous()  # e.g. o.sum().backward() hands over a stride-0 gradient: the kernels index densely
    dht = dht.contiguous() if dht is not None else None
    BK, BVP = next_pow2(K), next_pow2(V)
    prec = dot_precision(q.dtype)
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    prec_intra, prec_off, sdt = intra_precision(q.dtype, plan.intra_bk >= BK, interp)
    flag_kw = dict(USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None, HAS_A=A_log is not None,
                   HAS_DT=dt_bias is not None, L2NORM=flags["l2norm"], BETA_SIGMOID=flags["beta_sigmoid"],
                   IS_VARLEN=tab.varlen)
    lb = float(lower_bound) if lower_bound is not None else 0.0
    f32 = dict(dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, **f32)
    a_log = A_log if A_log is not None else dummy
    dtb = dt_bias if dt_bias is not None else dummy

    if state_grads is None:
        state_grads = bwd_state_pass(do, dht, saved, tab, H, K, V, q.dtype)
    DHS, DV, dh0 = state_grads

    DQ, DK = (torch.empty(H, NC, BT, BK, dtype=sdt, device=dev) for _ in range(2))
    DG = torch.empty(H, NC, BT, BK, **f32)
    DL, DAQ = (torch.empty(H, NC, BT, BT, **f32) for _ in range(2))
    RN = torch.empty(H, NC, 2, BT, **f32) if flags["l2norm"] else dummy
    GS = torch.empty(H, NC, BT, BK, **f32)
    DB = launch_wy(q, k, v, g, beta, a_log, dtb, do, RN, GS, saved, DHS, DV, dv, DQ, DK, DG, DL, DAQ, tab, H, K, V,
                   scale, lb, BT, BK, BVP, prec, flag_kw)
    DAP, DDT = launch_intra(q, k, g, beta, a_log, dtb, RN, GS, DQ, DK, DG, DB, DL, DAQ, dq, dk, dg, db, tab, H, K,
                            lb, BT, BC, BK, prec_intra, prec_off, flag_kw, flags["exact_diag"], plan.intra_bk)
    if flags["use_gate"]:
        if dA is not None:
            dA = DAP.reshape(H, -1).sum(1).to(A_log.dtype).reshape(A_log.shape)
        if ddt is not None:
            ddt = DDT.sum(1)[:, :K].to(dt_bias.dtype).reshape(dt_bias.shape)
    return dq, dk, dv, dg, db, dA, ddt, (dh0 if initial_state is not None else None)
