"""``chunk_kda``: fla-compatible chunked KDA with backend dispatch (torch reference on CPU, Triton on CUDA).

Levels: ``_preprocess`` (the in-kernel activations, plain torch) → backend functions with ONE shared signature
(``_chunk_kda_torch`` here, ``k3.ops.kda.triton.chunk_kda_triton``) → the public ``chunk_kda``, which validates,
picks the backend, and routes long no-grad prefills to the exact split path (``prefix.py``) and
``cp_context`` calls to context parallel (``cp.py``).
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Any, Callable

import torch

from k3.ops._device import on_device_of
from k3.ops.kda.checks import check_kda_call
from k3.ops.kda.gate import kda_gate_fused
from k3.ops.kda.naive import naive_chunk_kda

__all__ = ["chunk_kda", "expand_gva", "select_backend", "backend_fn"]

# The torch form materialises [.., C, C, K] decay tensors per chunk: C = 16 moves 4x fewer bytes per token than 64
# and trains the tiny model ~3x faster on a CPU (0.085 vs 0.25 s per fwd+bwd step, measured on 2 cores).
_TORCH_CHUNK = 16

_ENV = "K3_KDA_BACKEND"


def _triton_module(required: bool) -> ModuleType | None:
    """``k3.ops.kda.triton`` imported lazily; ``None`` when absent unless ``required``."""
    try:
        import k3.ops.kda.triton as kt  # noqa: PLC0415 (lazy: triton is optional and heavy)

        if not hasattr(kt, "chunk_kda_triton"):  # e.g. a half-written package (namespace dir) during development
            raise ImportError("k3.ops.kda.triton has no chunk_kda_triton")
    except ImportError as e:
        if required:
            raise RuntimeError(f"{_ENV}=triton but the Triton KDA backend cannot be imported: {e}") from e
        return None
    return kt


def select_backend(device: torch.device) -> str:
    """'triton' for CUDA tensors, 'torch' otherwise; ``K3_KDA_BACKEND=triton|torch`` forces one."""
    forced = os.environ.get(_ENV, "").strip().lower()
    if forced not in ("", "auto", "torch", "triton"):
        raise ValueError(f"{_ENV} must be 'triton', 'torch' or unset, got {forced!r}")
    if forced == "torch":
        return "torch"
    if forced == "triton":
        _triton_module(required=True)
        return "triton"
    return "triton" if device.type == "cuda" and _triton_module(required=False) is not None else "torch"


def backend_fn(backend: str, name: str) -> Callable[..., Any] | None:
    """The backend's implementation of ``name`` (e.g. 'chunk_kda'); ``None`` if the Triton side lacks it."""
    if backend == "torch":
        from k3.ops.kda import fused_recurrent, prefix  # noqa: PLC0415 (cycle: they import this module)

        table = {"chunk_kda": _chunk_kda_torch, "fused_recurrent_kda": fused_recurrent._fused_recurrent_kda_torch,
                 "span_summaries": prefix._span_summaries_torch}
        return table[name]
    kt = _triton_module(required=True)
    return getattr(kt, f"{name}_triton", None)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last dim (fla's in-kernel L2 norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def expand_gva(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """fla's grouped value attention (GVA): v, g, β, A_log, dt_bias and the states have HV = G·H heads, q and k
    have H; value head j reads query/key head j // G. The entry points expand q and k here (``repeat_interleave``,
    whose backward sums each group's gradients), so every backend and path sees HV heads. K3 itself has HV = H, for
    which this is one shape comparison. Anything malformed is left to the checks, which name it."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and q.dim() == 4 and v.dim() == 4 and k.shape == q.shape and v.shape[:2] == q.shape[:2]):
        return q, k
    H, HV = q.shape[2], v.shape[2]
    if HV == H:
        return q, k
    if H == 0 or HV % H:
        raise ValueError(f"v has {HV} heads but q/k have H={H}: v's heads must equal H or be a multiple of it "
                         "(grouped value attention)")
    return q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)


def _preprocess(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    lower_bound: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the optional in-kernel activations in fp32 (fp64 for fp64 inputs): L2-norm q/k, gate, β sigmoid."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, g, beta = (x.to(acc) for x in (q, k, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate_fused(g, A_log, dt_bias, lower_bound).to(acc)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    return q, k, g, beta


def _chunk_kda_torch(
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
    """Torch backend (same signature as ``chunk_kda_triton``): preprocess + :func:`naive_chunk_kda`, autograd."""
    qp, kp, gp, bp = _preprocess(q, k, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                 use_beta_sigmoid_in_kernel, lower_bound, A_log, dt_bias)
    o, S = naive_chunk_kda(qp, kp, v.to(qp.dtype), gp, bp, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           chunk_size=_TORCH_CHUNK)
    return o.to(q.dtype), S


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
        from k3.ops.kda.cp import cp_reported  # noqa: PLC0415

        reported = cp_reported(cp_context, q, v, initial_state, output_final_state)
    with reported:
        scale, lb = check_kda_call(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, safe_gate,
                                   lower_bound, cu_seqlens if cp_context is None else None, A_log, dt_bias)
    # The Triton kernels index states and gate parameters densely (q/k/v/g/β are made contiguous where they are
    # read): a strided initial_state, A_log or dt_bias (e.g. a transposed view) gave wrong results before this.
    initial_state, A_log, dt_bias = (x.contiguous() if isinstance(x, torch.Tensor) else x
                                     for x in (initial_state, A_log, dt_bias))
    if not use_gate_in_kernel:
        # The backends read ``lower_bound`` with a precomputed g as "every log-decay is ≥ this": the Triton
        # kernels' 16-row diagonal blocks rely on it (e^{−g} over a block must stay finite). Only safe_gate makes
        # that promise; a lower_bound alone does not clamp g (fla ignores it there too), so it must not reach them.
        lb = (lb if lb is not None else -5.0) if safe_gate else None
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, lb, cu_seqlens, A_log, dt_bias)
    # an empty batch has nothing to launch: the reference returns the empty outputs (connected for autograd)
    backend = select_backend(q.device) if q.shape[0] else "torch"
    with on_device_of(q):
        if cp_context is not None:
            from k3.ops.kda.cp import cp_chunk_kda  # noqa: PLC0415

            out = cp_chunk_kda(backend, cp_context, *args)
        else:
            from k3.ops.kda.prefix import maybe_split_chunk_kda  # noqa: PLC0415

            out = maybe_split_chunk_kda(backend, *args)
            if out is None:
                out = backend_fn(backend, "chunk_kda")(*args)
    return in_v_dtype(out, v)


def in_v_dtype(out: tuple[torch.Tensor, Any], v: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The output in v's dtype, as fla allocates it (``zeros_like(v)``). The kernels write q's dtype; the two differ
    only for mixed-dtype calls, which pay one cast here."""
    o, rest = out
    return (o if o.dtype == v.dtype else o.to(v.dtype)), rest
