"""Context parallel KDA over a ``torch.distributed`` group; fla's API shape.

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

from k3.ops.kda.args import KDAArgs, get_backend
from k3.ops.kda.prefix import span_summaries

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
    # the Triton training step runs a one-piece slice of at least this many chunks as two halves side by side
    halves_min_chunks: int = 64
    last_halves: bool = field(default=False)  # whether the last Triton training step took them

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
    initial_state: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    args: KDAArgs,
) -> tuple[torch.Tensor, None]:
    """``chunk_kda`` on this rank's slice ``[1, T/W, H, *]`` of the global stream; returns ``(o_local, None)``.
    ``args.cu_seqlens``: None or the global ones (checked against the context)."""
    if not isinstance(ctx, KDACPContext):
        raise ValueError(f"cp_context must come from k3.ops.kda.build_cp_context, got {type(ctx).__name__}")
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    need_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, g, beta, A_log, dt_bias))
    problem = _local_problem(ctx, q, args.cu_seqlens, initial_state, args.output_final_state)
    dev = q.device
    be = get_backend(backend)
    if need_grad and problem is None and hasattr(be, "cp_chunk_kda_train"):
        return be.cp_chunk_kda_train(ctx, q, k, v, g, beta, A_log, dt_bias, args), None
    local_cu = ctx.local_cu_seqlens.to(dev)
    local = args._replace(cu_seqlens=local_cu, N=local_cu.numel() - 1, cu_seqlens_cpu=None)
    # Without gradients, a rank whose first piece starts fresh runs its forward first: the final state of its last
    # piece IS that piece's S_ext (no summary pass, no second prep).
    early = problem is None and not need_grad and not ctx.first_continues
    if early:
        o, ht = be.chunk_kda(q, k, v, g, beta, None, A_log, dt_bias, local._replace(output_final_state=True))

    # 1. Summary of the last local piece, only where a later rank will read it.
    M = torch.zeros(H, K, K, dtype=acc, device=dev)
    E = torch.zeros(H, K, V, dtype=acc, device=dev)
    if early:
        E = ht[-1].to(acc)
    elif problem is None and ctx.last_continues:
        a = int(ctx.local_cu_seqlens[-2])
        piece = [x[:, a:] for x in (q, k, v, g, beta)]
        Ms, Es = span_summaries(backend, *piece, A_log, dt_bias,
                                args._replace(cu_seqlens=None, N=1, cu_seqlens_cpu=None),
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
    o, _ = be.chunk_kda(q, k, v, g, beta, h0, A_log, dt_bias, local._replace(output_final_state=False))
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


def _fold_right(ctx: KDACPContext, J_all: torch.Tensor, M_all: torch.Tensor) -> torch.Tensor:
    """The gradient on this rank's last final state: later ranks' entry-state gradients folded from the right,
    ``dS_out(r) = J(r+1) + M(r+1)ᵀ dS_out(r+1)`` (the M term only where rank r+1's one piece runs through)."""
    dS = torch.zeros_like(J_all[0])
    for j in range(ctx.world_size - 1, ctx.rank, -1):  # dS = gradient on rank j's last final state
        d_in = J_all[j] + (M_all[j].transpose(-1, -2) @ dS if ctx.send_M_all[j] else 0.0)
        dS = d_in if ctx.last_continues_all[j - 1] else torch.zeros_like(dS)
    return dS



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
