"""Split prefill on one card: each long sequence cut into chunk-aligned segments whose serial passes run side by side.

With one long sequence and few heads the serial state pass runs on B·H·(V/64) programs and leaves most SMs idle.
Segments are chunk-aligned, so every chunk (and all its prep outputs) is the unsplit one. Per window of chunk
buffers (the 16-token flow's, ``inference_prep``):

1. the prep runs ONCE over the window's chunks;
2. the span pass (``_split_span_rows``) reads those buffers for every segment but each piece's last: segment 0 of a
   piece needs only its final state S (its entry is known), a middle one its affine map (M, S_ext) from [0 | I] —
   computed BACKWARDS from the segment's end (three products per 16-token step instead of four);
3. a left fold, S_{p+1} = M_p S_p + E_p from the piece's entry state, gives every segment's exact entry
   (``_fold_rows``, fp32, products at tf32x3);
4. ONE state pass over the segment table (``inference_state``) writes the outputs and final states.

On CUDA the prep of window w + 1 runs on a side stream beside steps 2–4 of window w (``_common.pipelined``).

Forgotten history (``SplitPlan.forget_log2``, with the in-kernel L2 norm and β sigmoid: ‖k̂‖ ≤ 1, β ∈ (0, 1)):
each token's transition (I − β k̂k̂ᵀ) Diag(α_t) has norm ≤ max_c α_t,c, so a 16-token block's is ≤ 2^{16·max log2 α}
(``inference_prep.decay_bound``, written by the prep). A span row whose suffix from block b* has a bound ≤
2^−forget_log2 stores M = 0 and runs S_ext from zero over that suffix alone; the dropped term is ≤ 2^−128 ‖S_{b*}‖,
below fp32's resolution of the state unless its norm falls by 2^104 within the segment. One channel that remembers a
whole segment keeps the full span.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import (
    BC,
    BT,
    ChunkTable,
    _eye,
    alloc_output_state,
    dot_precision,
    make_chunk_table,
    next_pow2,
    pipelined,
    state_bv,
    state_stages,
    store_dtype,
)
from k3.ops.kda.triton.inference import InferencePlan
from k3.ops.kda.triton.inference_prep import alloc_c16_buffers, c16_window_chunks, launch_c16_prep
from k3.ops.kda.triton.inference_state import launch_c16_state

__all__ = ["SplitPlan", "split_prefill_triton"]

if TYPE_CHECKING:
    from k3.ops.kda.args import KDAArgs

# span pass: 64 columns (a piece's first segment) / 64 rows (the backward chain) per program, 4 warps, 4 stages
# (sm_90, K = V = 128: 210 registers and no spills); fold: 32 columns of S per program, 32-row blocks, 8 warps
_SPAN_BV = 64
_SPAN_BR = 64
_SPAN_STAGES = 4
_FOLD_BV = 32
_FOLD_BKB = 32


@dataclass(frozen=True)
class SplitPlan:
    """``forget_log2``: span rows drop history that their decay bound scales by ≤ 2^−forget_log2 (None: never).
    Window buffers: ``window_bytes`` if set, else max(the inference window, min(``window_cap``, ``free_share`` of
    the free device memory)) — larger windows only save per-window launches (~0.1 ms each)."""

    forget_log2: float | None = 128.0
    window_bytes: int | None = None
    window_cap: int = 2 << 30
    free_share: float = 0.25


@triton.jit
def _forgotten_prefix(DEC, lo, hi, lim, SB: tl.constexpr):
    """(b*, found): the latest block b* in [lo, hi) whose suffix bound Σ_{b* ≤ b < hi} DEC[b] is ≤ lim, scanning
    ``DEC`` (log2 decay bounds per block, ≤ 0 for decaying gates) backwards SB blocks at a time; (lo, False) if no
    suffix reaches lim."""
    o = tl.arange(0, SB)
    acc = 0.0  # Σ DEC over [b, hi)
    start = lo
    found = lo < 0  # False, as a tensor the loop can carry
    b = hi
    while b > lo:
        n0 = tl.maximum(b - SB, lo)
        idx = n0 + o
        m = idx < b
        d = tl.load(DEC + idx, mask=m, other=0.)
        rc = tl.cumsum(d, axis=0, reverse=True) + acc  # suffix sums from each block of the tile to hi
        hit = tl.max(tl.where(m & (rc <= lim), idx, -1), axis=0)
        found = hit >= 0
        start = tl.where(found, hit, start)
        acc += tl.sum(d, axis=0)
        b = tl.where(found, lo, n0)
    return start, found


@triton.jit
def _span_tiles(X, KG, GAM, U, b, col, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr):
    """Pointers to block b's span-step operands in the window buffers: −W and kg [16, BK] (−W: the first 16 rows of
    [−W; qw]), γ [BK], and U's columns ``col`` [16, len(col)] (row-major [16, BVP] per block)."""
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    q_w = X + (b * (2 * BC) + o_s)[:, None] * BK + o_k[None, :]
    q_kg = KG + (b * BC + o_s)[:, None] * BK + o_k[None, :]
    q_u = U + b * (BVP * BC) + o_s[:, None] * BVP + col[None, :]
    return q_w, q_kg, GAM + b * BK + o_k, q_u


@triton.jit
def _span_fwd(X, KG, GAM, U, SE, i_b, i_r, i_h, cs, ce, c0, NCw, H, K: tl.constexpr, V: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
              PREC: tl.constexpr, STAGES: tl.constexpr, DEC, lim, FORGET: tl.constexpr, SB: tl.constexpr):
    """Column block ``i_b`` of row ``i_r``'s S_ext (transposed, [BV, K] fp32) through the row's chunks, forward in
    16-token steps from its contents (a piece's first segment, run from the piece's known entry state)."""
    NB: tl.constexpr = BT // BC
    DT: tl.constexpr = KG.dtype.element_ty
    o_k = tl.arange(0, BK)
    col = i_b * BV + tl.arange(0, BV)
    m_s = (col < V)[:, None] & (o_k < K)[None, :]
    p_s = ((i_r * H + i_h).to(tl.int64) * K + o_k[None, :]) * V + col[:, None]  # Sᵀ: row = column
    start = cs * NB  # the row's first 16-token block (global numbering)
    forgot = False
    if FORGET:
        start, forgot = _forgotten_prefix(DEC + (i_h * NCw - c0).to(tl.int64) * NB, cs * NB, ce * NB, lim, SB)
    if forgot:  # the row's history before ``start`` is scaled by ≤ 2^lim: S_ext from zero
        St = tl.zeros([BV, BK], dtype=tl.float32)
    else:
        St = tl.load(SE + p_s, mask=m_s, other=0.)
    m_u = (col < BVP)[None, :] & (i_b * BV < BVP)
    q_w, q_kg, q_gam, q_u = _span_tiles(X, KG, GAM, U, (i_h * NCw - c0).to(tl.int64) * NB + start, col, BC, BK,
                                        BVP)
    eye = _eye(BC).to(DT)
    for _ in tl.range(start, ce * NB, num_stages=STAGES):
        # Uᵀ into the accumulator by the exact product Uᵀ·I (U stored in fp32: as is), then V'ᵀ = Uᵀ + Sᵀ (−W)ᵀ
        b_u = tl.trans(tl.load(q_u, mask=m_u, other=0.))
        if U.dtype.element_ty == tl.float32:
            acc = b_u
        else:
            acc = tl.dot(b_u, eye, input_precision=PREC)
        vn = tl.dot(St.to(DT), tl.trans(tl.load(q_w)), acc=acc, input_precision=PREC).to(DT)
        St = St * tl.load(q_gam)[None, :] + tl.dot(vn, tl.load(q_kg), input_precision=PREC)
        q_kg += BC * BK
        q_gam += BK
        q_w += 2 * BC * BK
        q_u += BVP * BC
    tl.store(SE + p_s, St, mask=m_s)


@triton.jit
def _span_rev(X, KG, GAM, U, SE, M, i_b, i_r, i_h, cs, ce, c0, NCw, H, K: tl.constexpr, V: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr, BR: tl.constexpr,
              PREC: tl.constexpr, STAGES: tl.constexpr, DEC, lim, FORGET: tl.constexpr, SB: tl.constexpr):
    """Rows [i_b·BR, i_b·BR + BR) of a span row's (M, S_ext) from [0 | I], by the chain run BACKWARDS from the
    row's last block: with A_b = Diag(γ_b) − kg_bᵀ W_b (a block's transition) and R = A_n ⋯ A_{b+1},
        Y = R kg_bᵀ,  S_ext += Y U_b,  R ← R Diag(γ_b) − Y W_b,
    so that at the row's first block R = M and S_ext = Σ_b A_n ⋯ A_{b+1} kg_bᵀ U_b (the state from zero). Rows of R
    are independent, and S_ext is only accumulated: three [BR, 16]-wide products per step against the forward
    chain's four (two on S_ext, two on M). ``FORGET``: the chain stops at b*, M = 0 (see ``_split_span_rows``)."""
    NB: tl.constexpr = BT // BC
    DT: tl.constexpr = KG.dtype.element_ty
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVP)
    rows = i_b * BR + tl.arange(0, BR)
    start = cs * NB
    forgot = False
    if FORGET:
        start, forgot = _forgotten_prefix(DEC + (i_h * NCw - c0).to(tl.int64) * NB, cs * NB, ce * NB, lim, SB)
    R = tl.where(rows[:, None] == o_k[None, :], 1.0, 0.0)  # [BR, BK] fp32: rows of A_n ⋯ A_{b+1}, from I
    E = tl.zeros([BR, BVP], dtype=tl.float32)
    last = (i_h * NCw - c0).to(tl.int64) * NB + ce * NB - 1  # the row's last block
    q_w, q_kg, q_gam, q_u = _span_tiles(X, KG, GAM, U, last, o_v, BC, BK, BVP)
    for _ in tl.range(start, ce * NB, num_stages=STAGES):
        y = tl.dot(R.to(DT), tl.trans(tl.load(q_kg)), input_precision=PREC).to(DT)  # [BR, 16]
        E = tl.dot(y, tl.load(q_u), acc=E, input_precision=PREC)
        R = R * tl.load(q_gam)[None, :] + tl.dot(y, tl.load(q_w), input_precision=PREC)
        q_kg -= BC * BK
        q_gam -= BK
        q_w -= 2 * BC * BK
        q_u -= BVP * BC
    if forgot:
        R = tl.zeros([BR, BK], dtype=tl.float32)
    base = (i_r * H + i_h).to(tl.int64) * K + rows[:, None]
    m_r = rows[:, None] < K
    tl.store(M + base * K + o_k[None, :], R, mask=m_r & (o_k < K)[None, :])
    tl.store(SE + base * V + o_v[None, :], E, mask=m_r & (o_v < V)[None, :])


@triton.jit(do_not_specialize=['c0', 'NCw', 'H'])
def _split_span_rows(
    X, KG, GAM, U, SE, M,
    row_cs, row_ce, row_m, c0, NCw,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr, BR: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr, DEC=None, lim=0.0, FORGET: tl.constexpr = False,
    SB: tl.constexpr = 256,
):
    """The split's span pass on the 16-token prep's buffers: row r through the chunks [row_cs[r], row_ce[r]) (global
    numbers, inside the window that starts at chunk c0). A row with ``row_m[r] != 0`` (a middle segment) gets its
    affine map (M ``[R, H, K, K]``, S_ext ``[R, H, K, V]``, from [0 | I]) by the backward chain of ``_span_rev``, BR
    rows of both per program; a row without (a piece's first segment, run from its known entry state in ``SE``)
    takes the forward S_ext chain, BV columns per program. An empty range leaves the row as it was. Grid
    (max(BK / BR, BVP / BV), rows·H).

    ``FORGET``: each row first looks for the latest block b* of its range whose suffix [b*, end) has a decay bound
    (``DEC``, log2 per block, see ``inference_prep.decay_bound``) ≤ ``lim``. If there is one, the transition of
    that suffix has norm ≤ 2^lim, so the row's M is stored as 0 and its S_ext runs from zero over the suffix alone:
    what enters before b* reaches the row's end scaled by ≤ 2^lim."""
    i_b = tl.program_id(0)
    i_r = tl.program_id(1) // H
    i_h = tl.program_id(1) % H
    cs = tl.load(row_cs + i_r)
    ce = tl.load(row_ce + i_r)
    if tl.load(row_m + i_r) != 0:
        if (cs < ce) & (i_b * BR < BK):
            _span_rev(X, KG, GAM, U, SE, M, i_b, i_r, i_h, cs, ce, c0, NCw, H, K, V, BT, BC, BK, BVP, BR, PREC,
                      STAGES, DEC, lim, FORGET, SB)
    elif (cs < ce) & (i_b * BV < BVP):  # S_ext columns only
        _span_fwd(X, KG, GAM, U, SE, i_b, i_r, i_h, cs, ce, c0, NCw, H, K, V, BT, BC, BK, BV, BVP, PREC,
                  STAGES, DEC, lim, FORGET, SB)


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

def split_window_bytes(device: torch.device, plan: SplitPlan) -> int:
    """Bytes of chunk buffers per window of the split prefill (see :class:`SplitPlan`)."""
    if plan.window_bytes is not None:
        return int(plan.window_bytes)
    cap = plan.window_cap
    if device.type == "cuda":
        cap = min(cap, int(plan.free_share * torch.cuda.mem_get_info(device)[0]))
    return max(InferencePlan().window_bytes, cap)


def _span_and_fold(bufs: dict, ht: torch.Tensor, w: _Window, K: int, V: int,
                   forget_log2: float | None) -> torch.Tensor:
    """Entry state of every segment of the window, ``[n_segments, H, K, V]`` fp32 (segment order).

    A piece cut into p ≥ 2 segments gets span rows 0 … p − 2: row 0 runs segment 0 from the piece's known entry
    state (S only: its final state IS segment 1's entry), rows j ≥ 1 the affine map (E_j, M_j) of segment j from
    [0 | I]. The fold S_{j+1} = M_j S_j + E_j is a left fold (the exact recurrence), one ``_fold_rows`` launch."""
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
    launch_span(bufs, SE, Mt, w.i32, w.c0, H, K, V, forget_log2)
    bv = min(_FOLD_BV, BVP)
    _fold_rows[(BVP // bv, w.Q, H)](SE, Mt, entries, w.i32["row_dst"], w.R, H, K, V, BK=BK, BV=bv,
                                    BKB=min(_FOLD_BKB, BK), num_warps=8)
    return entries


def launch_span(bufs: dict, SE: torch.Tensor, Mt: torch.Tensor, rows: dict, c0: int, H: int, K: int, V: int,
                forget_log2: float | None = None) -> None:
    """``_split_span_rows`` over the window of buffers that starts at chunk c0: ``SE [Q, R, H, K, V]`` and
    ``Mt [Q, R, H, K, K]`` (fp32, updated in place; the rows with an M must hold [0 | I]), ``rows`` the int32
    tables row_cs, row_ce, row_m [Q·R]. ``forget_log2``: rows drop the history that their decay bound scales by
    ≤ 2^−forget_log2 (the buffers need the prep's bounds: ``alloc_c16_buffers(..., decay_bound=True)``); None:
    every row runs its whole range."""
    if forget_log2 is not None and ("DEC" not in bufs or not forget_log2 > 0):
        raise ValueError(f"forget_log2: expected None, or a number > 0 with buffers that hold the prep's decay "
                         f"bounds (alloc_c16_buffers(..., decay_bound=True)), got {forget_log2!r}")
    BK, BVP = bufs["X"].shape[-1], next_pow2(V)
    bv = min(state_bv(_SPAN_BV, BK), BVP, BK)
    br = min(_SPAN_BR, BK)
    _split_span_rows[(max(BK // br, BVP // bv), rows["row_cs"].numel() * H)](
        bufs["X"], bufs["KG"], bufs["GAM"], bufs["U"], SE, Mt, rows["row_cs"], rows["row_ce"], rows["row_m"], c0,
        bufs["X"].shape[1], H, K, V, BT=BT, BC=BC, BK=BK, BV=bv, BVP=BVP, BR=br,
        PREC=dot_precision(bufs["X"].dtype), STAGES=state_stages(_SPAN_STAGES, bufs["X"].dtype, BK),
        DEC=bufs.get("DEC"), lim=-float(forget_log2 or 0.0), FORGET=forget_log2 is not None,
        num_warps=4, num_stages=1)


def forget_log2(plan: SplitPlan, flags: dict) -> float | None:
    """``plan.forget_log2`` checked, and None where the decay bound's premise (the in-kernel L2 norm and β sigmoid)
    does not hold."""
    f = plan.forget_log2
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0):
        raise ValueError(f"SplitPlan.forget_log2: expected None or a number > 0, got {f!r}")
    return None if f is None or not (flags["l2norm"] and flags["beta_sigmoid"]) else float(f)


def split_prefill_triton(
    cut: Callable[[list[int], int], list[list[int]]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    args: KDAArgs,
    plan: SplitPlan = SplitPlan(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inference ``chunk_kda`` with the sequences cut into chunk-aligned segments; forward only, validated inputs, a
    bounded gate (the 16-token flow's prep). ``cut(piece_chunks, H)`` → the chunk counts of each piece's segments
    (a sequence longer than a window is one piece per window; its state carries between windows as unsplit).
    Returns ``(o [B, T, H, V], final_state [N, H, K, V] fp32 or None)``."""
    lower_bound = args.lower_bound
    if lower_bound is None:
        raise ValueError("lower_bound: the split prefill runs the 16-token flow, which needs a bounded gate")
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    tab = make_chunk_table(B, Tq, args.cu_host, q.device)
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(q.dtype)
    o, ht = alloc_output_state(q, v, initial_state, tab)
    if tab.NC == 0:
        return o, (ht if args.output_final_state else None)
    flags = args.flags
    if not args.use_gate_in_kernel:
        A_log = dt_bias = None
    forget = forget_log2(plan, flags)
    ncw = c16_window_chunks(tab.NC, split_window_bytes(q.device, plan), H, BK, BVP, dt)
    overlap = q.is_cuda and tab.NC > ncw
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

    bufs = [alloc_c16_buffers(H, ncw, BK, BVP, dt, q.device, decay_bound=forget is not None)
            for _ in range(1 + overlap)]

    def prep(i: int, b: dict) -> None:
        c0, n = bounds[i]
        launch_c16_prep(q, k, v, g, beta, A_log, dt_bias, b, tab, c0, n, args.scale, lower_bound, flags)

    def serial(i: int, b: dict) -> None:
        w = planned(i)
        hs = _span_and_fold(b, ht, w, K, V, forget)
        launch_c16_state(b, o, hs, _segment_table(w), w.c0, w.c0 + w.n, H, K, V)
        ht[w.i64["seq"]] = hs[w.i64["last"]]

    if overlap:  # the prep one window ahead on a side stream (two buffers take turns)
        pipelined(list(range(len(bounds))), bufs, prep, serial, q.device)
    else:
        for i in range(len(bounds)):
            prep(i, bufs[0])
            serial(i, bufs[0])
    return o, (ht if args.output_final_state else None)
