"""``fused_recurrent_kda``: token-by-token KDA for decoding (forward only), with an in-place state-pool variant.

State pool (batched serving): ``state_pool [P, H, K, V]`` fp32 holds one state per slot; sequence n of the batch
reads and writes slot ``ssm_state_indices[n]`` IN PLACE. Two spellings of the same thing:
``fused_recurrent_kda(..., initial_state=state_pool, ssm_state_indices=idx)`` (fla/vLLM style, returns
``(o, state_pool)``) and ``fused_recurrent_kda_pool(q, k, v, g, beta, state_pool, slot_indices, ...)`` (returns o).
"""

from __future__ import annotations

import torch

from k3.ops._device import on_device_of
from k3.ops.kda.checks import check_kda_call
from k3.ops.kda.chunk import _preprocess, backend_fn, expand_gva, select_backend
from k3.ops.kda.naive import _from_padded, _to_padded, naive_recurrent_kda, varlen_pad_index

__all__ = ["fused_recurrent_kda", "fused_recurrent_kda_pool"]

def _check_pool(pool: torch.Tensor, idx: torch.Tensor, N: int, H: int, K: int, V: int, device: torch.device) -> None:
    """Shape/dtype checks of a state pool and its slot indices (values are checked only for CPU indices: a check
    of CUDA indices would cost a device sync on every decode step)."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or tuple(pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state_pool (initial_state) must be [P, H, K, V] = [P, {H}, {K}, {V}], "
                         f"got {tuple(getattr(pool, 'shape', ()))}")
    if pool.dtype != torch.float32 or pool.device != device:
        raise ValueError(f"state_pool must be fp32 on {device}, got {pool.dtype} on {pool.device}")
    if not isinstance(idx, torch.Tensor) or idx.shape != (N,) or idx.is_floating_point():
        raise ValueError(f"ssm_state_indices must be an integer tensor [N] = [{N}], got "
                         f"{getattr(idx, 'dtype', type(idx))} {tuple(getattr(idx, 'shape', ()))}")
    if idx.device.type == "cpu" and N > 0:
        if int(idx.max()) >= pool.shape[0]:
            raise ValueError(f"ssm_state_indices must be < {pool.shape[0]} (the pool's slots; negative = none), "
                             f"got {idx.tolist()}")
        live = idx[idx >= 0]
        if live.unique().numel() != live.numel():
            raise ValueError(f"ssm_state_indices must be distinct (one slot per sequence), got {idx.tolist()}")


@torch.no_grad()
def _fused_recurrent_kda_torch(
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
    ssm_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch backend (signature of ``fused_recurrent_kda_triton``). With ``ssm_state_indices`` the
    ``initial_state`` is a pool updated in place and returned as the second element."""
    qp, kp, gp, bp = _preprocess(q, k, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                 use_beta_sigmoid_in_kernel, lower_bound, A_log, dt_bias)
    vp = v.to(qp.dtype)
    S0 = initial_state
    if ssm_state_indices is not None:  # a negative slot: start from zero, write nothing (as the GPU kernels)
        slots = ssm_state_indices.to(initial_state.device).long()
        live = slots >= 0
        S0 = initial_state.new_zeros(slots.numel(), *initial_state.shape[1:])
        S0[live] = initial_state[slots[live]]
    if cu_seqlens is not None:  # tail padding (k = v = β = g = 0) leaves the state unchanged: exact
        src, dst, _ = varlen_pad_index(cu_seqlens, 1)
        qp, kp, vp, gp, bp = (_to_padded(x, src) for x in (qp, kp, vp, gp, bp))
    o, S = naive_recurrent_kda(qp, kp, vp, gp, bp, scale=scale, initial_state=S0, output_final_state=True)
    if cu_seqlens is not None:
        o = _from_padded(o, dst)
    if ssm_state_indices is not None:
        initial_state[slots[live]] = S[live].to(initial_state.dtype)
        return o.to(v.dtype), initial_state
    return o.to(v.dtype), (S if output_final_state else None)


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
    safe_gate: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cp_context: None = None,
    ssm_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA for decoding; forward only (no autograd). Arguments and shapes as :func:`chunk_kda`; the
    positional order is fla's ``fused_recurrent_kda`` (``A_log, dt_bias`` right after ``beta``, then ``scale,
    initial_state, …``), so positional fla calls work unchanged.

    ``ssm_state_indices [N]`` (int): ``initial_state`` is then a state pool ``[P, H, K, V]`` fp32; sequence n starts
    from ``initial_state[ssm_state_indices[n]]`` and its final state is written back there IN PLACE; a negative
    index (a padding row, vLLM's ``PAD_SLOT_ID``) starts from zero and writes nothing; the pool is returned as the
    second element (``output_final_state`` is ignored). Returns ``(o [B, T, H, V] in v.dtype,
    final_state [N, H, K, V] fp32 or None)``.
    """
    if cp_context is not None:
        raise ValueError("cp_context is not supported by fused_recurrent_kda (decode is not context parallel)")
    q, k = expand_gva(q, k, v)
    pool = None
    if ssm_state_indices is not None:
        pool, initial_state = initial_state, None
    scale, lb = check_kda_call(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, safe_gate, lower_bound,
                               cu_seqlens, A_log, dt_bias)
    if ssm_state_indices is not None:
        if pool is None:
            raise ValueError("initial_state must be the state pool [P, H, K, V] fp32 when ssm_state_indices is given, "
                             "got None")
        B, _, H, K = q.shape
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        _check_pool(pool, ssm_state_indices, N, H, K, v.shape[-1], q.device)
        initial_state = pool
    # A Triton package without its decode kernel falls back to the torch loop (correct on any device, slow on GPU).
    fn = backend_fn(select_backend(q.device), "fused_recurrent_kda") or backend_fn("torch", "fused_recurrent_kda")
    with on_device_of(q):  # both backends return o in v's dtype (fla's), so nothing is cast here
        return fn(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, lb, cu_seqlens, A_log, dt_bias, ssm_state_indices=ssm_state_indices)


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
