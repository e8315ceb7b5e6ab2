"""``chunk_kda_triton``: the chunked KDA on the Triton kernels, autograd-capable.

Training (an input needs a gradient) runs the 64-token forward over every chunk with its buffers kept
(``training``), and the backward from them; inference runs the windowed forward (``inference``), whose working
memory does not grow with T. ``train_forward`` / ``train_backward`` are the two halves with the kept buffers as a
flat list (``SAVED`` order), which the registered op ``k3::chunk_kda`` (``k3.ops.kda.library``) returns and takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from k3.ops.kda.reference import chunk_kda_states as reference_states
from k3.ops.kda.triton._common import BT, ChunkTable, alloc_output_state, make_chunk_table, next_pow2, store_dtype
from k3.ops.kda.triton.inference import InferencePlan, kda_fwd_inference
from k3.ops.kda.triton.training import TrainPlan, kda_bwd, prep_all, state_all

__all__ = ["chunk_kda_triton", "chunk_kda_states", "train_forward", "train_backward", "saved_like", "SAVED"]

if TYPE_CHECKING:
    from k3.ops.kda.args import KDAArgs

# what the training forward keeps for the backward (``training.state_all``), in a fixed order
SAVED = ("W", "KG", "QG", "AQK", "GAM", "TM", "HS", "VN")


def saved_like(q: torch.Tensor, v: torch.Tensor, NC: int | torch.SymInt) -> list[torch.Tensor]:
    """Empty tensors shaped as the kept buffers of ``NC`` chunks (``SAVED`` order; the registered op's fake)."""
    H, BK, BVP = q.shape[2], next_pow2(q.shape[3]), next_pow2(v.shape[3])
    e = dict(dtype=store_dtype(q.dtype), device=q.device)
    shapes = dict(W=(BT, BK), KG=(BT, BK), QG=(BT, BK), AQK=(BT, BT), GAM=(BK,), TM=(BT, BT), HS=(BK, BVP),
                  VN=(BT, BVP))
    return [q.new_empty((H, NC) + shapes[n], **(dict(e, dtype=torch.float32) if n == "GAM" else e)) for n in SAVED]


def train_forward(q, k, v, g, beta, initial_state, A_log, dt_bias, args: KDAArgs, tab: ChunkTable | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The training forward: ``(o, final states, the kept buffers in SAVED order)``; inputs contiguous."""
    tab = tab or make_chunk_table(q.shape[0], q.shape[1], args.cu_host, q.device)
    o, ht = alloc_output_state(q, v, initial_state, tab)
    if tab.NC == 0:
        return o, ht, saved_like(q, v, 0)
    saved = state_all(prep_all(q, k, v, g, beta, A_log, dt_bias, args.scale, tab, args.lower_bound, args.flags), o,
                      ht, tab, q.shape[2], q.shape[3], v.shape[3])
    return o, ht, [saved[n] for n in SAVED]


def chunk_kda_states(q, k, v, g, beta, initial_state, A_log, dt_bias, args: KDAArgs, chunk_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(o, final states or None, h)`` with h ``[B, NT, H, K, V]`` (varlen ``[1, NC, H, K, V]``) the state entering
    each chunk, in q's dtype. At the kernels' chunk (64) these are the training forward's kept entry states (HS);
    another chunk size takes the PyTorch reference on the same device."""
    if chunk_size != BT:
        return reference_states(q, k, v, g, beta, initial_state, A_log, dt_bias, args, chunk_size)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if not args.use_gate_in_kernel:
        A_log = dt_bias = None
    o, ht, saved = train_forward(q, k, v, g, beta, initial_state, A_log, dt_bias, args)
    K, V = q.shape[-1], v.shape[-1]
    hs = saved[SAVED.index("HS")][:, :, :K, :V].transpose(0, 1)  # [NC, H, K, V], sequence-major chunks
    h = hs.reshape(1 if args.cu_seqlens is not None else q.shape[0], -1, *hs.shape[1:]).to(q.dtype)
    return o, (ht if args.output_final_state else None), h


def train_backward(do, dht, q, k, v, g, beta, initial_state, A_log, dt_bias, args: KDAArgs,
                   saved: list[torch.Tensor], plan: TrainPlan = TrainPlan(), tab: ChunkTable | None = None) -> tuple:
    """``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)`` from :func:`train_forward`'s buffers."""
    tab = tab or make_chunk_table(q.shape[0], q.shape[1], args.cu_host, q.device)
    return kda_bwd(q, k, v, g, beta, A_log, dt_bias, initial_state, args.scale, do, dht, dict(zip(SAVED, saved)),
                   tab, args.lower_bound, args.flags, plan=plan)


class ChunkKDATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, args, inference, training):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        A_log, dt_bias, initial_state = (x.contiguous() if x is not None else None
                                         for x in (A_log, dt_bias, initial_state))
        tab = make_chunk_table(q.shape[0], q.shape[1], args.cu_host, q.device)
        if not any(ctx.needs_input_grad[:8]):
            o, ht = kda_fwd_inference(q, k, v, g, beta, A_log, dt_bias, args.scale, initial_state, tab,
                                      args.lower_bound, args.flags, inference)
            return o, (ht if args.output_final_state else None)
        o, ht, saved = train_forward(q, k, v, g, beta, initial_state, A_log, dt_bias, args, tab)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
        ctx.saved, ctx.args, ctx.plan, ctx.tab = saved, args, training, tab
        return o, (ht if args.output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, initial_state = ctx.saved_tensors
        dq, dk, dv, dg, db, dA, ddt, dh0 = train_backward(do, dht, q, k, v, g, beta, initial_state, A_log, dt_bias,
                                                          ctx.args, ctx.saved, ctx.plan, ctx.tab)
        ctx.saved = None
        return dq, dk, dv, dg, db, dA, ddt, dh0, None, None, None


def chunk_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    args: KDAArgs,
    inference: InferencePlan = InferencePlan(),
    training: TrainPlan = TrainPlan(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA on CUDA (or the Triton interpreter). Shapes as fla: q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]``, states ``[N, H, K, V]`` fp32. Returns ``(o [B, T, H, V] in q.dtype, final_state or None)``.
    Autograd: gradients for q, k, v, g, beta, initial_state, and A_log / dt_bias when the gate is fused.
    ``inference`` / ``training``: launch choices (the defaults are the tuned ones; tests vary them)."""
    if not args.use_gate_in_kernel:
        A_log = dt_bias = None
    return ChunkKDATriton.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, args, inference, training)
