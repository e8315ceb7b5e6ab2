"""``chunk_kda_triton``: the chunked KDA on the Triton kernels, autograd-capable.

Training (an input needs a gradient) runs the 64-token forward over every chunk with its buffers kept
(``training``), and the backward from them; inference runs the windowed forward (``inference``), whose working
memory does not grow with T.
"""

from __future__ import annotations

import torch

from k3.ops.kda.triton.common import alloc_output_state, make_chunk_table
from k3.ops.kda.triton.inference import InferencePlan, kda_fwd_inference
from k3.ops.kda.triton.training import TrainPlan, kda_bwd, prep_all, state_all

__all__ = ["chunk_kda_triton"]


def _flags(use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
           lower_bound: float | None) -> dict:
    return dict(
        l2norm=bool(use_qk_l2norm_in_kernel),
        use_gate=bool(use_gate_in_kernel),
        beta_sigmoid=bool(use_beta_sigmoid_in_kernel),
        # the 16-row reference trick needs per-step |g| ≤ 5; without a bound the diagonal blocks go exact
        exact_diag=lower_bound is None,
    )


class ChunkKDATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, flags,
                lower_bound, cu_seqlens, inference, training):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        A_log, dt_bias, initial_state = (x.contiguous() if x is not None else None
                                         for x in (A_log, dt_bias, initial_state))
        tab = make_chunk_table(q.shape[0], q.shape[1], cu_seqlens, q.device)
        if not any(ctx.needs_input_grad[:8]):
            o, ht = kda_fwd_inference(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, tab, lower_bound,
                                      flags, inference)
            return o, (ht if output_final_state else None)
        o, ht = alloc_output_state(q, v, initial_state, tab)
        saved = None
        if tab.NC:
            saved = state_all(prep_all(q, k, v, g, beta, A_log, dt_bias, scale, tab, lower_bound, flags), o, ht, tab,
                              q.shape[2], q.shape[3], v.shape[3])
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
        ctx.saved, ctx.tab, ctx.scale, ctx.flags, ctx.lower_bound = saved, tab, scale, flags, lower_bound
        ctx.plan = training
        return o, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, initial_state = ctx.saved_tensors
        grads = kda_bwd(q, k, v, g, beta, A_log, dt_bias, initial_state, ctx.scale, do, dht, ctx.saved, ctx.tab,
                        ctx.lower_bound, ctx.flags, plan=ctx.plan)
        ctx.saved = None
        dq, dk, dv, dg, db, dA, ddt, dh0 = grads
        return dq, dk, dv, dg, db, dA, ddt, dh0, None, None, None, None, None, None, None


def chunk_kda_triton(
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
    inference: InferencePlan = InferencePlan(),
    training: TrainPlan = TrainPlan(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA on CUDA (or the Triton interpreter). Shapes as fla: q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]``, states ``[N, H, K, V]`` fp32. Returns ``(o [B, T, H, V] in q.dtype, final_state or None)``.
    Autograd: gradients for q, k, v, g, beta, initial_state, and A_log / dt_bias when the gate is fused."""
    flags = _flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    return ChunkKDATriton.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, float(scale),
                                bool(output_final_state), flags, lower_bound, cu_seqlens, inference, training)
