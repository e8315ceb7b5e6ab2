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
from k3.ops.kda.args import expand_gva, get_backend, kda_args, select_backend
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
    safe_gate: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cp_context: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked Kimi Delta Attention, autograd-capable; a drop-in for fla's ``chunk_kda`` on these arguments.

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]``, HV = H or a multiple of it (fla's grouped value attention:
            value head j reads query/key head j // (HV/H); g, beta, A_log, dt_bias and the states then have HV heads).
        g: ``[B, T, H, K]``: log-decay (≤ 0), or raw gate pre-activations when ``use_gate_in_kernel``.
        beta: ``[B, T, H]``: β ∈ (0, 1), or logits when ``use_beta_sigmoid_in_kernel``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state: also return the final states ``[N, H, K, V]`` fp32.
        use_qk_l2norm_in_kernel: q, k ← x / sqrt(Σx² + 1e-6) per head.
        use_gate_in_kernel: g ← lower_bound·sigmoid(exp(A_log)·(g + dt_bias)) if ``lower_bound`` is set (A_log may
            then be None), else −exp(A_log)·softplus(g + dt_bias). ``A_log [H]``, ``dt_bias [H*K]`` fp32.
        safe_gate: requires ``lower_bound`` with the fused gate (the bounded fast path). With a precomputed ``g``
            (``use_gate_in_kernel=False``) it is the caller's promise, as in fla, that every log-decay is
            ≥ ``lower_bound`` (−5 if None); the Triton kernels then take their fast diagonal blocks.
        lower_bound: in [−5, 0). With a precomputed ``g`` and ``safe_gate=False`` it bounds nothing (as in fla):
            any log-decay ≤ 0 is computed exactly.
        cu_seqlens: ``[N+1]`` int cumulative lengths of sequences packed along T; needs B = 1.
        cp_context: a context from :func:`k3.ops.kda.build_cp_context` (context parallel; B = 1, varlen stream).

    Returns:
        ``(o [B, T, H, V] in v.dtype (as fla), final_state [N, H, K, V] fp32 (fp64 for fp64 inputs) or None)``.
    """
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
                        dt_bias=dt_bias, check_cu_seqlens=cp_context is None)
    # The kernels index states and gate parameters densely (q/k/v/g/β are made contiguous where they are read)
    initial_state, A_log, dt_bias = (x.contiguous() if isinstance(x, torch.Tensor) else x
                                     for x in (initial_state, A_log, dt_bias))
    if cp_context is None and torch.compiler.is_compiling():
        return in_v_dtype(library.chunk_kda_op(q, k, v, g, beta, initial_state, A_log, dt_bias, args), v)
    # an empty batch has nothing to launch: the reference returns the empty outputs (connected for autograd)
    backend = select_backend(q.device) if q.shape[0] else "torch"
    with on_device_of(q):
        if cp_context is not None:
            out = cp_chunk_kda(backend, cp_context, q, k, v, g, beta, initial_state, A_log, dt_bias, args)
        else:
            out = maybe_split_chunk_kda(backend, q, k, v, g, beta, initial_state, A_log, dt_bias, args)
            if out is None:
                out = get_backend(backend).chunk_kda(q, k, v, g, beta, initial_state, A_log, dt_bias, args)
    return in_v_dtype(out, v)


def in_v_dtype(out: tuple[torch.Tensor, Any], v: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The output in v's dtype, as fla allocates it (``zeros_like(v)``). The kernels write q's dtype; the two differ
    only for mixed-dtype calls, which pay one cast here."""
    o, rest = out
    return (o if o.dtype == v.dtype else o.to(v.dtype)), rest
