"""Span summaries for the exact parallel prefix (SPEC §2): per sequence, the affine map S_out = M·S_in + S_ext,
and the one-card split prefill built on them.

The state pass runs on the extended columns [S_ext | M] (``[K, V + K]``): chunk by chunk
V' = [U | 0] − W [S_ext | M];  [S_ext | M] ← Diag(γ) [S_ext | M] + kgᵀ V', from [0 | I]. Column blocks of the
extended state are independent programs, so the M chain costs one more state pass of K columns. fp32 state,
windowed like the inference forward (memory does not grow with T).

``span_summaries_triton``: per-sequence summaries (its own prep; used by context parallel).
``split_prefill_triton``: the split prefill. Segments are chunk-aligned, so each window's prep runs once and its
buffers feed both the span pass (``_kda_span_rows``, explicit chunk ranges per row) and one state pass over the
segment table (``chunk_fwd.launch_state``) that starts every segment from its exact entry state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import (
    BT,
    ChunkTable,
    _chunk_range,
    _span_row_program,
    dot_precision,
    make_chunk_table,
    next_pow2,
    store_dtype,
)
from k3.ops.kda.triton import chunk16 as c16_flow
from k3.ops.kda.triton.chunk_fwd import (
    FwdConfig,
    alloc_chunk_buffers,
    alloc_output_state,
    chunk_bytes,
    launch_prep,
    launch_state,
    pipelined,
)
from k3.utils import overridden_attrs


class SpanConfig:
    bv = 32
    warps = 4
    stages = 2


@triton.jit
def _span_columns(W, U, KG, GAM, SE, M, i_b, i_r, i_h, lo, hi, c0, NCw, H, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr, PREC: tl.constexpr):
    """Column block ``i_b`` of row ``i_r``'s extended state [S_ext | M] through chunks [lo, hi) of the window of
    buffers that starts at chunk c0: V' = [U | 0] − W S;  S ← Diag(γ) S + kgᵀ V', started from the row's contents
    and written back. Blocks below BVP are S_ext (``SE [R, H, K, V]``), the others M (``M [R, H, K, K]``)."""
    DT: tl.constexpr = W.dtype.element_ty
    is_m = i_b * BV >= BVP
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    col = tl.where(is_m, i_b * BV - BVP, i_b * BV) + tl.arange(0, BV)
    ncol = tl.where(is_m, K, V)
    m_s = (o_k < K)[:, None] & (col < ncol)[None, :]
    p_s = ((i_r * H + i_h).to(tl.int64) * K + o_k[:, None]) * ncol + col[None, :]
    if is_m:
        S = tl.load(M + p_s, mask=m_s, other=0.)
    else:
        S = tl.load(SE + p_s, mask=m_s, other=0.)
    m_u = (col < BVP)[None, :] & (i_b * BV < BVP)  # M columns: V' = 0 − W M
    for c in range(lo, hi):
        base = (i_h * NCw + (c - c0)).to(tl.int64)
        p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
        b_w = tl.load(W + p_tk)
        b_kg = tl.load(KG + p_tk)
        b_gam = tl.load(GAM + base * BK + o_k)
        b_u = tl.load(U + (base * BT + o_t[:, None]) * BVP + col[None, :], mask=m_u, other=0.)
        b_vn = (b_u.to(tl.float32) - tl.dot(b_w, S.to(DT), input_precision=PREC)).to(DT)
        S = S * b_gam[:, None] + tl.dot(tl.trans(b_kg), b_vn, input_precision=PREC)
    if is_m:
        tl.store(M + p_s, S, mask=m_s)
    else:
        tl.store(SE + p_s, S, mask=m_s)


@triton.jit(do_not_specialize=['c0', 'c1', 'NCw', 'NT', 'H'])
def _kda_span_state(
    W, U, KG, GAM, SE, M,
    chunk_off, c0, c1, NCw, NT,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    cs, ce = _chunk_range(i_n, chunk_off, NT, IS_VARLEN)
    lo = tl.maximum(cs, c0)
    hi = tl.minimum(ce, c1)
    if lo < hi:
        _span_columns(W, U, KG, GAM, SE, M, i_b, i_n, i_h, lo, hi, c0, NCw, H, K, V, BT, BK, BV, BVP, PREC)


def span_summaries_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: ``M [N, H, K, K]`` fp32 (product over chunks of Diag(e^{G_C}) − kgᵀW) and ``S_ext [N, H, K, V]``
    fp32 (the final state from a zero initial state). Forward only (no autograd)."""
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    tab = make_chunk_table(B, Tq, cu_seqlens, q.device)
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(q.dtype)
    S_ext = torch.zeros(tab.N, H, K, V, dtype=torch.float32, device=q.device)
    M = torch.eye(K, dtype=torch.float32, device=q.device).repeat(tab.N, H, 1, 1).contiguous()
    if tab.NC == 0:
        return M, S_ext
    flags = dict(l2norm=bool(use_qk_l2norm_in_kernel), use_gate=bool(use_gate_in_kernel),
                 beta_sigmoid=bool(use_beta_sigmoid_in_kernel), exact_diag=lower_bound is None)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    ncw = max(1, min(tab.NC, FwdConfig.window_bytes // chunk_bytes(H, BK, BVP, dt)))
    bufs = alloc_chunk_buffers(H, ncw, BK, BVP, dt, q.device, store_t=False)
    bv = min(SpanConfig.bv, BVP, BK)
    for c0 in range(0, tab.NC, ncw):
        n = min(ncw, tab.NC - c0)
        launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs, tab, c0, n, float(scale), lower_bound, flags, False)
        _kda_span_state[((BVP + BK) // bv, tab.N * H)](
            bufs["W"], bufs["U"], bufs["KG"], bufs["GAM"], S_ext, M, tab.chunk_off, c0, c0 + n, ncw, tab.NT,
            H, K, V, BT=BT, BK=BK, BV=bv, BVP=BVP, IS_VARLEN=tab.varlen, PREC=dot_precision(q.dtype),
            num_warps=SpanConfig.warps, num_stages=SpanConfig.stages)
    return M, S_ext


# ---------------------------------------------------------------------------------------------------------------
# One-card split prefill: ONE prep per chunk, span summaries from the kept chunk buffers, one segmented state pass
# ---------------------------------------------------------------------------------------------------------------


class SplitConfig:
    """Knobs of :func:`split_prefill_triton` (class attributes, so a benchmark can switch them)."""

    # columns per span program (of [S | M], V + K columns): 64 as in context parallel (`CPConfig.span_bv`); H200
    # (knob_ab, session 9) B=1 H=8 T=1M 21.46 → 21.24 ms at the chosen 5 segments, 20.94 at 8 (32 → 64 halves the
    # re-reads of W, kg, U per chunk)
    span_bv = 64
    span_warps = 4
    span_stages = 3  # same loads as the state pass minus qg / A_qk; the state pass gained 2 → 3 stages (v3)
    window_bytes: int | None = None  # chunk buffers per window; None: max(FwdConfig's, min(cap, share of free))
    window_cap = 2 << 30  # larger windows only save per-window launches (~0.1 ms each)
    free_share = 0.25  # of the free device memory, at most
    # the segmented state pass: None = FwdConfig's (BV 64 at 4 warps since session 4: 1.55 µs per 64-column step,
    # the split rows of kda_split_h200.md were measured with it)
    state_bv: int | None = None
    state_warps: int | None = None
    state_stages: int | None = None
    # CUDA: the prep of window w + 1 on a side stream beside the span / fold / state pass of window w (two window
    # buffers), with ``serial_priority`` the serial passes on a high-priority stream, so the block scheduler places
    # their programs before the next window's prep programs take the free slots (as ``FwdConfig.state_priority``
    # does for the unsplit flow). H200, B=1 H=8 T=1M, c16 split at P = 8 (session 15, same process): 15.28 → 13.95 ms
    # (the fp64 torch fold), 14.78–14.94 → 14.07–14.26 (the fold kernel); overlap without the priority stream 15.68
    # (no gain: session 4 measured none for the 64-token split either)
    overlap_prep = True
    serial_priority = True
    # the kernels of the split: "c64" (64-token prep, span and state passes) or "c16" (the 16-token flow's prep and
    # state pass, ``chunk16._c16_span_rows`` for the spans; bounded gates, mode 2 or 3, else "c64" runs; the cost model
    # then is ``SplitCostModel.c16``). H200 (session 14, same process), B=1 H=8 T=1M: "c64" 21.0–21.1 ms, "c16"
    # at P = 5 (the c64 model's choice) 17.9, 6 17.6, 8 15.2 (the c16 model's choice), 10 19.6, 12 18.3, 16 16.3
    flow = "c16"
    # the fold S_{j+1} = M_j S_j + E_j of a window's span rows: "triton" (one launch, ``_fold_rows``: fp32, products
    # at tf32x3, the entry states written in place) or "torch" (fp64 batched products: ~30 launches per window).
    # H200, B=1 H=8 T=1M (session 15, same process): 14.78–14.94 ms against 15.30–15.44 with the torch fold (6
    # windows); the first version's products at 'ieee' (FMA, spilling at sm_90) took 20.6
    fold = "triton"
    # the 16-token flow's prep mode for the split alone (None: ``C16Config.mode``, 3 by default; 2 or 3): mode 3
    # hands the state pass U and [I | A_qkᵀ] instead of [U; A_qk U] (the state pass forms A_qk U itself, off its
    # chain): 192 fewer bytes written by the prep and read by the state pass per token and head, of the 4.8 KB the
    # split moves in mode 2 (NOTES v25)
    c16_mode: int | None = None
    # the 16-token span pass drops the part of a row's history that the gates have provably forgotten: from the
    # latest block whose suffix's decay bound is ≤ 2^−forget_log2 (each token's transition has norm ≤ its largest
    # decay: ``chunk16.decay_bound``), M is stored as 0 and S_ext runs from zero over that suffix alone. What is
    # dropped reaches the segment's end scaled by ≤ 2^−forget_log2 ‖S‖ (at 128: below fp32's resolution unless the
    # state's norm falls by 2^104 within one segment). Only with the in-kernel L2 norm and β sigmoid (‖k̂‖ ≤ 1,
    # β ∈ (0, 1): the bound's premise); None: off. Gates that keep a channel for a whole segment never reach the
    # bound (no gain, no loss); fast-forgetting ones (the benchmark's random gates: ~2^−3.7 per block) skip all
    # but the last ~40 blocks of each row
    forget_log2: float | None = 128.0
    fold_bv = 32  # columns of S per fold program
    fold_bkb = 32  # rows of S_j per product
    fold_warps = 8


@triton.jit(do_not_specialize=['R', 'H'])
def _fold_rows(SE, M, ENT, row_dst, R, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               BKB: tl.constexpr):
    """The left fold of one piece's span rows, one program per (V-block, piece, head): S_1 = SE[q, 0] (segment 1's
    entry: row 0 ran from the piece's known entry state), S_{j+1} = M[q, j] S_j + SE[q, j] for j ≥ 1, each S_{j+1}
    stored as entry state ``row_dst[q·R + j]`` of ``ENT [n_segments, H, K, V]`` (rows past the piece's last
    segment have row_dst < 0 and are not stored). fp32, the products at tf32x3 over K-blocks of BKB rows of S_j,
    which is read back from SE[q, j − 1] (overwritten by S_j: each program owns its columns of SE)."""
    i_v, i_q, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_b = tl.arange(0, BKB)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = (o_k < K)[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    base = (i_q * R).to(tl.int64) * H + i_h  # row (q, 0); row (q, j) is base + j·H
    for j in range(0, R):
        row = base + j * H
        S = tl.load(SE + row * K * V + p_kv, mask=m_kv, other=0.)  # E_j (for j = 0: S_1 itself)
        if j > 0:
            prev = SE + (row - H) * K * V  # holds S_j
            for kb in range(0, BK, BKB):
                m_b = (kb + o_b) < K
                Mb = tl.load(M + row * K * K + o_k[:, None] * K + (kb + o_b)[None, :],
                             mask=(o_k < K)[:, None] & m_b[None, :], other=0.)
                Sb = tl.load(prev + (kb + o_b)[:, None] * V + o_v[None, :], mask=m_b[:, None] & m_v[None, :],
                             other=0.)
                S = tl.dot(Mb, Sb, acc=S, input_precision="tf32x3")
            tl.debug_barrier()  # every thread has read S_j before S_{j+1} overwrites row j
            tl.store(SE + row * K * V + p_kv, S, mask=m_kv)
            tl.debug_barrier()  # S_{j+1} is in place for the next step's loads
        d = tl.load(row_dst + i_q * R + j)
        if d >= 0:
            tl.store(ENT + (d.to(tl.int64) * H + i_h) * K * V + p_kv, S, mask=m_kv)


@triton.jit(do_not_specialize=['c0', 'NCw', 'H'])
def _kda_span_rows(
    W, U, KG, GAM, SE, M,
    row_cs, row_ce, row_m, c0, NCw,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr, PREC: tl.constexpr,
):
    """Extended state pass over the chunk range [row_cs[r], row_ce[r]) of each row r (global chunk numbers, inside
    the window of buffers that starts at chunk c0), one program per (column block, row, head). Column blocks
    [0, BVP) are S (``SE [R, H, K, V]``, started from its contents), blocks [BVP, BVP + BK) are M (``M [R, H, K,
    K]``, started from its contents); rows with ``row_m[r] == 0`` skip their M blocks (their entry state is known,
    so only S is needed). An empty range leaves the row as it was."""
    i_b, i_r, i_h, cs, ce, live = _span_row_program(row_cs, row_ce, row_m, H, BV, BVP)
    if live:
        _span_columns(W, U, KG, GAM, SE, M, i_b, i_r, i_h, cs, ce, c0, NCw, H, K, V, BT, BK, BV, BVP, PREC)


@dataclass
class Piece:
    """The part of sequence ``seq`` inside one window: chunks [c, c + n), tokens [t0, t1)."""

    seq: int
    c: int
    n: int
    t0: int
    t1: int


def window_pieces(tab: ChunkTable, c0: int, c1: int) -> list[Piece]:
    """The sequences' pieces inside the window of chunks [c0, c1), in chunk order (empty sequences have none)."""
    out = []
    for s in range(tab.N):
        a, b = max(tab.chunk_off_cpu[s], c0), min(tab.chunk_off_cpu[s + 1], c1)
        if a < b:
            t0 = tab.cu_cpu[s] + (a - tab.chunk_off_cpu[s]) * BT
            out.append(Piece(s, a, b - a, t0, min(tab.cu_cpu[s + 1], t0 + (b - a) * BT)))
    return out


def split_window_bytes(device: torch.device) -> int:
    """Bytes of chunk buffers per window of the split prefill (see :class:`SplitConfig`)."""
    if SplitConfig.window_bytes is not None:
        return int(SplitConfig.window_bytes)
    cap = SplitConfig.window_cap
    if device.type == "cuda":
        cap = min(cap, int(SplitConfig.free_share * torch.cuda.mem_get_info(device)[0]))
    return max(FwdConfig.window_bytes, cap)


@dataclass
class _Window:
    """Host plan of one window: its chunks [c0, c0 + n), pieces, their segment cuts, and the integer tables
    (lists here; device tensors after :func:`_upload`)."""

    c0: int
    n: int
    pieces: list[Piece]
    cuts: list[list[int]]
    Q: int = 0  # pieces cut into ≥ 2 segments
    R: int = 0  # span rows per such piece (the most segments − 1; shorter pieces padded with empty rows)
    i32: dict = field(default_factory=dict)  # seg_cu, seg_off [S+1]; row_cs, row_ce, row_m [Q·R] (kernel args)
    i64: dict = field(default_factory=dict)  # index tensors of the fold and the state hand-over


def _plan_window(c0: int, n: int, pieces: list[Piece], cuts: list[list[int]]) -> _Window:
    """Segment table (varlen over the packed tokens, global chunk numbers: segments of a piece are contiguous and
    so are consecutive pieces, since a piece ends where its sequence ends unless it is the window's last), span
    rows, and the indices that place piece entry states, fold results and final states."""
    if [sum(x) for x in cuts] != [pc.n for pc in pieces] or min(min(x) for x in cuts) < 1:
        raise RuntimeError(f"split cut {cuts} does not partition the pieces {[pc.n for pc in pieces]}")
    w = _Window(c0, n, pieces, cuts)
    seg_cu, seg_off, first, last = [], [], [], []
    for pc, segs in zip(pieces, cuts):
        first.append(len(seg_cu))
        t, c = pc.t0, pc.c
        for m in segs:
            seg_cu.append(t)
            seg_off.append(c)
            t, c = min(t + m * BT, pc.t1), c + m
        last.append(len(seg_cu) - 1)
    seg_cu.append(pieces[-1].t1)
    seg_off.append(c0 + n)
    multi = [i for i, x in enumerate(cuts) if len(x) > 1]
    w.Q, w.R = len(multi), max([len(cuts[i]) - 1 for i in multi], default=0)
    cs, ce, has_m = [0] * (w.Q * w.R), [0] * (w.Q * w.R), [0] * (w.Q * w.R)
    dst, src = [], []  # segment j + 1 of multi piece q takes fold row q·R + j
    for q, i in enumerate(multi):
        c = pieces[i].c
        for j, m in enumerate(cuts[i][:-1]):
            cs[q * w.R + j], ce[q * w.R + j], has_m[q * w.R + j] = c, c + m, int(j > 0)
            dst.append(first[i] + j + 1)
            src.append(q * w.R + j)
            c += m
    row_dst = [-1] * (w.Q * w.R)  # the fold kernel's table: entry state written by each span row, −1 for none
    for d, r in zip(dst, src):
        row_dst[r] = d
    w.i32 = dict(seg_cu=seg_cu, seg_off=seg_off, row_cs=cs, row_ce=ce, row_m=has_m, row_dst=row_dst)
    w.i64 = dict(first=first, last=last, seq=[pc.seq for pc in pieces], multi_seq=[pieces[i].seq for i in multi],
                 dst=dst, src=src)
    return w


def _upload(windows: list[_Window], device: torch.device) -> None:
    """All windows' integer tables to the device in ONE asynchronous copy from pinned memory (the int32 tables,
    padded to 8 bytes, then the int64 ones, viewed on the device by dtype): no host-device sync between the
    kernels of the windows, and one pinned allocation and copy instead of two."""
    i32 = [x for w in windows for lst in w.i32.values() for x in lst]
    i64 = [x for w in windows for lst in w.i64.values() for x in lst]
    i32 += [0] * (len(i32) % 2)  # the int64 part starts 8-byte aligned
    host = torch.cat([torch.tensor(i32, dtype=torch.int32).view(torch.uint8),
                      torch.tensor(i64, dtype=torch.int64).view(torch.uint8)])
    raw = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    views = {"i32": raw[:4 * len(i32)].view(torch.int32), "i64": raw[4 * len(i32):].view(torch.int64)}
    for attr, dev in views.items():
        pos = 0
        for w in windows:
            tables = getattr(w, attr)
            for key, lst in tables.items():
                tables[key] = dev[pos:pos + len(lst)]
                pos += len(lst)


def _segment_table(w: _Window) -> ChunkTable:
    """The window's segments as a varlen chunk table (the state pass reads cu and chunk_off only)."""
    cu, off = w.i32["seg_cu"], w.i32["seg_off"]
    return ChunkTable(cu.numel() - 1, w.n, 0, 0, True, cu, off, off, [], [])


def _span_and_fold(bufs: dict, ht: torch.Tensor, w: _Window, K: int, V: int, prec: str,
                   c16: bool = False, forget_log2: float | None = None) -> torch.Tensor:
    """Entry state of every segment of the window, ``[n_segments, H, K, V]`` fp32 (segment order).

    A piece cut into p ≥ 2 segments gets span rows 0 … p − 2: row 0 runs segment 0 from the piece's known entry
    state (S only: its final state IS segment 1's entry), rows j ≥ 1 the affine map (E_j, M_j) of segment j from
    [0 | I]. The fold S_{j+1} = M_j S_j + E_j is a left fold (the exact recurrence): one ``_fold_rows`` launch
    (fp32), or fp64 batched products (``SplitConfig.fold = "torch"``).
    ``c16``: the buffers are the 16-token flow's (mode 2 or 3) and its span pass runs (``chunk16.launch_c16_span``,
    with ``forget_log2``)."""
    H, dev = ht.shape[1], ht.device
    BK, BVP = next_pow2(K), next_pow2(V)
    ix = w.i64
    entries = torch.empty(w.i32["seg_cu"].numel() - 1, H, K, V, dtype=torch.float32, device=dev)
    entries[ix["first"]] = ht[ix["seq"]]
    if w.Q == 0:
        return entries
    SE = torch.zeros(w.Q, w.R, H, K, V, dtype=torch.float32, device=dev)
    SE[:, 0] = ht[ix["multi_seq"]]
    Mt = torch.eye(K, dtype=torch.float32, device=dev).repeat(w.Q, w.R, H, 1, 1)
    if c16:
        c16_flow.launch_c16_span(bufs, SE, Mt, w.i32, w.c0, H, K, V, forget_log2)
    else:
        bv = min(SplitConfig.span_bv, BVP, BK)
        _kda_span_rows[((BVP + BK) // bv, w.Q * w.R * H)](
            bufs["W"], bufs["U"], bufs["KG"], bufs["GAM"], SE, Mt, w.i32["row_cs"], w.i32["row_ce"],
            w.i32["row_m"], w.c0, bufs["W"].shape[1], H, K, V, BT=BT, BK=BK, BV=bv, BVP=BVP, PREC=prec,
            num_warps=SplitConfig.span_warps, num_stages=SplitConfig.span_stages)
    fold = SplitConfig.fold
    if fold == "triton":
        bv = min(SplitConfig.fold_bv, BVP)
        _fold_rows[(BVP // bv, w.Q, H)](SE, Mt, entries, w.i32["row_dst"], w.R, H, K, V, BK=BK, BV=bv,
                                        BKB=min(SplitConfig.fold_bkb, BK), num_warps=SplitConfig.fold_warps)
    elif fold == "torch":
        S = SE[:, 0].double()  # segment 1's entry (padded rows: M = I, E = 0 keep S; their results are not used)
        out = [S]
        for j in range(1, w.R):
            S = torch.matmul(Mt[:, j].double(), S) + SE[:, j].double()
            out.append(S)
        entries[ix["dst"]] = torch.stack(out, 1).flatten(0, 1)[ix["src"]].float()
    else:
        raise ValueError(f"SplitConfig.fold: expected 'triton' or 'torch', got {fold!r}")
    return entries


def split_flow(lower_bound) -> str:
    """``SplitConfig.flow``: "c64" (the 64-token kernels) or "c16" (the 16-token flow's prep, span pass and state
    pass; it needs a bounded gate and mode 2 or 3 (``SplitConfig.c16_mode``, else ``C16Config.mode``), else the
    split runs "c64")."""
    flow = SplitConfig.flow
    if flow not in ("c16", "c64"):
        raise ValueError(f"SplitConfig.flow: expected 'c16' or 'c64', got {flow!r}")
    ok = lower_bound is not None and _c16_mode() in (2, 3)
    return "c16" if flow == "c16" and ok else "c64"


def _c16_mode() -> int:
    """The split's 16-token prep mode: ``SplitConfig.c16_mode``, else ``C16Config.mode``."""
    m = SplitConfig.c16_mode
    if m is None:
        return c16_flow.C16Config.mode
    if m not in (2, 3):
        raise ValueError(f"SplitConfig.c16_mode: expected None, 2 or 3, got {m!r}")
    return m


def _forget_log2(flags: dict) -> float | None:
    """``SplitConfig.forget_log2`` checked, and None where the decay bound's premise (the in-kernel L2 norm and β
    sigmoid) does not hold."""
    f = SplitConfig.forget_log2
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0):
        raise ValueError(f"SplitConfig.forget_log2: expected None or a number > 0, got {f!r}")
    return None if f is None or not (flags["l2norm"] and flags["beta_sigmoid"]) else float(f)


def _state_knobs() -> contextlib.AbstractContextManager:
    """``FwdConfig.state_*`` replaced by the non-None ``SplitConfig.state_*`` for one launch of the state pass."""
    names = ("state_bv", "state_warps", "state_stages")
    return overridden_attrs(FwdConfig, **{n: getattr(SplitConfig, n) for n in names
                                          if getattr(SplitConfig, n) is not None})


def split_prefill_triton(
    cut: Callable[[list[int], int], list[list[int]]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inference ``chunk_kda`` with the sequences cut into chunk-aligned segments; forward only, validated inputs.

    Segments never cut a chunk, so every chunk and all its prep outputs are the same as unsplit. Per window of
    chunks: the prep runs ONCE into the window's buffers; the span pass reads them for every segment but each
    piece's last; the fp64 fold gives every segment's exact entry state; ONE state pass over the segment table
    writes all outputs and the final states. ``cut(piece_chunks, H)`` → the chunk counts of each piece's
    segments (a sequence longer than a window is one piece per window; its state carries between windows as in
    the unsplit path). Shapes as ``chunk_kda_triton``: returns ``(o [B, T, H, V], final_state [N, H, K, V] fp32
    or None)``."""
    if SplitConfig.c16_mode is not None and split_flow(lower_bound) == "c16":  # the kernels read C16Config.mode
        with overridden_attrs(c16_flow.C16Config, mode=_c16_mode()), overridden_attrs(SplitConfig, c16_mode=None):
            return split_prefill_triton(cut, q, k, v, g, beta, scale, initial_state, output_final_state,
                                        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                        lower_bound, cu_seqlens, A_log, dt_bias)
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    tab = make_chunk_table(B, Tq, cu_seqlens, q.device)
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(q.dtype)
    o, ht = alloc_output_state(q, v, initial_state, tab)
    if tab.NC == 0:
        return o, (ht if output_final_state else None)
    flags = dict(l2norm=bool(use_qk_l2norm_in_kernel), use_gate=bool(use_gate_in_kernel),
                 beta_sigmoid=bool(use_beta_sigmoid_in_kernel), exact_diag=lower_bound is None)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    c16 = split_flow(lower_bound) == "c16"
    forget = _forget_log2(flags) if c16 else None
    budget = split_window_bytes(q.device)
    if c16:
        ncw = c16_flow.c16_window_chunks(tab.NC, budget, H, BK, BVP, dt)
    else:
        ncw = max(1, min(tab.NC, budget // chunk_bytes(H, BK, BVP, dt)))
    overlap = bool(SplitConfig.overlap_prep) and q.is_cuda and tab.NC > ncw
    bounds = [(c0, min(ncw, tab.NC - c0)) for c0 in range(0, tab.NC, ncw)]  # each window's chunks [c0, c0 + n)
    windows: list[_Window] = []

    def planned(i: int) -> _Window:
        """Window i's plan. All windows are planned and uploaded at the first serial step, after the first prep is
        enqueued: the GPU runs that prep while the host plans (a lone call's first kernel ~1 ms sooner)."""
        if not windows:
            for c0, n in bounds:
                pieces = window_pieces(tab, c0, c0 + n)
                windows.append(_plan_window(c0, n, pieces, cut([pc.n for pc in pieces], H)))
            _upload(windows, q.device)
        return windows[i]

    if c16:
        bufs = [c16_flow.alloc_c16_buffers(H, ncw, BK, BVP, dt, q.device, decay_bound=forget is not None)
                for _ in range(1 + overlap)]
    else:
        bufs = [alloc_chunk_buffers(H, ncw, BK, BVP, dt, q.device, store_t=False) for _ in range(1 + overlap)]

    def prep(i: int, b: dict) -> None:
        c0, n = bounds[i]
        if c16:
            c16_flow.launch_c16_prep(q, k, v, g, beta, A_log, dt_bias, b, tab, c0, n, float(scale), lower_bound,
                                     flags)
        else:
            launch_prep(q, k, v, g, beta, A_log, dt_bias, b, tab, c0, n, float(scale), lower_bound, flags, False)

    def serial(i: int, b: dict) -> None:
        w = planned(i)
        if c16:
            hs = _span_and_fold(b, ht, w, K, V, dot_precision(q.dtype), c16=True, forget_log2=forget)
            c16_flow.launch_c16_state(b, v, o, hs, _segment_table(w), w.c0, w.c0 + w.n, H, K, V)
        else:
            hs = _span_and_fold(b, ht, w, K, V, dot_precision(q.dtype))
            with _state_knobs():
                launch_state(b, o, None, hs, _segment_table(w), w.c0, w.c0 + w.n, H, K, V)
        ht[w.i64["seq"]] = hs[w.i64["last"]]

    if overlap:  # the prep one window ahead on a side stream (two buffers take turns)
        pipelined(list(range(len(bounds))), bufs, prep, serial, q.device, bool(SplitConfig.serial_priority))
    else:
        for i in range(len(bounds)):
            prep(i, bufs[0])
            serial(i, bufs[0])
    return o, (ht if output_final_state else None)
