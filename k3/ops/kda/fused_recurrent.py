"""``fused_recurrent_kda``: token-by-token KDA for decoding (forward only), with an in-place state-pool variant.

State pool (batched serving): ``state_pool [P, H, K, V]`` fp32 holds one state per slot; sequence n of the batch
reads and writes slot ``ssm_state_indices[n]`` IN PLACE. Two spellings of the same thing:
``fused_recurrent_kda(..., initial_state=state_pool, ssm_state_indices=idx)`` (fla/vLLM style, returns
``(o, state_pool)``) and ``fused_recurrent_kda_pool(q, k, v, g, beta, state_pool, slot_indices, ...)`` (returns o).
"""

from __future__ import annotations

import torch

from k3.ops._device import on_device_of
from k3.ops.kda import library
from k3.ops.kda.args import (
    check_state_v_first,
    expand_gva,
    fla_options,
    get_backend,
    kda_args,
    neg_eigval_beta,
    select_backend,
)

__all__ = ["fused_recurrent_kda", "fused_recurrent_kda_pool"]


def _check_pool(pool: torch.Tensor, idx: torch.Tensor, N: int, H: int, K: int, V: int, device: torch.device) -> None:
    """Shape/dtype checks of a state pool and its slot indices (values are checked only for CPU indices outside a
    compiled graph: a check of CUDA indices would cost a device sync on every decode step)."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or tuple(pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state_pool (initial_state) must be [P, H, K, V] = [P, {H}, {K}, {V}], "
                         f"got {tuple(getattr(pool, 'shape', ()))}")
    if pool.dtype != torch.float32 or pool.device != device:
        raise ValueError(f"state_pool must be fp32 on {device}, got {pool.dtype} on {pool.device}")
    if not isinstance(idx, torch.Tensor) or idx.shape != (N,) or idx.is_floating_point():
        raise ValueError(f"ssm_state_indices must be an integer tensor [N] = [{N}], got "
                         f"{getattr(idx, 'dtype', type(idx))} {tuple(getattr(idx, 'shape', ()))}")
    if idx.device.type == "cpu" and N > 0 and not torch.compiler.is_compiling():
        if int(idx.max()) >= pool.shape[0]:
            raise ValueError(f"ssm_state_indices must be < {pool.shape[0]} (the pool's slots; negative = none), "
                             f"got {idx.tolist()}")
        live = idx[idx >= 0]
        if live.unique().numel() != live.numel():
            raise ValueError(f"ssm_state_indices must be distinct (one slot per sequence), got {idx.tolist()}")


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    safe_gate: bool = False,
    cp_context: None = None,
    ssm_state_indices: torch.Tensor | None = None,
    transpose_state_layout: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA for decoding; forward only (no autograd). Arguments and shapes as :func:`chunk_kda`; the
    positional order is fla's ``fused_recurrent_kda`` (``A_log, dt_bias`` right after ``beta``, then ``scale,
    initial_state, …, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens``), so positional fla calls work
    unchanged; k3's additions are keyword-only.

    ``allow_neg_eigval``: β = 2·sigmoid(beta) (needs ``use_beta_sigmoid_in_kernel``). ``state_v_first``: states
    (initial, final, and the pool below) are ``[.., V, K]``. ``transpose_state_layout``: fla's deprecated name of
    ``state_v_first``.

    ``ssm_state_indices [N]`` (int): ``initial_state`` is then a state pool ``[P, H, K, V]`` fp32; sequence n starts
    from ``initial_state[ssm_state_indices[n]]`` and its final state is written back there IN PLACE; a negative
    index (a padding row, vLLM's ``PAD_SLOT_ID``) starts from zero and writes nothing; the pool is returned as the
    second element (``output_final_state`` is ignored). Returns ``(o [B, T, H, V] in v.dtype,
    final_state [N, H, K, V] fp32 or None)``.
    """
    if not (allow_neg_eigval or state_v_first or transpose_state_layout is not None):  # K3's call: no host time
        return _fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                                    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                    safe_gate, lower_bound, cu_seqlens, cp_context, ssm_state_indices)
    opts = fla_options(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                       state_v_first=state_v_first, transpose_state_layout=transpose_state_layout)
    if opts.beta_scale != 1.0:
        beta, use_beta_sigmoid_in_kernel = neg_eigval_beta(beta), False
    if opts.state_v_first:
        # a V-first pool is updated through this transposed view (in place: both backends write through it)
        if ssm_state_indices is None:
            check_state_v_first(initial_state, q, v)
        initial_state = initial_state.transpose(-1, -2) if isinstance(initial_state, torch.Tensor) else initial_state
    o, ht = _fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                                 use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate,
                                 lower_bound, cu_seqlens, cp_context, ssm_state_indices)
    if opts.state_v_first and ht is not None:
        ht = ht.transpose(-1, -2)
        if ssm_state_indices is None:
            ht = ht.contiguous()
    return o, ht


def _fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate,
                         lower_bound, cu_seqlens, cp_context, ssm_state_indices):
    """``fused_recurrent_kda`` in k3's own terms (states ``[.., K, V]``, β as the kernels read it)."""
    if cp_context is not None:
        raise ValueError("cp_context is not supported by fused_recurrent_kda (decode is not context parallel)")
    q, k = expand_gva(q, k, v)
    pool = None
    if ssm_state_indices is not None:
        pool, initial_state = initial_state, None
    args = kda_args(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, safe_gate=safe_gate,
                    lower_bound=lower_bound, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias)
    if ssm_state_indices is not None:
        if pool is None:
            raise ValueError("initial_state must be the state pool [P, H, K, V] fp32 when ssm_state_indices is given, "
                             "got None")
        H, K = q.shape[2], q.shape[3]
        _check_pool(pool, ssm_state_indices, args.N, H, K, v.shape[-1], q.device)
        initial_state = pool
    if torch.compiler.is_compiling():
        return library.fused_recurrent_kda_op(q, k, v, g, beta, initial_state, A_log, dt_bias, args,
                                              ssm_state_indices)
    with on_device_of(q):  # both backends return o in v's dtype (fla's), so nothing is cast here
        return get_backend(select_backend(q.device)).fused_recurrent_kda(
            q, k, v, g, beta, initial_state, A_log, dt_bias, args, ssm_state_indices)


def fused_recurrent_kda_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_indices: torch.Tensor,
    **kwargs: object,
) -> torch.Tensor:
    """Decode step(s) against a state pool ``[P, H, K, V]`` fp32, updated in place at ``slot_indices [N]``.
    Other keyword arguments as :func:`fused_recurrent_kda`. Returns o ``[B, T, H, V]``."""
    if "initial_state" in kwargs or "ssm_state_indices" in kwargs:
        raise ValueError("fused_recurrent_kda_pool takes state_pool/slot_indices, not initial_state/ssm_state_indices")
    o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=state_pool, ssm_state_indices=slot_indices, **kwargs)
    return o
