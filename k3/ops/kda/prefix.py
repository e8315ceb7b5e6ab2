"""Exact parallel prefix for KDA: span summaries, their composition, and the split prefill.

The state leaving a span is affine in the state entering it, ``S_out = M · S_in + S_ext`` (M ``[K, K]`` per head,
S_ext ``[K, V]`` = the span's output state from zero), and spans compose:
``(M₂, E₂) ∘ (M₁, E₁) = (M₂M₁, M₂E₁ + E₂)``. The split prefill cuts each long sequence into P chunk-aligned
segments, summarises all segments in parallel, folds the summaries into every segment's exact entry state, and runs
all segments' outputs in parallel (one varlen state pass with per-segment initial states).

Triton backend, bounded gates: ``split_prefill`` (``k3.ops.kda.triton.split``) runs the chunk prep ONCE per chunk
(segments are chunk-aligned, so the chunks are the unsplit ones) and feeds the same buffers to the span pass and to
one segmented state pass; the split pays off when the serial state pass, not the prep, bounds the unsplit time (few
heads, long sequences). :class:`SplitCostModel` predicts both and the automatic rule splits only when it predicts a
clear win. Any other backend or gate (a forced ``K3_KDA_SPLITS``): summaries and outputs through the backend's own
forward (:func:`_split_via_forward`).
"""

from __future__ import annotations

import functools
import heapq
import os
from dataclasses import dataclass

import torch

from k3.ops.kda.args import KDAArgs, get_backend

__all__ = ["compose", "fold_entry_states", "span_summaries", "split_plan", "choose_splits", "split_chunk_kda",
           "maybe_split_chunk_kda", "SplitCostModel", "balanced_cut"]

_ENV_SPLITS = "K3_KDA_SPLITS"
_ALIGN = 64  # segment boundaries on multiples of the chunk size from the sequence start: same chunking as unsplit
_MIN_SEG = 16384  # the automatic rule leaves sequences shorter than 2·_MIN_SEG whole: launches must amortise
_MAX_SPLITS = 32


# ---------------------------------------------------------------- summaries


def _span_summaries_via_forward(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, args: KDAArgs, need_M: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Summaries from calls of the backend's forward, by linearity in (S_in, v) for fixed q, k, g, β:
    ``S_ext`` = final state from S_in = 0; ``M`` = final state with v = 0 and S_in = I (a ``[K, K]`` state).
    Exact; autograd-capable whenever the backend's forward is. ``need_M=False`` skips the second call (M = None)."""
    fwd = get_backend(backend).chunk_kda
    H, K = q.shape[2], q.shape[3]
    run = args._replace(output_final_state=True)
    _, S_ext = fwd(q, k, v, g, beta, None, A_log, dt_bias, run)
    if not need_M:
        return None, S_ext
    eye = torch.eye(K, dtype=S_ext.dtype, device=q.device).expand(args.N, H, K, K).contiguous()
    v_zero = v.new_zeros(v.shape[:-1] + (K,))
    _, M = fwd(q, k, v_zero, g, beta, eye, A_log, dt_bias, run)
    return M, S_ext


def span_summaries(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, args: KDAArgs, need_M: bool = True,
    need_grad: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(M [N, H, K, K], S_ext [N, H, K, V])`` per sequence, exact, for validated inputs.

    The torch backend uses the chunked reference (differentiable). The Triton backend uses its summary pass when no
    gradient is needed, else its (autograd-capable) forward; M may then be None if not ``need_M``."""
    if backend == "torch" or not need_grad:
        return get_backend(backend).span_summaries(q, k, v, g, beta, A_log, dt_bias, args)
    return _span_summaries_via_forward(backend, q, k, v, g, beta, A_log, dt_bias, args, need_M=need_M)


def compose(
    M2: torch.Tensor, E2: torch.Tensor, M1: torch.Tensor, E1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Span 1 then span 2: ``(M₂, E₂) ∘ (M₁, E₁) = (M₂M₁, M₂E₁ + E₂)`` (``[..., K, K]``, ``[..., K, V]``)."""
    return M2 @ M1, M2 @ E1 + E2


def fold_entry_states(M: torch.Tensor, E: torch.Tensor, S0: torch.Tensor | None) -> torch.Tensor:
    """Exact entry states of consecutive spans: ``S_0 = S0`` (zero if None), ``S_{p+1} = M_p S_p + E_p``.

    M ``[R, P, H, K, K]``, E ``[R, P, H, K, V]`` for R independent rows of P spans; returns ``[R, P, H, K, V]``.
    Folded left to right in fp64 on CPU, fp32 on GPU (P ≤ 32 steps of one small batched matmul: the depth does
    not matter next to the span work, and a left fold never reassociates, so it is the exact recurrence)."""
    acc = torch.float64 if M.device.type == "cpu" else torch.float32
    R, P, H, K, V = E.shape
    S = E.new_zeros(R, H, K, V, dtype=acc) if S0 is None else S0.to(acc)
    out = []
    for p in range(P):
        out.append(S)
        S = M[:, p].to(acc) @ S + E[:, p].to(acc)
    return torch.stack(out, 1)


# ---------------------------------------------------------------- the split plan


def _pow2(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def _list_schedule_us(durations: list[float], slots: int) -> float:
    """Finish time of programs started in grid order on ``slots`` equal slots (the block scheduler hands the next
    program to the first free slot)."""
    if len(durations) <= slots:
        return max(durations, default=0.0)
    if len(durations) > 50_000:  # huge varlen batches: the bound work / slots (the scheduler packs them well)
        return max(max(durations), sum(durations) / slots)
    free = [0.0] * slots
    for d in durations:
        heapq.heapreplace(free, free[0] + d)
    return max(free)


@dataclass(frozen=True)
class SplitCostModel:
    """Predicted time (µs) of an inference prefill, unsplit vs cut into segments.

    The prep (chunk-parallel) is the same chunks either way: the split only changes the state pass and adds the
    span pass, the fold and a few launches (:meth:`predict_us`, the serial part of one window). Each program of
    either pass walks its chunks one dependent step after the other; programs are list-scheduled on
    ``sm_count × per_sm`` slots in grid order.

    Constants (one H200, the 16-token kernels): a state-pass step 1.72 µs per chunk and program (28.2 ms over
    16384 chunks at B=1, H=32, 64 programs, one per SM), the span pass taken as the same per chunk with two programs
    per SM, the prep 6.27 SM·µs per chunk and head (24.9 ms per 1M tokens at H=32); the per-window and per-fold-step
    costs are host/launch estimates. Checked at B=1, H=8, T=1M: predicted P = 6 / 8 / 10 / 12 / 16: 15.7 / 13.4 /
    17.7 / 15.8 / 13.5 ms, measured 17.6 / 15.2 / 19.6 / 18.3 / 16.3 — ~2 ms low, the same saw-tooth, the same best
    P. The span pass runs 64 columns (or the backward chain's 64 rows) per program, as calibrated. The predictions
    are saw-toothed in P (waves of programs), so a larger P must win by ``tie_margin``."""

    sm_count: int = 132
    state_step_us: float = 1.72
    span_step_us: float = 1.72
    state_per_sm: int = 1
    span_per_sm: int = 2
    state_bv: int = 64
    span_bv: int = 64
    window_us: float = 80.0  # span launch, fold set-up, index copies of one split window
    fold_step_us: float = 12.0  # one [K, K] × [K, V] product of the fold per segment
    prep_sm_us: float = 6.27  # SM·µs per chunk and head
    min_gain: float = 0.10  # split only when the whole call is predicted ≥ 10 % shorter
    tie_margin: float = 0.03  # a larger P must be predicted this much faster than the best smaller one
    overlap_exposed: float = 0.65  # share of the shorter of prep / state pass left exposed when they overlap

    def state_us(self, cuts: list[list[int]], H: int, V: int) -> float:
        """The state pass over all segments (``cuts``: chunk counts of each piece's segments)."""
        nv = max(1, _pow2(V) // min(self.state_bv, _pow2(V)))
        durs = [m * self.state_step_us for segs in cuts for m in segs for _ in range(H * nv)]
        return _list_schedule_us(durs, self.sm_count * self.state_per_sm)

    def span_us(self, cuts: list[list[int]], H: int, K: int, V: int) -> float:
        """The span pass: per piece of p ≥ 2 segments, segment 0 on the S columns only, segments 1 … p − 2 on
        S and M (rows padded to the most segments; empty programs cost nothing)."""
        bv = min(self.span_bv, _pow2(V), _pow2(K))
        nv, nk = _pow2(V) // bv, _pow2(K) // bv
        durs = []
        for segs in cuts:
            for j, m in enumerate(segs[:-1]):
                durs += [m * self.span_step_us] * (H * (nv + (nk if j else 0)))
        return _list_schedule_us(durs, self.sm_count * self.span_per_sm)

    def predict_us(self, cuts: list[list[int]], H: int, K: int, V: int) -> float:
        """Serial part of one window cut as ``cuts``."""
        t = self.state_us(cuts, H, V)
        p = max(len(s) for s in cuts)
        if p > 1:
            t += self.span_us(cuts, H, K, V) + self.window_us + self.fold_step_us * max(0, p - 2)
        return t

    def prep_us(self, lens: list[int], H: int) -> float:
        """The chunk prep over every chunk and head, all SMs busy (the same with or without a split)."""
        return sum(lens) * H * self.prep_sm_us / self.sm_count

    def unsplit_total_us(self, lens: list[int], H: int, K: int, V: int, windows: int = 1) -> float:
        """Prep + state pass unsplit. ``windows`` > 1: the overlapped path over that many equal windows: the prep of
        window w + 1 runs beside the state pass of window w, on the SMs its programs leave free (first prep and last
        state pass alone)."""
        prep, serial = self.prep_us(lens, H), self.predict_us([[n] for n in lens], H, K, V)
        if windows <= 1:
            return prep + serial
        # measured (one H200, 1M tokens): overlapped 47.9 ms vs prep 28 + state 29 at H=8, 131.2 vs 111.8 + 30.8 at
        # H=32: the shorter of the two stays ~65 % exposed (they compete for the same SMs)
        side = max(prep, serial) + self.overlap_exposed * min(prep, serial)
        return (prep + serial + (windows - 1) * side) / windows

    def best(self, lens: list[int], H: int, K: int, V: int, max_splits: int, overlap: int = 1) -> int:
        """P for :func:`balanced_cut` of pieces of ``lens`` chunks: the fastest predicted total (prep + serial
        passes; a larger P must win by ``tie_margin``), 1 unless it beats the unsplit total (``overlap`` = its
        window count when the unsplit path overlaps, see :meth:`unsplit_total_us`) by ``min_gain``."""
        if not lens:
            return 1
        prep = self.prep_us(lens, H)
        unsplit = self.unsplit_total_us(lens, H, K, V, overlap)
        best_p, best_t = 1, prep + self.predict_us([[n] for n in lens], H, K, V)
        for p in range(2, min(max_splits, max(lens)) + 1):
            t = prep + self.predict_us(balanced_cut(lens, p), H, K, V)
            if t < best_t * (1.0 - self.tie_margin):
                best_p, best_t = p, t
        return best_p if best_p > 1 and best_t <= (1.0 - self.min_gain) * unsplit else 1


def balanced_cut(lens: list[int], P: int) -> list[list[int]]:
    """Segment chunk counts: the longest piece in P segments, every piece in segments no longer than those
    (``ceil(n / L)`` of them, as even as possible), so short pieces are not cut for nothing."""
    L = max(1, -(-max(lens, default=1) // max(1, P)))
    return split_plan(lens, 0, align=1, seg_len=L)


def choose_splits(B: int, H: int, T: int, sm_count: int, K: int = 128, V: int = 128, overlap: int = 1) -> int:
    """Automatic segment count for B sequences of T tokens and H heads on ``sm_count`` SMs: the
    :class:`SplitCostModel`'s choice (1 = do not split); ``overlap`` > 1: against the overlapped unsplit path
    with that many windows."""
    if T < 2 * _MIN_SEG:
        return 1
    n = -(-T // _ALIGN)
    return SplitCostModel(sm_count=sm_count).best([n] * B, H, K, V, _MAX_SPLITS, overlap)


def _forced_splits() -> int | str | None:
    """``K3_KDA_SPLITS``: unset → None, ``auto`` → 'auto', else a positive int."""
    raw = os.environ.get(_ENV_SPLITS, "").strip().lower()
    if not raw:
        return None
    if raw == "auto":
        return "auto"
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{_ENV_SPLITS} must be a positive integer or 'auto', got {raw!r}") from None
    if n < 1:
        raise ValueError(f"{_ENV_SPLITS} must be a positive integer or 'auto', got {n}")
    return n


def split_plan(lengths: list[int], P: int, align: int = _ALIGN, seg_len: int | None = None) -> list[list[int]]:
    """Segment lengths per sequence: each sequence's ``ceil(L/align)`` chunks shared as evenly as possible among
    ``min(P, chunks)`` segments (earlier segments take the extra chunk); the last segment takes the tail. With
    ``seg_len`` (chunks), each sequence gets ``ceil(chunks / seg_len)`` segments instead."""
    plan = []
    for L in lengths:
        n_chunks = max(1, -(-L // align))
        p = -(-n_chunks // seg_len) if seg_len else P
        p = max(1, min(p, n_chunks))
        per = [n_chunks // p + (1 if i < n_chunks % p else 0) for i in range(p)]
        seg = [c * align for c in per]
        seg[-1] = L - sum(seg[:-1])  # the ragged tail
        plan.append(seg)
    return plan


@functools.lru_cache(maxsize=256)
def _best_splits(model: SplitCostModel, lens: tuple[int, ...], H: int, K: int, V: int, overlap: int = 1) -> int:
    """:meth:`SplitCostModel.best`, cached: every layer of a prefill asks the same question."""
    return model.best(list(lens), H, K, V, _MAX_SPLITS, overlap)


def _auto_splits(lens: list[int], H: int, K: int, V: int, device: torch.device, backend: str,
                 dtype: torch.dtype = torch.bfloat16, lower_bound: float | None = None
                 ) -> tuple[int, SplitCostModel | None]:
    """``(P, model)`` for this call. ``K3_KDA_SPLITS=n`` forces n on any device (model None: even cuts).
    Otherwise, on CUDA with the Triton backend and a bounded gate: the :class:`SplitCostModel` on the sequences'
    chunk counts — P > 1 only when it predicts a clear win, which needs few programs in the unsplit state pass
    (B·H·V/64 well under the SM count) and a sequence ≥ 2·16K tokens."""
    forced = _forced_splits()
    if isinstance(forced, int):
        return forced, None
    if device.type != "cuda" or backend != "triton" or lower_bound is None:
        # on CPU the torch path is serial anyway; the split kernels run the 16-token flow, which needs the bound
        return 1, None
    if max(lens, default=0) < 2 * _MIN_SEG:
        return 1, None
    be = get_backend(backend)
    model = SplitCostModel(sm_count=be.sm_count(device))
    slots = model.sm_count * model.state_per_sm
    if sum(1 for n in lens if n) * H * max(1, _pow2(V) // model.state_bv) >= slots:
        return 1, None  # the unsplit state pass fills every SM already
    chunks = tuple(-(-n // _ALIGN) for n in lens if n)
    return _best_splits(model, chunks, H, K, V, be.unsplit_windows(lens, H, K, V, dtype)), model


# ---------------------------------------------------------------- the split forward


def split_chunk_kda(
    backend: str,
    P: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    args: KDAArgs,
    model: SplitCostModel | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk_kda`` with every sequence cut into chunk-aligned segments (validated inputs; the same result to
    rounding). ``model`` None: every sequence in ``min(P, chunks)`` even segments; else the model picks the cut of
    every window. Triton with a bounded gate: its ``split_prefill`` (one prep per chunk); otherwise
    :func:`_split_via_forward`."""
    be = get_backend(backend)
    if not hasattr(be, "split_prefill") or args.lower_bound is None:
        return _split_via_forward(backend, P, q, k, v, g, beta, initial_state, A_log, dt_bias, args)
    K, V = q.shape[-1], v.shape[-1]
    if model is None:
        def cut(lens: list[int], H: int) -> list[list[int]]:
            return split_plan(lens, P, align=1)
    else:
        def cut(lens: list[int], H: int) -> list[list[int]]:
            return balanced_cut(lens, _best_splits(model, tuple(lens), H, K, V))
    return be.split_prefill(cut, q, k, v, g, beta, initial_state, A_log, dt_bias, args)


def _split_via_forward(
    backend: str,
    P: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    args: KDAArgs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The split through the backend's own forward and summaries (any backend and gate): every sequence in up to P
    segments, summaries of all but each sequence's last, fold, one varlen forward."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if args.cu_seqlens is None:  # a fixed-length batch is a varlen stream of B equal sequences
        bounds = [b * T for b in range(B + 1)]
        q, k, v, g, beta = (x.reshape((1, B * T) + tuple(x.shape[2:])) for x in (q, k, v, g, beta))
    else:
        bounds = [int(c) for c in args.cu_host.detach().cpu().tolist()]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    plan = split_plan(lengths, P)
    Pmax, N = max(len(s) for s in plan), len(plan)

    # 1. Summaries of every segment but each sequence's last (the last one's summary is never used).
    seg_cu, pre_idx, pre_cu, slot = [0], [], [0], []  # slot: (sequence, segment) of each summarised segment
    for n, (start, segs) in enumerate(zip(bounds, plan)):
        pos = start
        for p, L in enumerate(segs):
            if p < len(segs) - 1:
                pre_idx.append(torch.arange(pos, pos + L))
                pre_cu.append(pre_cu[-1] + L)
                slot.append((n, p))
            pos += L
            seg_cu.append(seg_cu[-1] + L)
    dev = q.device
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    Mg = torch.eye(K, dtype=acc, device=dev).expand(N, Pmax, H, K, K).clone()  # identity/zero pad: no-op spans
    Eg = torch.zeros(N, Pmax, H, K, V, dtype=acc, device=dev)
    if slot:
        if N == 1:  # the prefix of one sequence is a contiguous slice: no copy
            sub = [x[:, bounds[0]:bounds[0] + pre_cu[-1]] for x in (q, k, v, g, beta)]
        else:
            idx = torch.cat(pre_idx).to(dev)
            sub = [x.index_select(1, idx) for x in (q, k, v, g, beta)]
        cu_pre = torch.tensor(pre_cu, dtype=torch.int64, device=dev)
        M, E = span_summaries(backend, *sub, A_log, dt_bias,
                              args._replace(cu_seqlens=cu_pre, N=len(slot), cu_seqlens_cpu=None))
        rows = torch.tensor([s[0] for s in slot], device=dev)
        cols = torch.tensor([s[1] for s in slot], device=dev)
        Mg[rows, cols] = M.to(acc)
        Eg[rows, cols] = E.to(acc)

    # 2. Exact entry state of every segment.
    entry = fold_entry_states(Mg, Eg, initial_state)  # [N, Pmax, H, K, V]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    entries = torch.cat([entry[n, :len(segs)] for n, segs in enumerate(plan)], 0).to(state_dtype).contiguous()

    # 3. All segments' outputs in parallel from their entry states.
    cu_seg = torch.tensor(seg_cu, dtype=torch.int64, device=dev)
    o, S = get_backend(backend).chunk_kda(q, k, v, g, beta, entries, A_log, dt_bias,
                                          args._replace(cu_seqlens=cu_seg, N=len(seg_cu) - 1, cu_seqlens_cpu=None))
    if args.output_final_state:
        last = torch.tensor([sum(len(s) for s in plan[:n + 1]) - 1 for n in range(N)], device=dev)
        S = S[last]
    if args.cu_seqlens is None:
        o = o.reshape(B, T, H, V)
    return o, (S if args.output_final_state else None)


def maybe_split_chunk_kda(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, args: KDAArgs,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The split path when it applies (inference only: no gradient needed; P > 1 from ``K3_KDA_SPLITS`` or the
    cost model on CUDA), else ``None``."""
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    if needs_grad:
        return None
    cu = args.cu_host
    B, T, H, K = q.shape
    lens = [T] * B if cu is None else (cu[1:] - cu[:-1]).detach().cpu().tolist()
    P, model = _auto_splits(lens, H, K, v.shape[-1], q.device, backend, q.dtype, args.lower_bound)
    if P <= 1 or max(lens, default=0) <= _ALIGN:
        return None
    return split_chunk_kda(backend, P, q, k, v, g, beta, initial_state, A_log, dt_bias, args, model=model)
