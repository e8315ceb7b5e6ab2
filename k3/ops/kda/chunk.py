"""``chunk_kda``: fla-compatible chunked KDA (training and prefill), autograd-capable.

It checks the call once (``args.kda_args``), picks the backend (``args.select_backend``: PyTorch reference on CPU,
Triton on CUDA), and routes ``cp_context`` calls to context parallel (``cp.py``) and long no-grad prefills to the
exact split (``prefix.py``). Inside ``torch.compile`` it runs as the registered op ``k3::chunk_kda``
(``library.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from k3.ops._device import on_device_of
from k3.ops.kda import library
from k3.ops.kda.args import (
    FlaOptions,
    KDAArgs,
    KDAAssertionError,
    check_state_v_first,
    expand_gva,
    fla_options,
    get_backend,
    kda_args,
    neg_eigval_beta,
    select_backend,
)
from k3.ops.kda.cp import cp_chunk_kda, cp_reported
from k3.ops.kda.prefix import maybe_split_chunk_kda

__all__ = ["chunk_kda"]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    transpose_state_layout: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Chunked Kimi Delta Attention, autograd-capable; a drop-in for fla's ``chunk_kda``: every argument of fla
    0.6.0, in fla's positional order, with fla's meaning (fla takes ``A_log``, ``dt_bias``, ``chunk_size`` and the
    deprecated ``transpose_state_layout`` by keyword; so does k3).

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]``, HV = H or a multiple of it (fla's grouped value attention:
            value head j reads query/key head j // (HV/H); g, beta, A_log, dt_bias and the states then have HV heads).
        g: ``[B, T, H, K]``: log-decay (≤ 0), or raw gate pre-activations when ``use_gate_in_kernel``.
        beta: ``[B, T, H]``: β ∈ (0, 1), or logits when ``use_beta_sigmoid_in_kernel``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 (N = B, or the number of sequences with ``cu_seqlens``);
            ``[N, H, V, K]`` with ``state_v_first``.
        output_final_state: also return the final states ``[N, H, K, V]`` fp32 (``[N, H, V, K]`` with
            ``state_v_first``).
        use_qk_l2norm_in_kernel: q, k ← x / sqrt(Σx² + 1e-6) per head.
        use_gate_in_kernel: g ← lower_bound·sigmoid(exp(A_log)·(g + dt_bias)) if ``lower_bound`` is set (A_log may
            then be None), else −exp(A_log)·softplus(g + dt_bias). ``A_log [H]``, ``dt_bias [H*K]`` fp32.
        allow_neg_eigval: β = 2·sigmoid(beta) ∈ (0, 2) (eigenvalues of I − βkkᵀ down to −1); needs
            ``use_beta_sigmoid_in_kernel``.
        safe_gate: requires ``lower_bound`` with the fused gate (the bounded fast path). With a precomputed ``g``
            (``use_gate_in_kernel=False``) it is the caller's promise, as in fla, that every log-decay is
            ≥ ``lower_bound`` (−5 if None); the Triton kernels then take their fast diagonal blocks.
        lower_bound: in [−5, 0). With a precomputed ``g`` and ``safe_gate=False`` it bounds nothing (as in fla):
            any log-decay ≤ 0 is computed exactly.
        disable_recompute: accepted; k3's training forward always keeps what its backward reads (same results).
        return_intermediate_states: inside ``torch.inference_mode()`` only: also return ``h``, the state entering
            every ``chunk_size``-token chunk, ``[B, NT, H, K, V]`` in q's dtype (NT = ⌈T/chunk_size⌉; varlen:
            ``[1, Σ_n ⌈T_n/chunk_size⌉, H, K, V]``, the chunks of sequence 0 first) — fla's prefix-cache states.
        state_v_first: every state at the boundary (initial, final, intermediate) is ``[.., V, K]`` (vLLM's layout).
        cu_seqlens: ``[N+1]`` int cumulative lengths of sequences packed along T; needs B = 1.
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (its values are then checked without a device copy).
        cp_context: a context from :func:`k3.ops.kda.build_cp_context` (context parallel; B = 1, varlen stream).
        use_graph, max_num_seqs: fla's graph-capture convention: ``cu_seqlens`` padded with zero-length tail
            sequences to exactly ``max_num_seqs + 1`` entries (checked); same results as without. A varlen call is
            not capturable (the chunk table is built on the host): capturing one raises ``NotImplementedError``.
        chunk_size: 32 or 64: the chunking of ``h`` (the results do not depend on it).
        transpose_state_layout: fla's deprecated name of ``state_v_first`` (a ``DeprecationWarning``).

    Returns:
        ``(o [B, T, H, V] in v.dtype (as fla), final_state fp32 (fp64 for fp64 inputs) or None)``, and ``h`` as a
        third element with ``return_intermediate_states``.
    """
    opts = fla_options(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                       state_v_first=state_v_first, transpose_state_layout=transpose_state_layout,
                       chunk_size=chunk_size, disable_recompute=disable_recompute,
                       return_intermediate_states=return_intermediate_states, cu_seqlens=cu_seqlens,
                       cu_seqlens_cpu=cu_seqlens_cpu, use_graph=use_graph, max_num_seqs=max_num_seqs,
                       cp_context=cp_context)
    if opts.beta_scale != 1.0:
        beta, use_beta_sigmoid_in_kernel = neg_eigval_beta(beta), False
    if opts.state_v_first:
        check_state_v_first(initial_state, q, v)
        initial_state = initial_state.transpose(-1, -2) if initial_state is not None else None
    out = _chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate, lower_bound, cu_seqlens,
                     cu_seqlens_cpu, A_log, dt_bias, cp_context, opts)
    if opts.state_v_first:
        out = tuple(x.transpose(-1, -2).contiguous() if i and x is not None else x for i, x in enumerate(out))
    return out


def _chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate, lower_bound, cu_seqlens, cu_seqlens_cpu,
               A_log, dt_bias, cp_context, opts: FlaOptions):
    """``chunk_kda`` in k3's own terms (states ``[N, H, K, V]``, β as the kernels read it)."""
    # With cp_context, cu_seqlens (if given at all) are the GLOBAL ones: the context checks them, on every rank;
    # an argument error on one rank is reported to the others first (they would wait in the all_gather otherwise).
    q, k = expand_gva(q, k, v)
    reported = contextlib.nullcontext()
    if cp_context is not None:
        reported = cp_reported(cp_context, q, v, initial_state, output_final_state)
    with reported:
        args = kda_args(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                        safe_gate=safe_gate, lower_bound=lower_bound, cu_seqlens=cu_seqlens, A_log=A_log,
                        dt_bias=dt_bias, check_cu_seqlens=cp_context is None, cu_seqlens_cpu=cu_seqlens_cpu)
    if cu_seqlens is not None and q.is_cuda and torch.cuda.is_current_stream_capturing():
        # the chunk table is built on the host from the lengths: a captured graph would replay stale tables
        raise NotImplementedError("chunk_kda with cu_seqlens cannot be captured in a CUDA graph (k3 builds its "
                                  "chunk table on the host); capture fixed-length batches, or run varlen eagerly")
    # The kernels index states and gate parameters densely (q/k/v/g/β are made contiguous where they are read)
    initial_state, A_log, dt_bias = (x.contiguous() if isinstance(x, torch.Tensor) else x
                                     for x in (initial_state, A_log, dt_bias))
    if opts.intermediate:
        o, ht, h = chunk_kda_states(q, k, v, g, beta, initial_state, A_log, dt_bias, args, opts.chunk_size)
        return in_v_dtype((o, ht), v) + (h,)
    if cp_context is None and torch.compiler.is_compiling():
        return in_v_dtype(library.chunk_kda_op(q, k, v, g, beta, initial_state, A_log, dt_bias, args), v)
    # an empty batch has nothing to launch: the reference returns the empty outputs (connected for autograd)
    backend = _checked_backend(q, v)
    with on_device_of(q):
        if cp_context is not None:
            out = cp_chunk_kda(backend, cp_context, q, k, v, g, beta, initial_state, A_log, dt_bias, args)
        else:
            out = maybe_split_chunk_kda(backend, q, k, v, g, beta, initial_state, A_log, dt_bias, args)
            if out is None:
                out = get_backend(backend).chunk_kda(q, k, v, g, beta, initial_state, A_log, dt_bias, args)
    return in_v_dtype(out, v)


def _checked_backend(q: torch.Tensor, v: torch.Tensor) -> str:
    """The backend of this call; the Triton kernels' head dims are bounded as fla's (K ≤ 256), V likewise: their
    block sizes are chosen to fit shared memory up to 256 (``triton/_common.py``)."""
    backend = select_backend(q.device) if q.shape[0] else "torch"
    if backend == "triton" and (q.shape[-1] > 256 or v.shape[-1] > 256):
        raise KDAAssertionError(f"the Triton KDA kernels support head dims K, V <= 256 (as fla), got K={q.shape[-1]}, "
                                f"V={v.shape[-1]} (K3_KDA_BACKEND=torch runs any size)")
    return backend


@torch.compiler.disable
def chunk_kda_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                     args: KDAArgs, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(o, final states, h)`` with h the state entering every ``chunk_size``-token chunk (inference only; a graph
    break under ``torch.compile``, as fla's autograd function is)."""
    backend = _checked_backend(q, v)
    with on_device_of(q):
        return get_backend(backend).chunk_kda_states(q, k, v, g, beta, initial_state, A_log, dt_bias, args,
                                                     chunk_size)


def in_v_dtype(out: tuple[torch.Tensor, Any], v: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The output in v's dtype, as fla allocates it (``zeros_like(v)``). The kernels write q's dtype; the two differ
    only for mixed-dtype calls, which pay one cast here."""
    o, rest = out
    return (o if o.dtype == v.dtype else o.to(v.dtype)), rest
