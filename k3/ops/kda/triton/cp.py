"""Context parallel's training step on the Triton kernels, every rank's backward running at once.

The per-rank pieces (context, collectives, headers, the right fold of entry-state gradients) are ``k3.ops.kda.cp``'s;
this module adds what needs the kernels: the training forward whose summary comes from the kept chunk buffers, the
reverse state pass run before the gather, and the halves of a one-piece slice (``docs/kda-kernels.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from k3.ops.kda.cp import _HEADER, _OK_GRAD, KDACPContext, _check_headers, _fold_right, _gather, _header
from k3.ops.kda.triton._common import BT, ChunkTable, alloc_output_state, make_chunk_table
from k3.ops.kda.triton.bwd_state import bwd_state_pass
from k3.ops.kda.triton.span import span_from_buffers, span_rows
from k3.ops.kda.triton.training import kda_bwd, prep_all, state_all

if TYPE_CHECKING:
    from k3.ops.kda.args import KDAArgs

__all__ = ["cp_chunk_kda_train"]


@dataclass
class _Halves:
    """The two chunk-aligned halves of a one-piece slice: A = chunks [0, m), B = [m, NC); segment tables for the
    state passes (both halves, A alone, B alone) and the halves' transition matrices once the forward has them."""

    both: Any
    a: Any
    b: Any
    M_A: torch.Tensor | None = None
    M_B: torch.Tensor | None = None


def _halves_plan(ctx: KDACPContext, tab: Any) -> _Halves | None:
    """Halves for this rank's slice when it is one piece continuing across a rank edge and long enough."""
    if ctx.local_cu_seqlens.numel() != 2 or tab.NC < max(2, ctx.halves_min_chunks):
        return None
    if not (ctx.first_continues or ctx.last_continues):
        return None
    m, L = tab.NC // 2, tab.cu_cpu[-1]
    to = dict(dtype=torch.int32, device=tab.chunk_seq.device)

    def table(cu: list[int], off: list[int]) -> Any:  # chunk numbers of the slice's table: the buffers' indexing
        return ChunkTable(len(cu) - 1, tab.NC, 0, 0, True, torch.tensor(cu, **to), tab.chunk_seq,
                          torch.tensor(off, **to), cu, off)

    return _Halves(table([0, m * BT, L], [0, m, tab.NC]), table([0, m * BT], [0, m]),
                   table([m * BT, L], [m, tab.NC]))


def _span_halves(bufs: dict, hv: _Halves, first: bool, last: bool, H: int, K: int, V: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(E_A, M_A, E_B, M_B)`` fp32 from one span launch over the kept chunk buffers: half A from the slice's
    entry (zero: with ``first`` its map (M_A, E_A) from [0 | I], else its final state E_A alone), half B's map
    only with ``last`` (else None)."""
    dev = bufs["W"].device
    off = hv.both.chunk_off_cpu
    R = 2 if last else 1
    rows = torch.tensor([off[0], off[1]][:R] + [off[1], off[2]][:R] + [int(first), 1][:R], dtype=torch.int32,
                        device=dev)  # row starts, ends, "M wanted", in one upload
    cs, ce, row_m = rows[:R], rows[R:2 * R], rows[2 * R:]
    SE = torch.zeros(R, H, K, V, dtype=torch.float32, device=dev)
    Mt = torch.eye(K, dtype=torch.float32, device=dev).repeat(R, H, 1, 1)
    span_rows(bufs, SE, Mt, cs, ce, row_m, H, K, V)
    return SE[0], Mt[0], (SE[1] if last else None), (Mt[1] if last else None)


class _CPChunkTriton(torch.autograd.Function):
    """Context-parallel training step on the Triton kernels, with every rank's backward running in parallel.

    Forward: the prep of every local chunk (kept for the backward, as in the one-card training forward); the
    summary of the last piece — a rank whose first piece starts fresh takes it from its own state pass (S_ext =
    that piece's final state), a rank that continues a sequence from the kept buffers (no second prep) — then one
    all_gather of ``[H, K, V+K]``, the fold of the earlier ranks into the entry state, and the state pass.

    Backward (the transposed mirror): a rank whose first piece continues runs the reverse state pass alone to get
    J = ∂L_own/∂S_entry (its own outputs' pull on the entry state); one all_gather of J ``[H, K, V]``; each rank folds
    the later ranks' J from the right, ``dS_out(r) = J(r+1) + M(r+1)ᵀ dS_out(r+1)`` (the M term only where rank
    r+1's one piece runs through), and runs its full backward with that as the gradient of its last piece's final
    state. No rank waits on another's backward; each sends ``H·K·V·4`` bytes more (``ctx.last_bwd_bytes_sent``).

    A one-piece slice long enough (``KDACPContext.halves_min_chunks``) runs each of those serial passes as two
    chunk-aligned halves side by side, its summary from the span pass (``_span_halves``) and its reverse passes by
    ``_halves_state_grads``: what the other ranks wait for is a span pass or two half passes, not a whole pass.
    """

    @staticmethod
    def forward(fctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, ctx: KDACPContext, scale: float,
                kflags: dict, lower_bound: float | None) -> torch.Tensor:
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        L, H, K, V, dev = q.shape[1], q.shape[2], q.shape[3], v.shape[3], q.device
        tab = make_chunk_table(1, L, ctx.local_cu_seqlens, dev)  # the CPU copy: no device round trip
        bufs = prep_all(q, k, v, g, beta, A_log, dt_bias, scale, tab, lower_bound, kflags)
        o, ht = alloc_output_state(q, v, None, tab)  # ht: zero entries, the first piece's filled after the fold
        M = torch.zeros(H, K, K, dtype=torch.float32, device=dev)
        E = torch.zeros(H, K, V, dtype=torch.float32, device=dev)
        saved = None
        hv = _halves_plan(ctx, tab)
        ctx.last_halves = hv is not None
        if hv is not None:
            E_A, hv.M_A, E_B, hv.M_B = _span_halves(bufs, hv, ctx.first_continues, ctx.last_continues, H, K, V)
            if ctx.last_continues:  # the whole piece's map, (M_B, E_B) ∘ (M_A, E_A)
                E = hv.M_B @ E_A + E_B
                if ctx.send_M:
                    M = hv.M_B @ hv.M_A
        elif not ctx.first_continues:
            saved = state_all(bufs, o, ht, tab, H, K, V)
            if ctx.last_continues:
                E = ht[-1]
        elif ctx.last_continues:
            Ms, Es = span_from_buffers(bufs, tab, H, K, V, need_M=ctx.send_M)
            E, M = Es[-1], (Ms[-1] if ctx.send_M else M)
        packed = torch.cat([torch.cat([E, M], -1).flatten(), _header(ctx, L, _OK_GRAD, dev)])
        gathered = _gather(packed, ctx.group, ctx.world_size)
        ctx.last_bytes_sent = packed.numel() * packed.element_size()
        _check_headers(gathered, ctx, None)
        body = gathered[:, :-_HEADER].reshape(ctx.world_size, H, K, V + K)
        S = torch.zeros(H, K, V, dtype=torch.float32, device=dev)
        for j in ctx.pre_ranks:
            S = body[j, :, :, V:] @ S + body[j, :, :, :V]
        if hv is not None:  # both halves' state passes at once, from their exact entry states
            ht = torch.stack([S, hv.M_A @ S + E_A if ctx.first_continues else E_A])
            saved = state_all(bufs, o, ht, hv.both, H, K, V)
        elif ctx.first_continues:
            ht[0] = S
            saved = state_all(bufs, o, ht, tab, H, K, V)
        fctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias)
        fctx.saved, fctx.tab, fctx.M_all, fctx.halves = saved, tab, body[:, :, :, V:].contiguous(), hv
        fctx.cp, fctx.scale, fctx.kflags, fctx.lower_bound = ctx, scale, kflags, lower_bound
        return o

    @staticmethod
    def backward(fctx: Any, do: torch.Tensor) -> tuple:
        q, k, v, g, beta, A_log, dt_bias = fctx.saved_tensors
        ctx, tab, saved = fctx.cp, fctx.tab, fctx.saved
        H, K, V, dev = q.shape[2], q.shape[3], v.shape[3], q.device
        do = do.contiguous()
        dht = None
        if fctx.halves is not None:
            first = _halves_state_grads(fctx, do, q.dtype, H, K, V)
        else:
            first = None
            J = torch.zeros(H, K, V, dtype=torch.float32, device=dev)
            if ctx.first_continues:
                first = bwd_state_pass(do, None, saved, tab, H, K, V, q.dtype)
                J = first[2][0]
            J_all = _gather(J, ctx.group, ctx.world_size)
            ctx.last_bwd_bytes_sent = J.numel() * J.element_size()
            if ctx.last_continues:
                dht = torch.zeros(tab.N, H, K, V, dtype=torch.float32, device=dev)
                dht[-1] = _fold_right(ctx, J_all, fctx.M_all)
                first = None  # the state pass must see dht
        dq, dk, dv, dg, db, dA, ddt, _ = kda_bwd(q, k, v, g, beta, A_log, dt_bias, None, fctx.scale, do, dht, saved,
                                                 tab, fctx.lower_bound, fctx.kflags, state_grads=first)
        fctx.saved = None
        return dq, dk, dv, dg, db, dA, ddt, None, None, None, None


def _halves_state_grads(fctx: Any, do: torch.Tensor, dtype: torch.dtype, H: int, K: int, V: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reverse state passes of a rank whose slice runs as two halves: ``(DHS, DV, dh0)`` for ``kda_bwd``.

    Before the gather of J, the pass that needs no other rank: with ``first_continues`` both halves side by side
    from a zero terminal gradient (B's results are then final if nothing comes from later ranks), giving
    J = dh0_A + M_Aᵀ dh0_B; else (the rank's entry is known) half B alone from zero, its pull dh0_B. After it, with
    the gradient dS on the slice's final state from later ranks: both halves again, B from dS and A from
    dh0_B + M_Bᵀ dS (B's pull on A's end); without one: half A alone from dh0_B."""
    ctx, saved, hv = fctx.cp, fctx.saved, fctx.halves
    J = torch.zeros(H, K, V, dtype=torch.float32, device=do.device)
    if ctx.first_continues:
        DHS, DV, d0 = bwd_state_pass(do, None, saved, hv.both, H, K, V, dtype)
        pull_B = d0[1]
        J = d0[0] + hv.M_A.transpose(-1, -2) @ pull_B
    else:
        DHS, DV, d0 = bwd_state_pass(do, None, saved, hv.b, H, K, V, dtype)
        pull_B = d0[0]
    out = (DHS, DV)  # the passes after the gather rewrite their chunks in place
    J_all = _gather(J, ctx.group, ctx.world_size)
    ctx.last_bwd_bytes_sent = J.numel() * J.element_size()
    if ctx.last_continues:
        dS = _fold_right(ctx, J_all, fctx.M_all)
        dht = torch.stack([pull_B + hv.M_B.transpose(-1, -2) @ dS, dS])
        return bwd_state_pass(do, dht, saved, hv.both, H, K, V, dtype, out=out)
    return bwd_state_pass(do, pull_B[None].contiguous(), saved, hv.a, H, K, V, dtype, out=out)


def cp_chunk_kda_train(ctx: KDACPContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                       args: KDAArgs) -> torch.Tensor:
    """This rank's output of ``chunk_kda`` on its slice, autograd-capable (every rank must run the backward)."""
    if not args.use_gate_in_kernel:
        A_log = dt_bias = None
    return _CPChunkTriton.apply(q, k, v, g, beta, A_log, dt_bias, ctx, args.scale, args.flags, args.lower_bound)
