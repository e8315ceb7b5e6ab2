"""Exact parallel prefix for KDA (SPEC §2): span summaries, their composition, and the split prefill.

The state leaving a span is affine in the state entering it, ``S_out = M · S_in + S_ext`` (M ``[K, K]`` per head,
S_ext ``[K, V]`` = the span's output state from zero), and spans compose:
``(M₂, E₂) ∘ (M₁, E₁) = (M₂M₁, M₂E₁ + E₂)``. The split prefill cuts each long sequence into P chunk-aligned
segments, summarises all segments in parallel, folds the summaries into every segment's exact entry state, and runs
all segments' outputs in parallel (one varlen forward with per-segment initial states).

Backend-agnostic: every step calls the backend's ``chunk_kda`` / ``span_summaries`` with one shared signature.
"""

from __future__ import annotations

import math
import os

import torch

from k3.ops.kda.chunk import _preprocess, backend_fn
from k3.ops.kda.naive import naive_chunk_kda_summary

__all__ = ["compose", "fold_entry_states", "span_summaries", "split_plan", "choose_splits", "split_chunk_kda",
           "maybe_split_chunk_kda"]

_ENV_SPLITS = "K3_KDA_SPLITS"
_ALIGN = 64  # segment boundaries on multiples of the chunk size from the sequence start: same chunking as unsplit
_MIN_SEG = 16384  # tokens per segment in the automatic rule: the summary pass and the fold must amortise
_MAX_SPLITS = 32


# ---------------------------------------------------------------- summaries


def _span_summaries_torch(
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
    """Per sequence ``(M [N, H, K, K], S_ext [N, H, K, V])`` fp32 (fp64 for fp64 inputs); differentiable."""
    _, kp, gp, bp = _preprocess(q, k, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                use_beta_sigmoid_in_kernel, lower_bound, A_log, dt_bias)
    return naive_chunk_kda_summary(kp, v.to(kp.dtype), gp, bp, cu_seqlens=cu_seqlens)


def _span_summaries_via_forward(
    backend: str, *args: object, need_M: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Summaries from calls of the backend's forward, by linearity in (S_in, v) for fixed q, k, g, β:
    ``S_ext`` = final state from S_in = 0; ``M`` = final state with v = 0 and S_in = I (a ``[K, K]`` state).
    Exact; autograd-capable whenever the backend's forward is. ``need_M=False`` skips the second call (M = None)."""
    q, k, v, g, beta, scale, l2, gate, bsig, lb, cu, A_log, dt_bias = args
    fwd = backend_fn(backend, "chunk_kda")
    N = q.shape[0] if cu is None else cu.numel() - 1
    H, K = q.shape[2], q.shape[3]
    _, S_ext = fwd(q, k, v, g, beta, scale, None, True, l2, gate, bsig, lb, cu, A_log, dt_bias)
    if not need_M:
        return None, S_ext
    eye = torch.eye(K, dtype=S_ext.dtype, device=q.device).expand(N, H, K, K).contiguous()
    v0 = v.new_zeros(v.shape[:-1] + (K,))
    _, M = fwd(q, k, v0, g, beta, scale, eye, True, l2, gate, bsig, lb, cu, A_log, dt_bias)
    return M, S_ext


def span_summaries(
    backend: str, *args: object, need_M: bool = True, need_grad: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(M [N, H, K, K], S_ext [N, H, K, V])`` per sequence, exact. ``args`` = (q, k, v, g, beta, scale,
    l2norm, gate_in_kernel, beta_sigmoid, lower_bound, cu_seqlens, A_log, dt_bias), validated.

    The torch backend uses the chunked reference (differentiable). The Triton backend uses its summary kernel when
    it has one and no gradient is needed, else its (autograd-capable) forward; M may then be None if not
    ``need_M``."""
    if backend == "torch":
        return _span_summaries_torch(*args)
    fn = backend_fn(backend, "span_summaries")
    if fn is None or need_grad:
        return _span_summaries_via_forward(backend, *args, need_M=need_M)
    return fn(*args)


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


def choose_splits(B: int, H: int, T: int, sm_count: int) -> int:
    """Automatic segment count for one sequence of T tokens when B·H heads share ``sm_count`` SMs: enough
    segments that B·H·P fills every SM once, each segment at least ``_MIN_SEG`` tokens, only for sequences
    ≥ 3·_MIN_SEG, at most ``_MAX_SPLITS``."""
    if B * H >= sm_count or T < 3 * _MIN_SEG:
        return 1
    return max(1, min(_MAX_SPLITS, math.ceil(sm_count / (B * H)), T // _MIN_SEG))


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


def split_plan(lengths: list[int], P: int, align: int = _ALIGN) -> list[list[int]]:
    """Segment lengths per sequence: each sequence's ``ceil(L/align)`` chunks shared as evenly as possible among
    ``min(P, chunks)`` segments (earlier segments take the extra chunk); the last segment takes the tail."""
    plan = []
    for L in lengths:
        n_chunks = max(1, -(-L // align))
        p = max(1, min(P, n_chunks))
        per = [n_chunks // p + (1 if i < n_chunks % p else 0) for i in range(p)]
        seg = [c * align for c in per]
        seg[-1] = L - sum(seg[:-1])  # the ragged tail
        plan.append(seg)
    return plan


def _auto_splits(B: int, N: int, H: int, T_max: int, device: torch.device, backend: str) -> int:
    """P for this call: ``K3_KDA_SPLITS=n`` forces n (any device); otherwise the SM rule on CUDA with the Triton
    backend, when ``K3_KDA_SPLITS=auto`` or the Triton package sets ``AUTO_SPLIT = True``. Measured on one H200
    with the kernels of 2026-11-29 (bench/results/kda_split_h200.md) the split was 0.62× the unsplit speed at
    B=1, H=8, T=1M — the unsplit forward is not bound by its serial state pass there — so it stays off until the
    kernels say otherwise."""
    forced = _forced_splits()
    if isinstance(forced, int):
        return forced
    if device.type != "cuda" or backend != "triton":
        return 1  # on CPU the torch path is serial anyway: splitting only adds the summary work
    from k3.ops.kda.chunk import _triton_module  # noqa: PLC0415

    if forced != "auto" and not getattr(_triton_module(required=False), "AUTO_SPLIT", False):
        return 1
    sm = torch.cuda.get_device_properties(device).multi_processor_count
    return choose_splits(N, H, T_max, sm)


# ---------------------------------------------------------------- the split forward


def split_chunk_kda(
    backend: str,
    P: int,
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
    """``chunk_kda`` with every sequence cut into up to P segments (validated inputs; same result to rounding)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:  # a fixed-length batch is a varlen stream of B equal sequences
        bounds = [b * T for b in range(B + 1)]
        q, k, v, g, beta = (x.reshape((1, B * T) + tuple(x.shape[2:])) for x in (q, k, v, g, beta))
    else:
        bounds = [int(c) for c in cu_seqlens.detach().cpu().tolist()]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    plan = split_plan(lengths, P)
    Pmax, N = max(len(s) for s in plan), len(plan)
    flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound)

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
        M, E = span_summaries(backend, *sub, scale, *flags[:3], lower_bound, cu_pre, A_log, dt_bias)
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
    o, S = backend_fn(backend, "chunk_kda")(q, k, v, g, beta, scale, entries, output_final_state, *flags[:3],
                                            lower_bound, cu_seg, A_log, dt_bias)
    if output_final_state:
        last = torch.tensor([sum(len(s) for s in plan[:n + 1]) - 1 for n in range(N)], device=dev)
        S = S[last]
    if cu_seqlens is None:
        o = o.reshape(B, T, H, V)
    return o, (S if output_final_state else None)


def maybe_split_chunk_kda(
    backend: str, *args: object
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The split path when it applies (inference only: no gradient needed; P > 1 from ``K3_KDA_SPLITS`` or the
    SM rule on CUDA), else ``None``. ``args`` as the backend ``chunk_kda``."""
    q, k, v, g, beta = args[:5]
    A_log, dt_bias = args[13], args[14]
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, g, beta, args[6], A_log, dt_bias))
    if needs_grad:
        return None
    cu = args[12]
    B, T, H, _ = q.shape
    if cu is None:
        N, T_max = B, T
    else:
        lens = (cu[1:] - cu[:-1]).detach().cpu()
        N, T_max = int(lens.numel()), int(lens.max()) if lens.numel() else 0
    P = _auto_splits(B, N, H, T_max, q.device, backend)
    if P <= 1 or T_max <= _ALIGN:
        return None
    return split_chunk_kda(backend, P, *args)
