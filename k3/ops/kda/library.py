"""The KDA ops registered with ``torch.library``, so that ``torch.compile`` regions hold them without graph breaks.

``chunk_kda`` and ``fused_recurrent_kda`` call these when ``torch.compiler.is_compiling()``; in eager mode they call
the backends directly (a registered op's dispatch costs ~20 µs of host time, a quarter of a decode step). Same
kernels, same results.

- ``k3::chunk_kda``: ``(o, final states, kept buffers)``. With ``training`` on the Triton backend the buffers are
  the training forward's (``triton.chunk.SAVED``: their chunk count is data-dependent for varlen batches, an
  unbacked size in the fake), and ``k3::chunk_kda_backward`` runs the backward from them; otherwise none are kept and
  the backward recomputes the PyTorch reference's forward under autograd (the CPU path).
- ``k3::fused_recurrent_kda`` / ``k3::fused_recurrent_kda_pool`` (the pool updated in place): decode, no autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops.kda.args import KDAArgs, get_backend, select_backend
from k3.ops.kda.prefix import maybe_split_chunk_kda

__all__ = ["chunk_kda_op", "fused_recurrent_kda_op"]


def _args(q: Tensor, cu_seqlens: Tensor | None, scale: float, l2: bool, gate: bool, bsig: bool,
          lower_bound: float | None, output_final_state: bool = True) -> KDAArgs:
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return KDAArgs(scale, output_final_state, l2, gate, bsig, lower_bound, cu_seqlens, N)


def _backend(q: Tensor) -> str:
    return select_backend(q.device) if q.shape[0] else "torch"  # an empty batch: the reference's empty outputs


def _keeps_buffers(q: Tensor, training: bool) -> bool:
    return training and _backend(q) == "triton"


@torch.library.custom_op("k3::chunk_kda", mutates_args=())
def _chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
               A_log: Tensor | None, dt_bias: Tensor | None, cu_seqlens: Tensor | None, scale: float,
               use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
               lower_bound: float | None, training: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    args = _args(q, cu_seqlens, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                 lower_bound)
    backend = _backend(q)
    if _keeps_buffers(q, training):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        if not use_gate_in_kernel:
            A_log = dt_bias = None
        return get_backend(backend).train_forward(q, k, v, g, beta, initial_state, A_log, dt_bias, args)
    with torch.no_grad():
        out = maybe_split_chunk_kda(backend, q, k, v, g, beta, initial_state, A_log, dt_bias, args)
        o, ht = out if out is not None else get_backend(backend).chunk_kda(q, k, v, g, beta, initial_state, A_log,
                                                                          dt_bias, args)
    # an op's outputs are fresh, dense tensors (the reference's o is a permuted view; its state may be its input)
    return o.contiguous(), (ht.clone() if ht is initial_state else ht.contiguous()), []


def _final_state_like(q: Tensor, v: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """The fake of a final state: ``[N, H, K, V]``, one per sequence, fp32 (fp64 for fp64 inputs)."""
    B, _, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return q.new_empty(N, H, K, v.shape[-1], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


@_chunk_kda.register_fake
def _(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, scale, use_qk_l2norm_in_kernel,
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound, training):
    B, T, H, _ = q.shape
    o, ht = q.new_empty(B, T, H, v.shape[-1]), _final_state_like(q, v, cu_seqlens)
    if not _keeps_buffers(q, training):
        return o, ht, []
    NC = -(-T // 64) * B if cu_seqlens is None else torch.library.get_ctx().new_dynamic_size()
    return o, ht, get_backend("triton").saved_like(q, v, NC)


@torch.library.custom_op("k3::chunk_kda_backward", mutates_args=())
def _chunk_kda_backward(do: Tensor, dht: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        initial_state: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None,
                        cu_seqlens: Tensor | None, saved: list[Tensor], scale: float, use_qk_l2norm_in_kernel: bool,
                        use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                        lower_bound: float | None) -> list[Tensor]:
    """``[dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias]``, an empty tensor for each input that is None."""
    args = _args(q, cu_seqlens, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                 lower_bound)
    if saved:
        gate = use_gate_in_kernel
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        dq, dk, dv, dg, db, dA, ddt, dh0 = get_backend("triton").train_backward(
            do, dht, q, k, v, g, beta, initial_state, A_log if gate else None, dt_bias if gate else None, args, saved)
        grads = [dq, dk, dv, dg, db, dh0, dA, ddt]
    else:  # the reference's forward again, differentiated by torch.func (an op's kernel runs below autograd)
        ins = (q, k, v, g, beta, initial_state, A_log, dt_bias)
        live = [i for i, x in enumerate(ins) if x is not None]

        def forward(*xs: Tensor) -> tuple[Tensor, Tensor]:
            full = list(ins)
            for i, x in zip(live, xs):
                full[i] = x
            return get_backend("torch").chunk_kda(*full, args)

        (_, ht), vjp = torch.func.vjp(forward, *(ins[i] for i in live))
        got = iter(vjp((do, dht if dht is not None else torch.zeros_like(ht))))
        grads = [next(got) if x is not None else None for x in ins]
    ins = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    return [do.new_empty(0) if x is None else x.new_zeros(x.shape) if gr is None else gr.contiguous()
            for gr, x in zip(grads, ins)]


@_chunk_kda_backward.register_fake
def _(do, dht, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, saved, scale, use_qk_l2norm_in_kernel,
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound):
    return [x.new_empty(x.shape) if x is not None else do.new_empty(0)
            for x in (q, k, v, g, beta, initial_state, A_log, dt_bias)]


def _setup_chunk(ctx, inputs, output) -> None:
    ctx.save_for_backward(*(x for x in inputs[:9] if x is not None), *output[2])
    ctx.present = [x is not None for x in inputs[:9]]
    ctx.n_saved = len(output[2])
    ctx.consts = inputs[9:14]


def _backward_chunk(ctx, do, dht, _dsaved):
    tensors = list(ctx.saved_tensors)
    saved = tensors[len(tensors) - ctx.n_saved:] if ctx.n_saved else []
    it = iter(tensors)
    ins = [next(it) if p else None for p in ctx.present]
    grads = _chunk_kda_backward(do.contiguous(), dht, *ins, saved, *ctx.consts)
    out = []
    for i, gr in enumerate(grads):  # q, k, v, g, beta, initial_state, A_log, dt_bias
        out.append(gr if ins[i] is not None and ctx.needs_input_grad[i] else None)
    return (*out, None, None, None, None, None, None, None)


_chunk_kda.register_autograd(_backward_chunk, setup_context=_setup_chunk)


def chunk_kda_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                 A_log: Tensor | None, dt_bias: Tensor | None, args: KDAArgs) -> tuple[Tensor, Tensor | None]:
    """``k3::chunk_kda`` for a validated call; returns ``(o in q's dtype, final states or None)``."""
    training = torch.is_grad_enabled() and any(
        isinstance(x, Tensor) and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    o, ht, _ = _chunk_kda(q, k, v, g, beta, initial_state, A_log, dt_bias, args.cu_seqlens, args.scale,
                          args.use_qk_l2norm_in_kernel, args.use_gate_in_kernel, args.use_beta_sigmoid_in_kernel,
                          args.lower_bound, training)
    return o, (ht if args.output_final_state else None)


@torch.library.custom_op("k3::fused_recurrent_kda", mutates_args=())
def _fused_recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                         A_log: Tensor | None, dt_bias: Tensor | None, cu_seqlens: Tensor | None, scale: float,
                         use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                         lower_bound: float | None, output_final_state: bool) -> tuple[Tensor, Tensor]:
    args = _args(q, cu_seqlens, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                 lower_bound, output_final_state)
    o, ht = get_backend(select_backend(q.device)).fused_recurrent_kda(q, k, v, g, beta, initial_state, A_log,
                                                                      dt_bias, args)
    return o, (ht if ht is not None else q.new_empty(0, dtype=torch.float32))


@_fused_recurrent_kda.register_fake
def _(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, scale, use_qk_l2norm_in_kernel,
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound, output_final_state):
    B, T, H, _ = q.shape
    ht = _final_state_like(q, v, cu_seqlens) if output_final_state else q.new_empty(0, dtype=torch.float32)
    return v.new_empty(B, T, H, v.shape[-1]), ht


@torch.library.custom_op("k3::fused_recurrent_kda_pool", mutates_args=("pool",))
def _fused_recurrent_kda_pool(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor,
                              ssm_state_indices: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
                              cu_seqlens: Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool,
                              use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                              lower_bound: float | None) -> Tensor:
    args = _args(q, cu_seqlens, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                 lower_bound, False)
    o, _ = get_backend(select_backend(q.device)).fused_recurrent_kda(q, k, v, g, beta, pool, A_log, dt_bias, args,
                                                                     ssm_state_indices)
    return o


@_fused_recurrent_kda_pool.register_fake
def _(q, k, v, g, beta, pool, ssm_state_indices, A_log, dt_bias, cu_seqlens, scale, use_qk_l2norm_in_kernel,
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound):
    return v.new_empty(*q.shape[:3], v.shape[-1])


def fused_recurrent_kda_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                           A_log: Tensor | None, dt_bias: Tensor | None, args: KDAArgs,
                           ssm_state_indices: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``k3::fused_recurrent_kda`` (or the pool op with ``ssm_state_indices``) for a validated call."""
    consts = (args.scale, args.use_qk_l2norm_in_kernel, args.use_gate_in_kernel, args.use_beta_sigmoid_in_kernel,
              args.lower_bound)
    if ssm_state_indices is not None:
        o = _fused_recurrent_kda_pool(q, k, v, g, beta, initial_state, ssm_state_indices, A_log, dt_bias,
                                      args.cu_seqlens, *consts)
        return o, initial_state
    o, ht = _fused_recurrent_kda(q, k, v, g, beta, initial_state, A_log, dt_bias, args.cu_seqlens, *consts,
                                 args.output_final_state)
    return o, (ht if args.output_final_state else None)
