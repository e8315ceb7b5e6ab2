"""Expert parallel for the Latent MoE: exact volume, targeted transfers, exactly S·k rows of expert FFN per rank
(``docs/parallelism.md``).

Letters: R ranks in the EP group, E experts, M = E/R home experts per rank (rank r owns experts [rM, (r+1)M),
whole), S tokens per rank (the same on every rank), k top-k, C = S·k token-expert rows per rank, ℓ latent width,
H = ``n_hot`` hot experts per rank (the reserve: experts whose rows may be computed on another rank).

Training / prefill (``tokens="sharded"``: every rank holds different tokens), per MoE layer:

1. Loads. Each rank counts its rows per expert; one ``all_gather`` of ``[E + 1]`` ints (the counts and S) gives
   ``counts [R, E]`` to everybody, so every rank builds the same plan redundantly, on the device.
2. Plan (``plan_rows``: cumsums and a top-k, no host work). Rank h's home load L_h = Σ its experts' loads. It keeps
   min(L_h, C) rows; the excess X_h = max(L_h − C, 0) is spilled from its H hottest experts, heaviest first. Spilled
   rows are laid end to end on a "spill line" (rank-major, hottest first); every rank with a deficit
   D_r = max(C − L_r, 0) takes the next D_r rows of that line. Σ X = Σ D because Σ L = R·C, so every rank computes
   exactly C rows. ``n_hot ≥ ⌈M(R−1)/R⌉`` (the default) makes every routing feasible (the H heaviest of M experts
   hold ≥ H/M of the load and X_h ≤ L_h(R−1)/R); an infeasible plan (smaller ``n_hot``, extreme skew) drops its
   overflow rows (their output is zero), flags ``EPStats.ok`` and ``check()`` raises.
3. Row addresses (``row_targets``). A row of expert e gets an ordinal g in e's global row list (sources in the order
   home(e), home(e)+1, …, so the home rank's own rows come first); g < keep_e → the home rank, else spill-line
   position → the receiver. Each rank also derives, from the same plan, how many rows every source sends it
   (``recv_splits``) and which replicas it needs (``EPPlan.overlap``): no second exchange.
4. One host sync: the split sizes (4R + 2 small ints) are copied to the host, because ``all_to_all_single`` takes
   its splits as host lists (NCCL's send/recv counts). Buffers are static (exactly C rows in, C rows out), the
   backward reuses the forward's splits, so this is the only sync of the layer, forward and backward.
5. Replica weights: each donor sends the weights of exactly the spilled experts to exactly the ranks that compute
   their rows (one variable all-to-all of the packed ``w1 ‖ w3 ‖ w2`` rows; MXFP4 experts move as their packed
   bytes and scales). Its adjoint returns every copy's gradient to the home rank, where it is added to the
   expert's own.
6. Dispatch and combine: variable all-to-all of exactly the routed rows (+ one int64 buffer position per row),
   the home experts over the first Σkeep rows and the received replicas over the rest (C rows in all), and the
   outputs back the same way with the splits swapped.

Bytes per rank per forward (``EPStats.bytes``): rows C·ℓ·b each way (the ideal: each routed row there and back),
positions 8·C, counts 8·(E+1)·(R−1) received, and the replica weights of the spilled experts only. The backward
moves the same rows and replica weights once more (their gradients).

Decode / serving (``tokens="replicated"``: every rank holds the same tokens, as ``torchrun … k3 generate``):
each rank runs its home experts on the rows routed to them and the partial Σ p_j E_j(z) are summed by one fp32
``all_reduce`` of ``[S, ℓ]`` before the latent RMSNorm. No rows move, no weights move, no host sync. (With
gradients, the backward sums the partial gradients of z and p over the group: Megatron's tensor-parallel pair.)

Order of backward collectives: the replica-weight all-to-all is issued before the row dispatch in the forward, so
autograd (which runs ready nodes latest-created first) runs the row collectives first on every rank; every
collective's output is kept in the graph (a zero-valued term where a rank receives nothing), so every rank runs
every backward collective, in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from k3.distributed.comm import all_reduce_sum, all_to_all_v, gather_tensor, reduce_grad
from k3.layers.experts_mxfp4 import MXFP4GroupedExperts, mxfp4_ffn
from k3.layers.moe import LatentMoE
from k3.ops.moe.combine import combine_norm_rows
from k3.ops.moe.grouped import expert_counts, grouped_ffn, sort_by_expert

__all__ = ["EPPlan", "EPStats", "plan_rows", "source_prefix", "row_targets", "recv_splits", "ep_expert_rows",
           "ExpertParallelMoE", "apply_expert_parallel", "default_n_hot", "TOKENS"]

TOKENS = ("sharded", "replicated")


# ---------------------------------------------------------------------------------------------------- plan
@dataclass
class EPPlan:
    """The balanced plan of one layer (identical on every rank). Shapes: [E], [R], [R, H] or [R·H] (slots)."""

    capacity: int  # C
    load: torch.Tensor  # [E] rows per expert over all ranks
    keep: torch.Tensor  # [E] rows kept on the expert's home rank
    placed: torch.Tensor  # [E] of those, rows inside the home buffer (= keep unless the plan is infeasible)
    home_off: torch.Tensor  # [E] start of the expert's group in its home rank's buffer
    n_home: torch.Tensor  # [R] home rows of each rank (the replica rows follow them in its buffer)
    hot: torch.Tensor  # [R, H] global ids of each rank's hottest experts, heaviest first (the reserve)
    slot_of: torch.Tensor  # [E] slot (h·H + i) of a hot expert, −1 otherwise
    spill: torch.Tensor  # [R·H] rows each slot spills
    slot_start: torch.Tensor  # [R·H] start of each slot on the spill line
    recv_start: torch.Tensor  # [R] start of each rank's stretch of the spill line
    recv_end: torch.Tensor  # [R]
    overlap: torch.Tensor  # [R, R·H] rows of slot j computed on rank r
    ok: torch.Tensor  # 0-d bool: every donor's excess fits in its hot experts


def default_n_hot(n_experts: int, world: int) -> int:
    """⌈M(R−1)/R⌉: the smallest reserve per rank that makes every routing feasible."""
    m = n_experts // world
    return math.ceil(m * (world - 1) / world)


def plan_rows(counts: torch.Tensor, capacity: int, n_hot: int) -> EPPlan:
    """``counts [R, E]`` int64 (rows of each expert on each source rank) → the plan for capacity C rows per rank."""
    R, E = counts.shape
    M = E // R
    dev = counts.device
    load = counts.sum(0)
    home_load = load.view(R, M).sum(1)
    excess = (home_load - capacity).clamp(min=0)
    deficit = (capacity - home_load).clamp(min=0)
    # unique integer keys make the hottest-first order deterministic (ties → lower expert id) on every rank
    key = load.view(R, M) * M + (M - 1 - torch.arange(M, device=dev))
    hot = key.topk(n_hot, dim=1).indices + torch.arange(R, device=dev)[:, None] * M  # [R, H]
    hot_load = load[hot]
    before = hot_load.cumsum(1) - hot_load
    spill = torch.minimum((excess[:, None] - before).clamp(min=0), hot_load).reshape(-1)
    keep = load.clone().scatter_add_(0, hot.reshape(-1), -spill)
    keep_rm = keep.view(R, M)
    home_off = keep_rm.cumsum(1) - keep_rm
    placed = torch.minimum(keep_rm, capacity - home_off).clamp(min=0)  # an infeasible plan drops the rest
    slot_of = torch.full((E,), -1, dtype=torch.int64, device=dev)
    slot_of[hot.reshape(-1)] = torch.arange(R * n_hot, device=dev)
    slot_start = spill.cumsum(0) - spill
    recv_end = deficit.cumsum(0)
    recv_start = recv_end - deficit
    lo = torch.maximum(slot_start[None, :], recv_start[:, None])
    hi = torch.minimum((slot_start + spill)[None, :], recv_end[:, None])
    return EPPlan(
        capacity=capacity, load=load, keep=keep, placed=placed.reshape(-1), home_off=home_off.reshape(-1),
        n_home=placed.sum(1), hot=hot, slot_of=slot_of, spill=spill, slot_start=slot_start, recv_start=recv_start,
        recv_end=recv_end, overlap=(hi - lo).clamp(min=0), ok=(hot_load.sum(1) >= excess).all())


def source_prefix(counts: torch.Tensor) -> torch.Tensor:
    """``[R, E]``: ordinal of source s's first row of expert e in e's row list (sources taken in the order
    home(e), home(e)+1, …, so the home rank's own rows come first and stay home)."""
    R, E = counts.shape
    dev = counts.device
    home = torch.arange(E, device=dev) // (E // R)
    rot = counts.gather(0, (torch.arange(R, device=dev)[:, None] + home[None, :]) % R)  # row i = source home+i
    before = rot.cumsum(0) - rot
    return before.gather(0, (torch.arange(R, device=dev)[:, None] - home[None, :]) % R)


def row_targets(plan: EPPlan, prefix: torch.Tensor, rank: int, idx: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each local row (token t, slot j) = ``idx.view(-1)[t·k + j]`` is computed: ``dest [C]`` (a rank; R for
    a row an infeasible plan drops) and ``pos [C]``, its row in that rank's C-row buffer [home rows | replica rows].
    """
    R, E = prefix.shape
    M = E // R
    dev = idx.device
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    loc = expert_counts(flat, E)
    ordinal = torch.empty_like(flat)
    ordinal[order] = torch.arange(flat.shape[0], device=dev) - (loc.cumsum(0) - loc)[flat[order]]
    g = prefix[rank][flat] + ordinal
    keep = plan.keep[flat]
    at_home = g < keep
    slot = plan.slot_of[flat]
    starts = torch.cat([plan.slot_start, plan.slot_start.new_zeros(1)])  # + a pad entry: valid even when H = 0
    q = starts[torch.where(slot >= 0, slot, starts.shape[0] - 1)] + (g - keep)
    recv = torch.searchsorted(plan.recv_end, q, right=True).clamp(max=R - 1)
    placed = (slot >= 0) & (q < plan.recv_end[-1])
    placed = torch.where(at_home, g < plan.placed[flat], placed)
    dest = torch.where(placed, torch.where(at_home, flat // M, recv), torch.full_like(recv, R))
    pos = torch.where(at_home, plan.home_off[flat] + g, plan.n_home[recv] + q - plan.recv_start[recv])
    return dest, torch.where(dest < R, pos, torch.zeros_like(pos))


def recv_splits(plan: EPPlan, counts: torch.Tensor, prefix: torch.Tensor, rank: int) -> torch.Tensor:
    """``[R]`` rows each source sends to ``rank`` (what ``row_targets`` on every source gives, from the plan alone)."""
    R, E = counts.shape
    M = E // R
    mine = slice(rank * M, (rank + 1) * M)
    home = (plan.placed[mine][None, :] - prefix[:, mine]).clamp(min=0).minimum(counts[:, mine]).sum(1)
    if plan.spill.numel() == 0:
        return home
    e = plan.hot.reshape(-1)  # [R·H] expert of each slot
    keep = plan.keep[e]
    a = torch.maximum(prefix[:, e], keep)  # a source's spilled rows of slot j: ordinals [a, b)
    b = prefix[:, e] + counts[:, e]
    lo = torch.maximum(plan.slot_start + a - keep, plan.recv_start[rank])
    hi = torch.minimum(plan.slot_start + b - keep, plan.recv_end[rank])
    return home + (hi - lo).clamp(min=0).sum(1)


# ---------------------------------------------------------------------------------------------- expert weights
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _ExpertTensors:
    """This rank's home expert tensors (dense ``w1, w3, w2`` or MXFP4 packed/scale pairs), packed per expert into
    one row for the replica transfer, and the FFN over either the home set or received replicas."""

    def __init__(self, experts: nn.Module) -> None:
        self.mxfp4 = isinstance(experts, MXFP4GroupedExperts)
        names = [f"{w}_{p}" for w in ("w1", "w3", "w2") for p in ("packed", "scale")] if self.mxfp4 \
            else ["w1", "w3", "w2"]
        self.parts = [_local(getattr(experts, n)) for n in names]
        self.beta1, self.beta2 = experts.beta1, experts.beta2

    def row_bytes(self) -> int:
        return sum(p[0].numel() * p.element_size() for p in self.parts)

    def pack(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n, Σ per-expert numel]``: the experts ``ids`` (local indices), all tensors side by side."""
        return torch.cat([p.index_select(0, ids).flatten(1) for p in self.parts], 1)

    def unpack(self, rows: torch.Tensor) -> list[torch.Tensor]:
        sizes = [p[0].numel() for p in self.parts]  # contiguous copies: the grouped GEMMs take dense stacks
        return [c.reshape(rows.shape[0], *p.shape[1:]).contiguous() for c, p in zip(rows.split(sizes, 1), self.parts)]

    def ffn(self, x: torch.Tensor, offs: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        w = self.parts if parts is None else parts
        if self.mxfp4:
            return mxfp4_ffn(x, offs, (w[0], w[1]), (w[2], w[3]), (w[4], w[5]), self.beta1, self.beta2)
        return grouped_ffn(x, offs, w[0], w[1], w[2], self.beta1, self.beta2)


# ---------------------------------------------------------------------------------------------- forward
@dataclass
class EPStats:
    """The last EP forward of one layer. Host ints (known after the forward's one sync) and the device load."""

    rows: int  # rows of expert FFN this rank computed (home + replicas): C for a feasible plan
    replicas: int  # replica experts this rank received and computed
    load: torch.Tensor  # [E] global rows per expert
    ok: bool  # plan feasible (no row dropped)
    bytes: dict[str, int] = field(default_factory=dict)  # bytes this rank sent in the forward, by what they carry
    ideal_bytes: int = 0  # C rows there and back: 2·C·ℓ·itemsize


def _stable_first(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the ``n`` True entries of a 1-D ``mask`` in order, without a host sync (``n`` known)."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:n]


def ep_expert_rows(z: torch.Tensor, idx: torch.Tensor, experts: _ExpertTensors, n_experts: int, group: Any,
                   n_hot: int) -> tuple[torch.Tensor, EPStats]:
    """Unweighted expert outputs ``[S·k, ℓ]`` of every local (token, slot), computed expert-parallel (module
    docstring). ``z [S, ℓ]`` latent tokens, ``idx [S, k]`` global expert ids. Autograd flows to z and to the home
    expert tensors (replica gradients included)."""
    R, me = dist.get_world_size(group), dist.get_rank(group)
    S, k = idx.shape
    E, L, C, H = n_experts, z.shape[1], idx.numel(), n_hot
    M = E // R
    dev = z.device
    head = torch.cat([expert_counts(idx, E), torch.full((1,), S, dtype=torch.int64, device=dev)])
    gathered = gather_tensor(head, group)  # [R, E + 1]
    counts = gathered[:, :E]
    plan = plan_rows(counts, C, H)
    prefix = source_prefix(counts)
    dest, pos = row_targets(plan, prefix, me, idx)
    in_splits = torch.zeros(R + 1, dtype=torch.int64, device=dev).index_add_(0, dest, torch.ones_like(dest))[:R]
    out_splits = recv_splits(plan, counts, prefix, me)
    give = plan.overlap[:, me * H:(me + 1) * H] > 0  # [R, H] my hot experts each rank computes rows of
    take = plan.overlap[me] > 0  # [R·H] slots whose rows I compute
    host = torch.cat([in_splits, out_splits, give.sum(1), take.view(R, H).sum(1), plan.n_home[me:me + 1],
                      plan.ok.long()[None], gathered[:, E]]).tolist()  # the layer's one device→host sync
    ins, outs, w_ins, w_outs = (host[i * R:(i + 1) * R] for i in range(4))
    n_home, ok, sizes = host[4 * R], bool(host[4 * R + 1]), host[4 * R + 2:]
    if any(s != S for s in sizes):
        raise ValueError(f"expert parallel needs the same number of tokens on every rank of the EP group; "
                         f"ranks hold {sizes}")
    n_send, n_recv, n_rep = sum(ins), sum(outs), sum(w_outs)

    # replica weights first: the lowest autograd sequence number of the layer's collectives (module docstring)
    w_send = experts.pack(plan.hot[me][_stable_first(give.reshape(-1), sum(w_ins)) % max(H, 1)] - me * M)
    w_recv = all_to_all_v(w_send, w_ins, w_outs, group)

    order = torch.argsort(dest, stable=True)[:n_send]  # rows grouped by destination rank
    recv_x = all_to_all_v(z.index_select(0, order // k), ins, outs, group)
    recv_pos = all_to_all_v(pos.index_select(0, order), ins, outs, group)
    inv = torch.full((C,), n_recv, dtype=torch.int64, device=dev).index_copy_(
        0, recv_pos, torch.arange(n_recv, device=dev))
    buf = torch.cat([recv_x, recv_x.new_zeros(1, L)]).index_select(0, inv)  # [C, ℓ], empty places read zeros

    y_home = experts.ffn(buf[:n_home], plan.placed[me * M:(me + 1) * M].cumsum(0).to(torch.int32))
    rep_rows = buf[n_home:]
    if n_rep:
        sel = _stable_first(take, n_rep)
        y_rep = experts.ffn(rep_rows, plan.overlap[me][sel].cumsum(0).to(torch.int32), experts.unpack(w_recv))
    else:  # nothing received: keep the (empty) transfer in the graph so its backward collective runs here too
        y_rep = torch.zeros_like(rep_rows) + w_recv.sum().to(rep_rows.dtype) * 0
    y_buf = torch.cat([y_home, y_rep])
    back = all_to_all_v(y_buf.index_select(0, recv_pos), outs, ins, group)  # my rows, in send order
    inv_send = torch.full((C,), n_send, dtype=torch.int64, device=dev).index_copy_(
        0, order, torch.arange(n_send, device=dev))
    y = torch.cat([back, back.new_zeros(1, L)]).index_select(0, inv_send)

    b = z.element_size()
    stats = EPStats(rows=n_recv, replicas=n_rep, load=plan.load, ok=ok, ideal_bytes=2 * C * L * b, bytes={
        "rows": (n_send + n_recv) * L * b, "rows_remote": (n_send - ins[me] + n_recv - outs[me]) * L * b,
        "positions": n_send * 8, "counts": (E + 1) * 8 * (R - 1),
        "replica_weights": (sum(w_ins) - w_ins[me]) * experts.row_bytes()})
    return y, stats


def replicated_expert_sum(z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor, experts: _ExpertTensors,
                          n_experts: int, group: Any) -> torch.Tensor:
    """Σ_j p_j E_j(z) ``[S, ℓ]`` fp32 when every rank holds the same tokens: each rank runs its home experts' rows,
    one all-reduce sums the partial sums (the rounding of each expert output to z.dtype is the one-process one).
    Differentiable: the gradients of z and p, partial on each rank, are summed over the group in the backward."""
    R, me = dist.get_world_size(group), dist.get_rank(group)
    z, p = reduce_grad(z, group), reduce_grad(p, group)
    S, k = idx.shape
    M = n_experts // R
    local = idx - me * M
    mine = (local >= 0) & (local < M)
    order, token_of_row, offs = sort_by_expert(torch.where(mine, local, M), M + 1)
    rows = experts.ffn(z.index_select(0, token_of_row), offs[:M])
    y = torch.empty_like(rows).index_copy_(0, order, rows).view(S, k, -1)
    y = torch.where(mine[..., None], y, torch.zeros_like(y))  # rows of other ranks' experts are undefined here
    return all_reduce_sum((y.float() * p.unsqueeze(-1)).sum(1), group)


# ---------------------------------------------------------------------------------------------- layer wrapper
def _group_of(mesh_or_group: Any) -> tuple[Any, Any]:
    """``(process group, DeviceMesh or None)`` from a 1-D DeviceMesh or a process group (None = the world)."""
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"ep_mesh must be a 1-D DeviceMesh, got {mesh_or_group.ndim} dimensions")
        return mesh_or_group.get_group(), mesh_or_group
    return (mesh_or_group if mesh_or_group is not None else dist.group.WORLD), None


class ExpertParallelMoE:
    """Expert parallel for one ``k3.layers.moe.LatentMoE``, applied in place from outside.

    The routed experts become this rank's M = E/R (dense weights: ``nn.Parameter`` holding a ``DTensor`` sharded
    over dim 0 of the EP mesh, so state dicts stay global; MXFP4 buffers: plain local tensors). Everything else —
    router, W↓, the latent norm, W↑, shared experts — stays as it was. The layer's ``forward`` runs unchanged: its
    ``routed(z, idx, p, record)`` step is redirected here. Module names and state-dict keys do not change.
    """

    def __init__(self, moe: nn.Module, mesh_or_group: Any = None, n_hot: int | None = None,
                 tokens: str = "sharded") -> None:
        group, mesh = _group_of(mesh_or_group)
        R, rank = dist.get_world_size(group), dist.get_rank(group)
        E = moe.gate.n_experts
        if E % R:
            raise ValueError(f"--ep {R} must divide the model's n_experts ({E})")
        M = E // R
        n_hot = default_n_hot(E, R) if n_hot is None else n_hot
        if isinstance(n_hot, bool) or not isinstance(n_hot, int) or not 0 <= n_hot <= M:
            raise ValueError(f"n_hot must be an integer in [0, n_experts/ep = {M}], got {n_hot!r}")
        if getattr(moe, "expert_parallel", None) is not None:
            raise ValueError("this LatentMoE is already expert-parallel")
        self.moe, self.group, self.mesh, self.n_hot = moe, group, mesh, n_hot
        self.rank, self.world, self.n_experts = rank, R, E
        self.tokens = tokens
        self.last_stats: EPStats | None = None
        _shard_experts(moe.experts, E, M, rank, mesh)
        moe.expert_parallel = self
        moe.routed = self.routed  # LatentMoE.forward calls self.routed(z, idx, p, record)
        # The expert-parallel work runs as the experts module's forward, so that whatever wraps that module (FSDP2
        # unsharding its parameters, their gradient reduction) sees an ordinary call.
        moe.experts.forward = self._experts_forward

    @property
    def tokens(self) -> str:
        return self._tokens

    @tokens.setter
    def tokens(self, value: str) -> None:
        if value not in TOKENS:
            raise ValueError(f"tokens must be one of {TOKENS}, got {value!r}")
        self._tokens = value

    def routed(self, z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor, record: bool = False) -> torch.Tensor:
        """``z [m, ℓ]``, ``idx/p [m, k]`` → ``RMSNorm(Σ_j p_j E_j(z)) [m, ℓ]``, the experts spread over the group."""
        moe = self.moe
        if self.tokens == "replicated":
            return moe.routed_expert_norm(moe.experts(z, idx, p).to(z.dtype))
        y = moe.experts(z, idx, p)
        if record:
            moe.last_load.copy_(self.last_stats.load)
        rows = torch.arange(idx.numel(), device=z.device).view(idx.shape)
        return combine_norm_rows(y, rows, p, moe.routed_expert_norm.weight, moe.eps)

    def _experts_forward(self, z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The experts module's forward under expert parallel: the rows ``[m·k, ℓ]`` in (token, slot) order
        (sharded tokens) or Σ_j p_j E_j(z) ``[m, ℓ]`` fp32 (replicated tokens)."""
        experts = _ExpertTensors(self.moe.experts)
        if self.tokens == "replicated":
            return replicated_expert_sum(z, idx, p, experts, self.n_experts, self.group)
        y, self.last_stats = ep_expert_rows(z, idx, experts, self.n_experts, self.group, self.n_hot)
        return y

    def check(self) -> None:
        """Raise if the last forward's plan was infeasible (rows were dropped)."""
        if self.last_stats is not None and not self.last_stats.ok:
            raise RuntimeError(f"expert-parallel plan infeasible: n_hot={self.n_hot} hot experts per rank could not "
                               f"absorb a rank's excess rows; raise n_hot (>= "
                               f"{default_n_hot(self.n_experts, self.world)} always works)")


def _shard_experts(experts: nn.Module, E: int, M: int, rank: int, mesh: Any) -> None:
    """Keep experts [rank·M, (rank+1)·M) of a module holding all E (or exactly those M, as the expert-sharded
    release loader builds them)."""
    if isinstance(experts, MXFP4GroupedExperts):
        for name in [f"{w}_{p}" for w in ("w1", "w3", "w2") for p in ("packed", "scale")]:
            setattr(experts, name, _slice(getattr(experts, name), E, M, rank, f"experts.{name}"))
        experts.n_experts = M
        return
    for name in ("w1", "w3", "w2"):
        full = getattr(experts, name)
        local = _slice(full.detach(), E, M, rank, f"experts.{name}")
        if mesh is not None:
            local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(local, requires_grad=full.requires_grad))


def _slice(t: torch.Tensor, E: int, M: int, rank: int, what: str) -> torch.Tensor:
    if isinstance(t, DTensor):
        raise ValueError(f"{what} is already a DTensor: apply expert parallel once, before FSDP")
    if t.shape[0] == E:
        return t[rank * M:(rank + 1) * M].clone()
    if t.shape[0] == M:
        return t
    raise ValueError(f"{what} must hold all {E} experts or this rank's {M}, got {t.shape[0]}")


def apply_expert_parallel(model: nn.Module, ep_mesh: Any = None, n_hot: int | None = None,
                          tokens: str = "sharded") -> list[ExpertParallelMoE]:
    """Expert-parallelise every ``LatentMoE`` of ``model`` in place over ``ep_mesh`` (a 1-D DeviceMesh, or a
    process group; None = the world). ``tokens``: "sharded" (each rank its own tokens: training, prefill) or
    "replicated" (every rank the same tokens: ``k3 generate`` under torchrun); switch later with
    ``handle.tokens = …``. Returns the per-layer handles (``check()``, ``last_stats``)."""
    if tokens not in TOKENS:
        raise ValueError(f"tokens must be one of {TOKENS}, got {tokens!r}")
    return [ExpertParallelMoE(m, ep_mesh, n_hot, tokens) for m in model.modules() if isinstance(m, LatentMoE)]
