"""Context parallel KDA over a ``torch.distributed`` group (SPEC §2, "Across cards"); fla's API shape.

The packed (B = 1, varlen) token stream is cut into W equal contiguous slices, one per rank. Only the first local
piece of a rank can continue a sequence from earlier ranks, and only the last local piece can continue into later
ranks. Each rank summarises its LAST piece as ``(M, S_ext)`` (the affine map from the state entering that piece to
the state leaving it), one all_gather shares the packed ``[H, K, V+K]`` summaries, and each rank folds the summaries
of the earlier ranks that hold its first sequence (``S ← M_j S + E_j``) into the exact entry state of its first
piece, then runs its local forward. The backward is the transposed mirror, built by autograd: the gradient of the
gathered summaries is summed over ranks (all_reduce on gloo, reduce_scatter on NCCL) and each rank keeps its own.

A 4-value header (local length, world size, cu_seqlens fingerprint, status) rides in the same all_gather, so a
rank with bad input makes EVERY rank raise ``ValueError`` instead of leaving the others waiting in a collective:
its slice, its cu_seqlens, its group, an initial_state / output_final_state, any argument error of ``chunk_kda``
(:func:`cp_reported`), and inputs that need grad on some ranks only (the backward's collectives must pair up).
Bytes sent per rank per call: ``H·K·(K+V)·4 + 16`` (fp32), independent of T (``ctx.last_bytes_sent``).
"""

from __future__ import annotations

import bisect
import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["KDACPContext", "build_cp_context", "cp_chunk_kda", "cp_conv_halo", "cp_reported"]

_HEADER = 4
# the header's status: bad input, fine without gradients, fine with gradients (every rank must agree on the last)
_BAD, _OK, _OK_GRAD = 0.0, 1.0, 2.0
_NO_STATES = "initial_state / output_final_state are not supported with cp_context (as in fla)"


@dataclass
class KDACPContext:
    """What a rank knows about the global varlen stream; built by :func:`build_cp_context`.

    ``cu_seqlens`` global ``[N+1]`` (int64, CPU); this rank holds tokens ``[start, end)``; ``local_cu_seqlens``
    cuts that slice into pieces of sequences; ``first_continues``: the first piece continues a sequence that began
    on an earlier rank; ``pre_ranks``: those earlier ranks, in order; ``last_continues``: the last piece goes on into
    the next rank; ``send_M``: the last piece is also the first and continues (its entry is nonzero, so later ranks
    need its transition matrix M, not only S_ext). ``last_continues_all`` / ``send_M_all``: those two flags of every
    rank (the backward folds the entry-state gradients of the later ranks).
    """

    cu_seqlens: torch.Tensor
    group: Any
    world_size: int
    rank: int
    start: int
    end: int
    local_cu_seqlens: torch.Tensor
    first_continues: bool
    pre_ranks: tuple[int, ...]
    last_continues: bool
    send_M: bool
    first_seq_start: int
    conv1d_kernel_size: int | None = None
    fingerprint: int = 0
    last_continues_all: tuple[bool, ...] = ()
    send_M_all: tuple[bool, ...] = ()
    last_bytes_sent: int = field(default=0)
    last_bwd_bytes_sent: int = field(default=0)
    last_halo_bytes: int = field(default=0)

    # fla's FLACPContext metadata under fla's names and meaning (for code written against it). One difference:
    # fla's ``cu_seqlens`` are the rank's LOCAL boundaries — here ``local_cu_seqlens``; ``cu_seqlens`` is global.
    @property
    def pre_num_conv_tokens(self) -> int:
        """Tokens of this rank's first sequence held by earlier ranks (the conv halo needs min(this, kernel − 1))."""
        return self.start - self.first_seq_start

    @property
    def pre_num_ranks(self) -> int:
        """How many earlier ranks hold a piece of this rank's first sequence."""
        return self.rank - self.first_seq_start // (self.end - self.start)

    @property
    def is_first_rank(self) -> bool:
        """This rank's first sequence starts here (nothing flows in from earlier ranks)."""
        return self.pre_num_ranks == 0

    @property
    def post_num_ranks(self) -> int:
        """How many later ranks hold a piece of this rank's last sequence."""
        cs = self.cu_seqlens.tolist()
        last_end = cs[bisect.bisect_left(cs, self.end, 0, len(cs) - 1)]  # the end of the sequence holding token end−1
        return (last_end - 1) // (self.end - self.start) - self.rank

    @property
    def is_last_rank(self) -> bool:
        """This rank's last sequence ends here (nothing flows on to later ranks)."""
        return self.post_num_ranks == 0

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice ``[start, end)`` of a global ``[1, T_total, ...]`` tensor along ``dim``."""
        return x.narrow(dim, self.start, self.end - self.start)


def _fingerprint(cs: list[int]) -> int:
    """A 23-bit checksum of cu_seqlens (exact in fp32) to detect ranks built from different streams."""
    return zlib.crc32(repr(cs).encode()) & ((1 << 23) - 1)


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group: Any = None,
    conv1d_kernel_size: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_tf32x3_affine_chain: bool = True,
    layout: str = "contiguous",
) -> KDACPContext:
    """Context for ``chunk_kda(..., cp_context=ctx)`` and :func:`cp_conv_halo`.

    ``cu_seqlens [N+1]`` are the GLOBAL cumulative lengths of the packed stream (the same on every rank); its total
    must divide by the group size. ``group``: a process group (default: the world).

    fla's other arguments, for code written against it: ``cu_seqlens_cpu`` (the same lengths on the CPU: read
    instead of copying ``cu_seqlens`` off the device), ``use_tf32x3_affine_chain`` (must be True, as in fla; the fold
    here is fp32 on GPU and fp64 on CPU either way) and ``layout`` (only ``"contiguous"``: each rank holds one
    slice).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed must be initialised before build_cp_context")
    if layout != "contiguous":
        raise ValueError(f"layout: only 'contiguous' is supported (each rank holds one contiguous slice), "
                         f"got {layout!r}")
    if use_tf32x3_affine_chain is not True:
        raise ValueError("use_tf32x3_affine_chain must be True (fla's legacy precision flag; the fold's precision "
                         "is fixed)")
    if cu_seqlens_cpu is not None:  # fla's host copy of the same lengths: no device-to-host transfer
        if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu":
            raise ValueError("cu_seqlens_cpu must be a CPU tensor holding the same lengths as cu_seqlens")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.shape != cu_seqlens_cpu.shape:
            raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape, got {tuple(cu_seqlens_cpu.shape)}")
        cu_seqlens = cu_seqlens_cpu
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1] of global cumulative sequence lengths")
    cs = [int(c) for c in cu_seqlens.detach().cpu().tolist()]
    if cs[0] != 0 or any(b < a for a, b in zip(cs[:-1], cs[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cs}")
    W, r = dist.get_world_size(group), dist.get_rank(group)
    if r < 0:
        raise ValueError("group: this process is not a member of the given process group")
    T = cs[-1]
    if T == 0 or T % W:
        raise ValueError(f"cu_seqlens total length {T} must be a positive multiple of the group size {W} "
                         f"(each rank holds an equal contiguous slice)")
    if conv1d_kernel_size is not None and (not isinstance(conv1d_kernel_size, int) or conv1d_kernel_size < 1):
        raise ValueError(f"conv1d_kernel_size must be a positive int or None, got {conv1d_kernel_size!r}")
    L = T // W
    start, end = r * L, (r + 1) * L
    s = bisect.bisect_right(cs, start) - 1  # the sequence holding this rank's first token
    first_continues, last_continues, send_M = _slice_flags(cs, W, r)
    pre = tuple(range(cs[s] // L, r)) if first_continues else ()
    local = [0] + sorted({c - start for c in cs if start < c < end}) + [L]
    every = [_slice_flags(cs, W, j) for j in range(W)]
    return KDACPContext(
        cu_seqlens=torch.tensor(cs, dtype=torch.int64), group=group, world_size=W, rank=r, start=start, end=end,
        local_cu_seqlens=torch.tensor(local, dtype=torch.int64), first_continues=first_continues, pre_ranks=pre,
        last_continues=last_continues, send_M=send_M, first_seq_start=cs[s], conv1d_kernel_size=conv1d_kernel_size,
        fingerprint=_fingerprint(cs), last_continues_all=tuple(f[1] for f in every),
        send_M_all=tuple(f[2] for f in every))


def _slice_flags(cs: list[int], W: int, j: int) -> tuple[bool, bool, bool]:
    """Rank ``j``'s (first_continues, last_continues, send_M) for the global cumulative lengths ``cs``."""
    T = cs[-1]
    L = T // W
    start, end = j * L, (j + 1) * L
    s = bisect.bisect_right(cs, start) - 1
    first = cs[s] < start
    last = end < T and end not in cs
    inner = any(start < c < end for c in cs)
    return first, last, last and first and not inner


def _gather(x: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """``x`` → ``[W, *x.shape]`` (no autograd): one all_gather."""
    x = x.contiguous()
    if dist.get_backend(group) == "nccl":
        out = x.new_empty((world,) + tuple(x.shape))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


class _AllGather(torch.autograd.Function):
    """``x`` → ``[W, *x.shape]``; backward sums the incoming gradient over ranks and keeps this rank's row."""

    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, group: Any, world: int, rank: int) -> torch.Tensor:
        fctx.group, fctx.rank = group, rank
        return _gather(x, group, world)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        grad = grad.contiguous()
        if dist.get_backend(fctx.group) == "nccl":
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=fctx.group)
            return out, None, None, None
        dist.all_reduce(grad, group=fctx.group)  # gloo has no reduce_scatter
        return grad[fctx.rank], None, None, None


def _all_gather(x: torch.Tensor, ctx: KDACPContext) -> torch.Tensor:
    return _AllGather.apply(x, ctx.group, ctx.world_size, ctx.rank)


def _same(cu: torch.Tensor, ref: torch.Tensor) -> bool:
    return cu.numel() == ref.numel() and torch.equal(cu.detach().cpu().long().flatten(), ref)


def _local_problem(ctx: KDACPContext, q: torch.Tensor, cu_seqlens: torch.Tensor | None,
                   initial_state: torch.Tensor | None, output_final_state: bool) -> str | None:
    """Rank-local input errors, reported through the header so that every rank raises together."""
    if initial_state is not None or output_final_state:
        return _NO_STATES
    if q.shape[0] != 1:
        return f"q: context parallel needs the packed varlen layout B == 1, got B={q.shape[0]}"
    if q.shape[1] != ctx.end - ctx.start:
        return (f"q has {q.shape[1]} local tokens but the cp_context slice of rank {ctx.rank} holds "
                f"{ctx.end - ctx.start} (cu_seqlens total {int(ctx.cu_seqlens[-1])} / group size {ctx.world_size})")
    if cu_seqlens is not None and not any(_same(cu_seqlens, c) for c in (ctx.cu_seqlens, ctx.local_cu_seqlens)):
        return ("cu_seqlens differs from the global cu_seqlens the cp_context was built for (and from this "
                "rank's local ones, as fla's context holds them)")
    if dist.get_world_size(ctx.group) != ctx.world_size:
        return f"group has {dist.get_world_size(ctx.group)} ranks but the cp_context was built for {ctx.world_size}"
    return None


def _check_headers(gathered: torch.Tensor, ctx: KDACPContext, problem: str | None) -> None:
    """Raise the same ``ValueError`` on every rank when any rank reported a problem or the ranks disagree."""
    hdr = gathered[:, -_HEADER:].detach().double().cpu()
    if problem is not None:
        raise ValueError(f"cp_context: {problem}")
    bad = [j for j in range(ctx.world_size) if hdr[j, 3] not in (_OK, _OK_GRAD)]
    if bad:
        raise ValueError(f"cp_context: rank(s) {bad} reported bad input (their own error names it: slice length, "
                         f"cu_seqlens, group, or an argument of chunk_kda)")
    grad = [j for j in range(ctx.world_size) if hdr[j, 3] == _OK_GRAD]
    if grad and len(grad) < ctx.world_size:
        raise ValueError(f"cp_context: inputs need grad on rank(s) {grad} but not on the others: with context "
                         f"parallel every rank must run the backward (its collectives pair up across ranks)")
    if not bool((hdr[:, 0] == hdr[0, 0]).all()):
        raise ValueError(f"cp_context: mismatched slice lengths across ranks: {hdr[:, 0].long().tolist()}")
    if not bool((hdr[:, 1] == ctx.world_size).all()):
        raise ValueError(f"cp_context: wrong process group size: ranks report {hdr[:, 1].long().tolist()}")
    if not bool((hdr[:, 2] == hdr[0, 2]).all()):
        raise ValueError("cp_context: the ranks' contexts were built for different cu_seqlens")


def cp_chunk_kda(
    backend: str,
    ctx: KDACPContext,
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
) -> tuple[torch.Tensor, None]:
    """``chunk_kda`` on this rank's slice ``[1, T/W, H, *]`` of the global stream; returns ``(o_local, None)``."""
    from k3.ops.kda.chunk import backend_fn  # noqa: PLC0415
    from k3.ops.kda.prefix import span_summaries  # noqa: PLC0415

    if not isinstance(ctx, KDACPContext):
        raise ValueError(f"cp_context must come from k3.ops.kda.build_cp_context, got {type(ctx).__name__}")
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound)
    need_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, g, beta, A_log, dt_bias))
    problem = _local_problem(ctx, q, cu_seqlens, initial_state, output_final_state)
    dev = q.device
    if backend == "triton" and need_grad and problem is None:
        if not use_gate_in_kernel:
            A_log = dt_bias = None
        o = _CPChunkTriton.apply(q, k, v, g, beta, A_log, dt_bias, ctx, float(scale), flags, lower_bound)
        return o, None
    local_cu = ctx.local_cu_seqlens.to(dev)
    # Without gradients, a rank whose first piece starts fresh runs its forward first: the final state of its last
    # piece IS that piece's S_ext (no summary pass, no second prep).
    early = problem is None and not need_grad and not ctx.first_continues
    if early:
        o, ht = backend_fn(backend, "chunk_kda")(q, k, v, g, beta, scale, None, True, *flags[:3], lower_bound,
                                                 local_cu, A_log, dt_bias)

    # 1. Summary of the last local piece, only where a later rank will read it.
    M = torch.zeros(H, K, K, dtype=acc, device=dev)
    E = torch.zeros(H, K, V, dtype=acc, device=dev)
    if early:
        E = ht[-1].to(acc)
    elif problem is None and ctx.last_continues:
        a = int(ctx.local_cu_seqlens[-2])
        piece = [x[:, a:] for x in (q, k, v, g, beta)]
        Ms, Es = span_summaries(backend, *piece, scale, *flags[:3], lower_bound, None, A_log, dt_bias,
                                need_M=ctx.send_M, need_grad=need_grad)
        E = Es[0].to(acc)
        if ctx.send_M:
            M = Ms[0].to(acc)
    header = _header(ctx, q.shape[1], _BAD if problem else (_OK_GRAD if need_grad else _OK), dev, acc)
    packed = torch.cat([torch.cat([E, M], -1).flatten(), header])  # [H·K·(V+K) + 4]
    if need_grad:
        # Every rank must run the gather's backward collective, whatever inputs autograd.grad() is asked for:
        # give the packed summary a (zero-valued) path to every input that requires grad, on every rank.
        deps = [x.reshape(-1)[:1].sum() for x in (q, k, v, g, beta, A_log, dt_bias)
                if isinstance(x, torch.Tensor) and x.requires_grad]
        packed = packed + 0.0 * torch.stack(deps).sum().to(acc)
    gathered = _all_gather(packed, ctx)
    ctx.last_bytes_sent = packed.numel() * packed.element_size()
    _check_headers(gathered, ctx, problem)
    if early:
        return o, None

    # 2. Fold the earlier ranks' summaries into the exact entry state of the first local piece.
    body = gathered[:, :-_HEADER].reshape(ctx.world_size, H, K, V + K)
    S = torch.zeros(H, K, V, dtype=acc, device=dev)
    for j in ctx.pre_ranks:
        S = body[j, :, :, V:] @ S + body[j, :, :, :V]
    if need_grad and not ctx.pre_ranks:
        S = S + 0.0 * gathered.sum()  # zero-valued, but puts the gather in this rank's graph (see above)
    n_local = ctx.local_cu_seqlens.numel() - 1
    h0 = torch.cat([S[None], S.new_zeros(n_local - 1, H, K, V)], 0)
    if acc == torch.float64 and q.dtype != torch.float64:
        h0 = h0.float()

    # 3. The local forward from the exact entry states.
    o, _ = backend_fn(backend, "chunk_kda")(q, k, v, g, beta, scale, h0, False, *flags[:3], lower_bound, local_cu,
                                            A_log, dt_bias)
    return o, None


def _header(ctx: KDACPContext, n_local: int, status: float, dev: torch.device,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([float(n_local), float(ctx.world_size), float(ctx.fingerprint), status], dtype=dtype,
                        device=dev)


@contextlib.contextmanager
def cp_reported(ctx: Any, q: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None = None,
                output_final_state: bool = False) -> Iterator[None]:
    """A ``ValueError`` raised inside (``chunk_kda``'s argument checks) is first sent to the other ranks: this rank
    joins the forward's all_gather with a bad-input header, so they raise too instead of waiting in it. Needs a
    ``KDACPContext`` and q, v shaped ``[B, T, H, K]`` / ``[B, T, H, V]`` (the gathered size); otherwise it can only
    raise here. ``initial_state`` / ``output_final_state`` are refused first (before the argument checks, whose
    message about the state's shape would mislead: no state is accepted)."""
    try:
        if initial_state is not None or output_final_state:
            raise ValueError(_NO_STATES)
        yield
    except ValueError:
        if isinstance(ctx, KDACPContext) and q.dim() == 4 and v.dim() == 4:
            H, K, V = q.shape[2], q.shape[3], v.shape[3]
            dt = torch.float64 if q.dtype == torch.float64 else torch.float32
            body = torch.zeros(H * K * (V + K), dtype=dt, device=q.device)
            _gather(torch.cat([body, _header(ctx, q.shape[1], _BAD, q.device, dt)]), ctx.group, ctx.world_size)
        raise


def _span_from_buffers(bufs: dict, tab: Any, H: int, K: int, V: int, need_M: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    from k3.ops.kda.triton.span import span_from_buffers  # noqa: PLC0415

    return span_from_buffers(bufs, tab, H, K, V, need_M)


class CPConfig:
    """Knobs of the Triton context-parallel training step (class attributes, so a benchmark can switch them)."""

    # A rank whose slice is one piece of a sequence that crosses ranks cuts it into two chunk-aligned halves A, B for
    # its serial passes (see ``_CPChunkTriton``). At H = 32 a state pass fills 64 of an H200's 132 SMs, so the
    # two halves run side by side, and what the other rank waits for comes from the span pass (no outputs) rather
    # than a whole state pass. H200, 256K tokens per rank (bench/x2_cp_parts.py): forward state pass 9.78 ms whole
    # vs 5.50 as two halves, reverse 7.17 vs 4.69, span pass over a half (V + K columns) 2.07.
    halves = True
    halves_min_chunks = 64  # shorter slices keep one piece: the extra launches would cost more than they hide
    span_bv = 64  # span pass launch: 64 columns (sweep above: 2.07 ms vs 2.39 at 32), 3 stages
    span_warps = 4
    span_stages = 3


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
    from k3.ops.kda.triton.common import BT, ChunkTable  # noqa: PLC0415

    if not CPConfig.halves or ctx.local_cu_seqlens.numel() != 2 or tab.NC < max(2, CPConfig.halves_min_chunks):
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
    from k3.ops.kda.triton.span import span_rows  # noqa: PLC0415

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


def _fold_right(ctx: KDACPContext, J_all: torch.Tensor, M_all: torch.Tensor) -> torch.Tensor:
    """The gradient on this rank's last final state: later ranks' entry-state gradients folded from the right,
    ``dS_out(r) = J(r+1) + M(r+1)ᵀ dS_out(r+1)`` (the M term only where rank r+1's one piece runs through)."""
    dS = torch.zeros_like(J_all[0])
    for j in range(ctx.world_size - 1, ctx.rank, -1):  # dS = gradient on rank j's last final state
        d_in = J_all[j] + (M_all[j].transpose(-1, -2) @ dS if ctx.send_M_all[j] else 0.0)
        dS = d_in if ctx.last_continues_all[j - 1] else torch.zeros_like(dS)
    return dS


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

    A one-piece slice long enough (``CPConfig.halves``) runs each of those serial passes as two chunk-aligned halves
    side by side, its summary from the span pass (``_span_halves``) and its reverse passes by
    ``_halves_state_grads``: what the other ranks wait for is a span pass or two half passes, not a whole pass.
    """

    @staticmethod
    def forward(fctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, ctx: KDACPContext, scale: float,
                flags: tuple, lower_bound: float | None) -> torch.Tensor:
        from k3.ops.kda.triton.common import make_chunk_table  # noqa: PLC0415
        from k3.ops.kda.triton.chunk import _flags  # noqa: PLC0415
        from k3.ops.kda.triton.common import alloc_output_state  # noqa: PLC0415
        from k3.ops.kda.triton.training import prep_all, state_all  # noqa: PLC0415

        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        L, H, K, V, dev = q.shape[1], q.shape[2], q.shape[3], v.shape[3], q.device
        kflags = _flags(*flags[:3], lower_bound)
        tab = make_chunk_table(1, L, ctx.local_cu_seqlens, dev)  # the CPU copy: no device round trip
        bufs = prep_all(q, k, v, g, beta, A_log, dt_bias, scale, tab, lower_bound, kflags)
        o, ht = alloc_output_state(q, v, None, tab)  # ht: zero entries, the first piece's filled after the fold
        M = torch.zeros(H, K, K, dtype=torch.float32, device=dev)
        E = torch.zeros(H, K, V, dtype=torch.float32, device=dev)
        saved = None
        hv = _halves_plan(ctx, tab)
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
            Ms, Es = _span_from_buffers(bufs, tab, H, K, V, need_M=ctx.send_M)
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
        from k3.ops.kda.triton.bwd_state import bwd_state_pass  # noqa: PLC0415
        from k3.ops.kda.triton.training import kda_bwd  # noqa: PLC0415

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
    from k3.ops.kda.triton.bwd_state import bwd_state_pass  # noqa: PLC0415

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


def cp_conv_halo(x_local: torch.Tensor, ctx: KDACPContext, kernel_size: int | None = None) -> torch.Tensor:
    """The ``kernel_size − 1`` tokens preceding this rank's slice, for an exact causal short convolution.

    ``x_local [1, T/W, *]`` → halo ``[1, kernel_size − 1, *]``: the previous ranks' last tokens, zero where they
    belong to another sequence than this rank's first token (or precede the stream). Prepend it to ``x_local`` and
    convolve without left padding for the first local piece. Autograd-capable (the halo's gradient goes back to its
    owner). Bytes sent per call: ``(kernel_size − 1)·prod(*)·itemsize`` (``ctx.last_halo_bytes``).
    """
    if not isinstance(ctx, KDACPContext):
        raise ValueError(f"ctx must come from k3.ops.kda.build_cp_context, got {type(ctx).__name__}")
    ks = ctx.conv1d_kernel_size if kernel_size is None else kernel_size
    if not isinstance(ks, int) or ks < 1:
        raise ValueError(f"kernel_size must be a positive int (or set conv1d_kernel_size in the context), got {ks!r}")
    if ctx.conv1d_kernel_size is not None and ks != ctx.conv1d_kernel_size:
        raise ValueError(f"kernel_size {ks} differs from the context's conv1d_kernel_size {ctx.conv1d_kernel_size}")
    L = ctx.end - ctx.start
    if x_local.dim() < 2 or x_local.shape[0] != 1 or x_local.shape[1] != L:
        raise ValueError(f"x_local must be [1, {L}, ...] (this rank's slice), got {tuple(x_local.shape)}")
    n = ks - 1
    rest = tuple(x_local.shape[2:])
    if n == 0:
        return x_local[:, :0]
    tail = x_local[0, -n:]
    if tail.shape[0] < n:  # slices shorter than the halo: left-pad (those rows are taken from earlier ranks)
        tail = torch.cat([tail.new_zeros((n - tail.shape[0],) + rest), tail], 0)
    gathered = _all_gather(tail, ctx).reshape((ctx.world_size * n,) + rest)
    ctx.last_halo_bytes = tail.numel() * tail.element_size()
    ext = torch.cat([gathered, gathered.new_zeros((1,) + rest)], 0)
    idx = []
    for p in range(ctx.start - n, ctx.start):
        if p < 0 or p < ctx.first_seq_start:
            idx.append(ctx.world_size * n)  # the zero row
        else:
            j = p // L
            idx.append(j * n + n - ((j + 1) * L - p))
    return ext[torch.tensor(idx, device=x_local.device)][None]
