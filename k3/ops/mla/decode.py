"""Absorbed MLA over the latent cache pool (decode and short pieces), in Triton — FlashMLA's idea.

With W_UK, W_UV the k_nope and v rows of kv_b_proj (per head, ``[n, c]`` and ``[v, c]``):

    q·k = q_nope·(W_UK c_kv) + q_pe·k_pe = (W_UKᵀ q_nope)·c_kv + q_pe·k_pe = [q_lat ‖ q_pe]·[c_kv ‖ k_pe]
    o   = Σ_j p_j W_UV c_kv,j = W_UV (Σ_j p_j c_kv,j) = W_UV o_lat

so attention runs directly over the cached rows ``c_kv ‖ k_pe`` (c + r values per token, shared by every head —
multi-query attention with head dim c + r and value dim c). This kernel computes ``o_lat`` from ``q_lat ‖ q_pe``;
the layer applies W_UK before and W_UV after (bf16 matmuls on views of kv_b_proj's weight).

Schedule: program (split s, row group g, batch row b) loads the g-th group of BH query rows (the T·H (query, head)
pairs of row b) once, then streams its split of the row's cached tokens in blocks of BN: every cached block is read
from memory once per group (all heads of a group share it), scores and the running max/sum are fp32 in registers,
the ``[BH, c]`` accumulator too. Splits (flash-decoding) keep the SMs busy at batch 1 with a long cache: each writes
a normalised partial ``o`` and its log2-sum-exp, and ``mla_merge_kernel`` combines them. The grid depends only on
(B, T·H, capacity) and the split sizes are computed on the device from ``lengths``: no host sync, and a CUDA graph
captured once serves every length up to the capacity.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of
from k3.ops.kda.triton._common import RCP_LN2, sm_count
from k3.ops.mla.attention import use_triton
from k3.ops.mla.flash import load_tile
from k3.ops.mla.naive import mla_decode_ref

__all__ = ["mla_decode", "num_splits_for"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MIN_SPLIT = 256  # tokens per split at least: below it the partial-result traffic outweighs the cache read
ROWS_EST = 32  # rows per group assumed when sizing the split grid (the autotuned BH is 16–64)
SPLIT_ALIGN = 16 if _INTERPRET else 64  # split boundaries: multiples of every BN, the same in both kernels


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BH": 16, "BN": 16}, num_warps=4, num_stages=1)]
    pairs = [(16, 64, 4, 2), (16, 32, 4, 3), (32, 32, 4, 3), (32, 64, 8, 2), (64, 32, 8, 2)]
    return [triton.Config({"BH": bh, "BN": bn}, num_warps=w, num_stages=s) for bh, bn, w, s in pairs]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Row groups larger than the rows there are only add padding: keep BH ≤ max(16, next_pow2(T·H))."""
    cap = max(16, triton.next_power_of_2(named_args["TH"]))
    return [c for c in configs if c.kwargs["BH"] <= cap] or configs[:1]


@triton.jit
def _row(lengths, slots, i_b, P, CAP, HAS_SLOTS: tl.constexpr):
    """(pool row, valid length) of batch row ``i_b``. A row whose slot is outside the pool or whose length is
    outside [0, capacity] gets length 0 (it reads nothing; its output is NaN): values the host never checks (they
    live on the device) must not turn into reads past ``buf``, whose fault would poison the whole CUDA context."""
    length = tl.load(lengths + i_b)
    slot = i_b.to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(slots + i_b).to(tl.int64)
    ok = (slot >= 0) & (slot < P) & (length >= 0) & (length <= CAP)
    return tl.where(ok, slot, 0), tl.where(ok, length, 0)


@triton.jit
def _split_range(length, i_s, NUM_SPLITS, min_split, ALIGN: tl.constexpr):
    """Tokens [lo, hi) of split i_s for a row of ``length`` cached tokens (same formula in both kernels)."""
    split_len = tl.maximum(tl.cdiv(tl.cdiv(length, NUM_SPLITS), ALIGN) * ALIGN, min_split)
    lo = i_s * split_len
    return lo, tl.minimum(length, lo + split_len), split_len


@triton.autotune(configs=_configs(), key=["TH", "CR", "RR", "NUM_SPLITS", "PREC"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def mla_decode_split_kernel(q_lat, q_pe, buf, slots, lengths, o_part, lse_part, T, H, TH, NUM_SPLITS, min_split,
                            P, CAP, s_qb, s_qt, s_qh, s_pb, s_pt, s_ph, s_bp, s_bn, qk_scale,
                            CR: tl.constexpr, RR: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                            ALIGN: tl.constexpr, HAS_SLOTS: tl.constexpr, PREC: tl.constexpr, BH: tl.constexpr,
                            BN: tl.constexpr):
    i_s, i_g, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, length = _row(lengths, slots, i_b, P, CAP, HAS_SLOTS)
    lo, hi, _ = _split_range(length, i_s, NUM_SPLITS, min_split, ALIGN)

    o_r = i_g * BH + tl.arange(0, BH)  # (t, h) pairs of this batch row, t-major
    m_r = o_r < TH
    i_t, i_h = o_r // H, o_r % H
    o_c = tl.arange(0, C)
    q_off = i_b.to(tl.int64) * s_qb + i_t * s_qt + i_h * s_qh
    qc = tl.load(q_lat + q_off[:, None] + o_c[None, :], mask=m_r[:, None] & (o_c[None, :] < CR), other=0.0)
    if RR > 0:
        o_rr = tl.arange(0, R)
        p_off = i_b.to(tl.int64) * s_pb + i_t * s_pt + i_h * s_ph
        qr = tl.load(q_pe + p_off[:, None] + o_rr[None, :], mask=m_r[:, None] & (o_rr[None, :] < RR), other=0.0)
    pos_q = length - T + i_t  # query t sits at position length − T + t and sees keys j ≤ that

    acc = tl.zeros([BH, C], dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    base = buf + slot * s_bp
    for start_n in range(lo, hi, BN):
        o_n = start_n + tl.arange(0, BN)
        m_n = o_n < hi
        kc = load_tile(base, o_n, o_c, s_bn, hi, CR, True, C > CR)
        s = tl.dot(qc, tl.trans(kc), input_precision=PREC)
        if RR > 0:
            kr = load_tile(base + CR, o_n, o_rr, s_bn, hi, RR, True, R > RR)
            s += tl.dot(qr, tl.trans(kr), input_precision=PREC)
        s = tl.where((o_n[None, :] <= pos_q[:, None]) & m_n[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing of this split yet
        p = tl.exp2(s - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc, input_precision=PREC)
        m_i = m_new

    live = m_r & (lo < hi)  # splits past the row's length write nothing (the merge does not read them)
    part = (i_b.to(tl.int64) * NUM_SPLITS + i_s) * TH
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(o_part + (part + o_r)[:, None] * C + o_c[None, :], acc / l_safe[:, None], mask=live[:, None])
    tl.store(lse_part + part + o_r, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)), mask=live)


@triton.jit
def mla_merge_kernel(o_part, lse_part, slots, lengths, out, T, H, TH, NUM_SPLITS, min_split, P, CAP, s_ob, s_ot,
                     s_oh, CR: tl.constexpr, C: tl.constexpr, ALIGN: tl.constexpr, HAS_SLOTS: tl.constexpr,
                     BS: tl.constexpr, BC: tl.constexpr):
    """o = Σ_s 2^{lse_s − m} o_s / Σ_s 2^{lse_s − m} over the row's live splits, m = max_s lse_s.

    One program per (column block, query row, batch row), BS splits per step: at batch 1 with a long cache there
    are hundreds of splits, and one program walking them one by one would take longer than the split kernel.
    """
    i_c, i_r, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, length = _row(lengths, slots, i_b, P, CAP, HAS_SLOTS)
    _, _, split_len = _split_range(length, 0, NUM_SPLITS, min_split, ALIGN)
    n_splits = tl.cdiv(length, split_len)
    row = i_b.to(tl.int64) * NUM_SPLITS * TH + i_r  # partial s of this row: row + s·TH
    o_s = tl.arange(0, BS)
    m = tl.full([BS], float("-inf"), dtype=tl.float32)
    for s0 in range(0, n_splits, BS):
        m = tl.maximum(m, tl.load(lse_part + row + (s0 + o_s) * TH, mask=s0 + o_s < n_splits, other=float("-inf")))
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # a query that sees no key: all weights 0 → o = NaN
    o_c = i_c * BC + tl.arange(0, BC)
    acc = tl.zeros([BC], dtype=tl.float32)
    l_s = tl.zeros([BS], dtype=tl.float32)
    for s0 in range(0, n_splits, BS):
        m_s = s0 + o_s < n_splits
        p = row + (s0 + o_s) * TH
        w = tl.exp2(tl.load(lse_part + p, mask=m_s, other=float("-inf")) - m_all)
        o = tl.load(o_part + p[:, None] * C + o_c[None, :], mask=m_s[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        l_s += w
    i_t, i_h = i_r // H, i_r % H
    dst = out + i_b.to(tl.int64) * s_ob + i_t * s_ot + i_h * s_oh + o_c
    tl.store(dst, (acc / tl.sum(l_s, 0)).to(out.dtype.element_ty), mask=o_c < CR)


def _check_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor | None,
                  lengths: torch.Tensor) -> None:
    if q_lat.dim() != 4 or q_pe.dim() != 4 or q_pe.shape[:3] != q_lat.shape[:3]:
        raise ValueError(f"q_lat and q_pe must be [B, T, H, c] and [B, T, H, r], got {tuple(q_lat.shape)} and "
                         f"{tuple(q_pe.shape)}")
    B, T, _, c = q_lat.shape
    if buf.dim() != 3 or buf.shape[-1] != c + q_pe.shape[-1]:
        raise ValueError(f"buf must be [P, capacity, c + r = {c + q_pe.shape[-1]}], got {tuple(buf.shape)}")
    if buf.dtype != q_lat.dtype or q_pe.dtype != q_lat.dtype or buf.device != q_lat.device:
        raise ValueError(f"buf, q_lat, q_pe must share dtype and device, got {buf.dtype}/{q_lat.dtype}/{q_pe.dtype}"
                         f" on {buf.device}/{q_lat.device}")
    if lengths.shape != (B,) or lengths.dtype != torch.int32 or lengths.device != q_lat.device:
        raise ValueError(f"lengths must be int32 [B={B}] on {q_lat.device}, got {lengths.dtype} "
                         f"{tuple(lengths.shape)} on {lengths.device}")
    if slots is not None and (slots.shape != (B,) or slots.is_floating_point() or slots.device != q_lat.device):
        raise ValueError(f"slots must be an integer tensor [B={B}] on {q_lat.device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")
    if buf.stride(-1) != 1 or q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("buf, q_lat and q_pe must have a contiguous last dimension")
    if slots is None and B > buf.shape[0]:
        raise ValueError(f"buf must hold a pool row per batch row without slots: B={B} > {buf.shape[0]} rows")
    if lengths.device.type == "cpu" and B > 0 and not torch.compiler.is_compiling():  # no device sync: CPU only
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < T or hi > buf.shape[1]:
            raise ValueError(f"lengths must be in [T={T}, capacity={buf.shape[1]}], got {lengths.tolist()}")
        if slots is not None and not bool(((slots >= 0) & (slots < buf.shape[0])).all()):
            raise ValueError(f"slots must be in [0, {buf.shape[0]}), got {slots.tolist()}")


def num_splits_for(batch: int, rows: int, capacity: int, device: torch.device) -> int:
    """Splits per batch row: enough programs for two waves over the SMs, no split shorter than ``MIN_SPLIT``
    tokens at full capacity. Depends only on shapes (CUDA-graph friendly)."""
    groups = triton.cdiv(rows, ROWS_EST)
    want = triton.cdiv(2 * sm_count(device), batch * groups)
    return max(1, min(want, triton.cdiv(capacity, MIN_SPLIT)))


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor | None,
               lengths: torch.Tensor, scale: float, num_splits: int | None = None,
               min_split: int = MIN_SPLIT) -> torch.Tensor:
    """Absorbed MLA attention over a latent cache pool (forward only).

    ``q_lat [B, T, H, c]`` (W_UKᵀ q_nope), ``q_pe [B, T, H, r]``, ``buf [P, capacity, c + r]`` (the pool),
    ``slots`` integer ``[B]`` (pool row of each batch row; None = rows 0..B−1), ``lengths`` int32 ``[B]`` (valid
    tokens per row including this piece's T, all on the device) → ``o_lat [B, T, H, c]`` in q_lat's dtype. Query t
    of row b sits at position ``lengths[b] − T + t`` and sees the cached tokens up to it. ``num_splits`` /
    ``min_split`` override the split-K sizing (tests). No host sync on CUDA; the launch grid depends only on
    shapes, so the call can be captured in a CUDA graph. Lengths and slots are checked on CPU (``ValueError``);
    on the device, where checking would sync, a row with a slot outside the pool or a length outside
    [0, capacity] reads nothing and returns NaN.
    """
    _check_decode(q_lat, q_pe, buf, slots, lengths)
    if min_split < 1 or (num_splits is not None and num_splits < 1):
        raise ValueError(f"num_splits and min_split must be ≥ 1, got {num_splits} and {min_split}")
    if not use_triton(q_lat):
        return mla_decode_ref(q_lat, q_pe, buf, slots, lengths, scale)
    return _mla_decode_op(q_lat, q_pe, buf, slots, lengths, float(scale), num_splits, int(min_split))


@torch.library.custom_op("k3::mla_decode", mutates_args=())
def _mla_decode_op(q_lat: torch.Tensor, q_pe: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor | None,
                   lengths: torch.Tensor, scale: float, num_splits: int | None, min_split: int) -> torch.Tensor:
    """The Triton launches as one opaque op: ``torch.compile`` of a decode step keeps it as a graph node."""
    B, T, H, CR = q_lat.shape
    RR = q_pe.shape[-1]
    TH = T * H
    NS = num_splits if num_splits is not None else num_splits_for(B, TH, buf.shape[1], q_lat.device)
    C = max(16, triton.next_power_of_2(CR))
    R = max(16, triton.next_power_of_2(RR)) if RR > 0 else 16
    o_part = torch.empty(B, NS, TH, C, dtype=torch.float32, device=q_lat.device)
    lse_part = torch.empty(B, NS, TH, dtype=torch.float32, device=q_lat.device)
    out = torch.empty(B, T, H, CR, dtype=q_lat.dtype, device=q_lat.device)
    prec = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    has_slots = slots is not None
    slots_t = slots if has_slots else lengths  # a placeholder pointer, never read
    P, CAP = buf.shape[:2]
    q_pe_t = q_pe if RR > 0 else q_lat
    with on_device_of(q_lat):
        mla_decode_split_kernel[lambda m: (NS, triton.cdiv(TH, m["BH"]), B)](
            q_lat, q_pe_t, buf, slots_t, lengths, o_part, lse_part, T, H, TH, NS, min_split, P, CAP,
            *q_lat.stride()[:3], *q_pe_t.stride()[:3], buf.stride(0), buf.stride(1), scale * RCP_LN2,
            CR=CR, RR=RR, C=C, R=R, ALIGN=SPLIT_ALIGN, HAS_SLOTS=has_slots, PREC=prec)
        BC = min(64, C)  # divides C (both powers of two): column blocks stay inside a partial's row
        mla_merge_kernel[(triton.cdiv(CR, BC), TH, B)](
            o_part, lse_part, slots_t, lengths, out, T, H, TH, NS, min_split, P, CAP, *out.stride()[:3], CR=CR, C=C,
            ALIGN=SPLIT_ALIGN, HAS_SLOTS=has_slots, BS=32, BC=BC, num_warps=4)
    return out


@_mla_decode_op.register_fake
def _(q_lat, q_pe, buf, slots, lengths, scale, num_splits, min_split):
    return torch.empty_like(q_lat, memory_format=torch.contiguous_format)
