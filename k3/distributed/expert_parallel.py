"""Expert parallel for the Latent MoE with an exact per-rank volume (docs/architecture.md#expert-parallel).

Letters: R ranks in the EP group, E experts, M = E/R home experts per rank (rank r owns experts [rM, (r+1)M),
whole — experts are never split), S tokens per rank (the same on every rank), k top-k, C = S·k token-expert rows
per rank, ℓ latent width, F expert width, H = ``n_hot`` hot experts per rank.

Every rank computes EXACTLY C rows per layer, whatever the routing skew, with static shapes and no host sync:

1. Loads. Each rank counts its rows per expert; one ``all_gather`` gives ``counts [R, E]`` to everybody, so every
   rank computes the same plan redundantly (no second round).
2. Plan (``plan_rows``, all on device, cumsums only). Rank h's home load is L_h = Σ its experts' loads. It keeps
   min(L_h, C) rows at home; the excess X_h = max(L_h − C, 0) is spilled from its H hottest experts, heaviest
   first (a full expert before a partial one, so few experts move). Spilled rows are laid end to end on a "spill
   line" (rank-major, hottest first); ranks with a deficit D_r = max(C − L_r, 0) take consecutive stretches of that
   line, of exactly D_r rows. ΣX = ΣD because Σ L = R·C, so every rank ends with exactly C rows.
   Feasible whenever each donor's excess fits in its H hottest experts; ``n_hot ≥ ⌈M(R−1)/R⌉`` guarantees that
   for ANY routing (the H heaviest of M experts hold ≥ H/M of the load, and X_h ≤ L_h(R−1)/R since L_h ≤ R·C).
   An infeasible plan (smaller ``n_hot`` under extreme skew) is flagged in ``EPStats.ok`` and its overflow rows are
   dropped, never silently mis-computed: ``ExpertParallelMoE.check()`` raises.
3. Row addresses. A row of expert e gets a global ordinal g in e's row list (sources taken in the order home(e),
   home(e)+1, … so home ranks keep their OWN rows first); g < keep_e → home rank, else spill-line position
   → receiver, found by ``searchsorted`` on the receivers' cumulative deficits.
4. Dispatch / combine. Two ``all_to_all`` of fixed-size slabs ``[R, C, ℓ]`` (a source can send at most C rows to
   one destination) carry the rows and their target positions; the combine sends outputs back the same way.
5. Compute. Each rank runs its home experts over a C-row buffer (groups = home experts, ``offs`` ends at
   Σ keep) and the replicas over a second C-row buffer (groups = the gathered hot experts, ``offs`` ends at D_r):
   exactly C rows of expert FFN in total. Replica weights: ONE ``all_gather`` of every rank's H hottest experts
   (static size R·H experts); in backward its adjoint, a ``reduce_scatter``, sums every copy's gradient back into
   the home rank's parameters.

Trade-offs, honestly: the slabs are padded to C rows per destination (R× the bytes of a variable-size all-to-all)
and the replica pool is gathered whole (R·H experts' weights per layer per forward, whether used or not). With
the guaranteeing default H = ⌈M(R−1)/R⌉ that is close to an all-gather of all experts — the price of static
shapes with stock collectives; MoonEP avoids it with device-initiated NVLink reads of only the used replicas.
Lower ``n_hot`` to trade the guarantee for traffic (QB-balanced routing spills little).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3.layers.moe import LatentMoE
from k3.ops.moe.combine import combine_norm_rows
from k3.ops.moe.grouped import expert_counts, grouped_ffn

__all__ = ["EPPlan", "EPStats", "plan_rows", "row_targets", "rank_groups", "ep_expert_rows", "ExpertParallelMoE",
           "parallelize_moe", "default_n_hot"]


# ---------------------------------------------------------------------------------------------------- plan
@dataclass
class EPPlan:
    """The balanced plan of one layer (identical on every rank). Shapes: [E], [R], [R, H] or [R·H] (slots)."""

    capacity: int  # C
    load: torch.Tensor  # [E] rows per expert over all ranks
    keep: torch.Tensor  # [E] rows computed on the expert's home rank
    home_off: torch.Tensor  # [E] start of the expert's group in its home buffer
    hot: torch.Tensor  # [R, H] global ids of each rank's hottest experts, heaviest first (the replica pool)
    slot_of: torch.Tensor  # [E] slot (h·H + i) of a hot expert, −1 otherwise
    spill: torch.Tensor  # [R·H] rows each slot spills
    slot_start: torch.Tensor  # [R·H] start of each slot on the spill line
    recv_start: torch.Tensor  # [R] start of each rank's stretch of the spill line
    recv_end: torch.Tensor  # [R]
    ok: torch.Tensor  # 0-d bool: every donor's excess fits in its hot experts


def default_n_hot(n_experts: int, world: int) -> int:
    """⌈M(R−1)/R⌉: the smallest replica pool per rank that makes every routing feasible."""
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
    slot_of = torch.full((E,), -1, dtype=torch.int64, device=dev)
    slot_of[hot.reshape(-1)] = torch.arange(R * n_hot, device=dev)
    recv_end = deficit.cumsum(0)
    return EPPlan(
        capacity=capacity, load=load, keep=keep, home_off=(keep_rm.cumsum(1) - keep_rm).reshape(-1), hot=hot,
        slot_of=slot_of, spill=spill, slot_start=spill.cumsum(0) - spill, recv_start=recv_end - deficit,
        recv_end=recv_end, ok=(hot_load.sum(1) >= excess).all())


def rank_groups(plan: EPPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ends on ``rank``: ``offs_home [M]`` over its home buffer and ``offs_rep [R·H]`` over its replica
    buffer (int32, cumulative). ``offs_home[-1] + offs_rep[-1] == C`` for a feasible plan."""
    R = plan.recv_start.shape[0]
    M = plan.keep.shape[0] // R
    offs_home = plan.keep[rank * M:(rank + 1) * M].cumsum(0)
    lo = torch.maximum(plan.slot_start, plan.recv_start[rank])
    hi = torch.minimum(plan.slot_start + plan.spill, plan.recv_end[rank])
    offs_rep = (hi - lo).clamp(min=0).cumsum(0)
    return offs_home.to(torch.int32), offs_rep.to(torch.int32)


def row_targets(plan: EPPlan, counts: torch.Tensor, rank: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each local row (token t, slot j) = ``idx.view(-1)[t·k + j]`` is computed: ``dest [C]`` (rank) and
    ``pos [C]`` in that rank's concatenated buffer ``[home C | replica C | dump]`` (``2C`` = dropped, only in an
    infeasible plan)."""
    R, E = counts.shape
    M = E // R
    C = plan.capacity
    dev = idx.device
    flat = idx.reshape(-1)
    n_rows = flat.shape[0]
    order = torch.argsort(flat, stable=True)
    loc = counts[rank]
    loc_start = loc.cumsum(0) - loc
    ordinal = torch.empty_like(flat)
    ordinal[order] = torch.arange(n_rows, device=dev) - loc_start[flat[order]]
    home = torch.arange(E, device=dev) // M
    # sources of expert e in the order home(e), home(e)+1, ...: the home rank's own rows come first
    src = (torch.arange(R, device=dev)[:, None] + home[None, :]) % R
    rot = counts.gather(0, src)
    before = rot.cumsum(0) - rot
    prefix = before.gather(0, ((rank - home) % R)[None, :])[0]
    g = prefix[flat] + ordinal
    keep = plan.keep[flat]
    at_home = g < keep
    home_pos = plan.home_off[flat] + g
    slot = plan.slot_of[flat]
    starts = torch.cat([plan.slot_start, plan.slot_start.new_zeros(1)])  # + a pad entry: valid even when H = 0
    q = starts[torch.where(slot >= 0, slot, starts.shape[0] - 1)] + (g - keep)
    recv = torch.searchsorted(plan.recv_end, q, right=True).clamp(max=R - 1)
    rep_pos = C + q - plan.recv_start[recv]
    dest = torch.where(at_home, home[flat], recv)
    pos = torch.where(at_home, home_pos, rep_pos)
    valid = torch.where(at_home, home_pos < C, (slot >= 0) & (rep_pos < 2 * C) & (q < plan.recv_end[-1]))
    return dest, torch.where(valid, pos, torch.full_like(pos, 2 * C))


# ---------------------------------------------------------------------------------------------- collectives
def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """``x [...]`` → ``[R, ...]`` (rank order)."""
    R = dist.get_world_size(group)
    x = x.contiguous()
    if _is_nccl(group):
        out = x.new_empty((R, *x.shape))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(R)]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """``x [R, ...]`` → Σ over ranks of ``x[my rank]``."""
    x = x.contiguous()
    if _is_nccl(group):
        out = x.new_empty(x.shape[1:])
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)
        return out
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)  # gloo has no reduce_scatter
    return x[dist.get_rank(group)].clone()


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0 (``[R, ...]``); it is its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


class _GatherReplicas(torch.autograd.Function):
    """All-gather of the hot experts' weights; backward sums every copy's gradient on its home rank."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(w, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.group), None


# ---------------------------------------------------------------------------------------------- forward
@dataclass
class EPStats:
    """Device tensors describing the last EP forward (read them outside any sync-free region)."""

    rows: torch.Tensor  # [] rows this rank computed (home + replica groups) — C for a feasible plan
    replicas: torch.Tensor  # [] replica experts this rank actually computed
    load: torch.Tensor  # [E] global rows per expert
    ok: torch.Tensor  # [] bool, plan feasible


def ep_expert_rows(
    z: torch.Tensor,
    idx: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    group,
    n_hot: int,
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> tuple[torch.Tensor, EPStats]:
    """Expert outputs of every local (token, slot), computed expert-parallel.

    ``z [S, ℓ]`` latent tokens, ``idx [S, k]`` global expert ids, ``w1, w3 [M, F, ℓ]`` and ``w2 [M, ℓ, F]`` this
    rank's home experts. Returns ``y [S·k, ℓ]`` in (token, slot) order — unweighted ``E_idx(z)`` — and stats.
    Autograd flows to z and to the home weights (replica gradients included).
    """
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    S, k = idx.shape
    M, L = w1.shape[0], z.shape[1]
    E, C = M * R, S * k
    dev = z.device
    counts = _all_gather(expert_counts(idx, E), group)  # [R, E]
    plan = plan_rows(counts, C, n_hot)
    dest, pos = row_targets(plan, counts, rank, idx)
    offs_home, offs_rep = rank_groups(plan, rank)

    rows = torch.arange(C, device=dev)
    send = z.new_zeros(R, C, L).index_put((dest, rows), z[rows // k])
    recv = _AllToAll.apply(send, group)  # recv[s, i] = row i of rank s, if it was sent here
    recv_pos = _all_to_all(torch.full((R, C), 2 * C, dtype=torch.int64, device=dev).index_put((dest, rows), pos),
                           group)
    buf = z.new_zeros(2 * C + 1, L).index_put((recv_pos.reshape(-1),), recv.reshape(R * C, L))
    y_home = grouped_ffn(buf[:C], offs_home, w1, w3, w2, beta1, beta2)
    parts = [y_home]
    if n_hot and R > 1:
        hot_local = plan.hot[rank] - rank * M
        pool = [_GatherReplicas.apply(w.index_select(0, hot_local), group).flatten(0, 1) for w in (w1, w3, w2)]
        parts.append(grouped_ffn(buf[C:2 * C], offs_rep, *pool, beta1, beta2))
    else:
        parts.append(z.new_zeros(C, L))
    parts.append(z.new_zeros(1, L))  # the dump row: dropped rows read zeros
    y_all = torch.cat(parts)
    back = _AllToAll.apply(y_all[recv_pos], group)  # back[c, i] = output of my row i computed on rank c
    y = back[dest, rows]
    stats = EPStats(rows=offs_home[-1] + (offs_rep[-1] if offs_rep.numel() else 0),
                    replicas=(torch.diff(offs_rep, prepend=offs_rep.new_zeros(1)) > 0).sum(),
                    load=plan.load, ok=plan.ok)
    return y, stats


# ---------------------------------------------------------------------------------------------- layer wrapper
class ExpertParallelMoE(nn.Module):
    """Wrap a ``k3.layers.moe.LatentMoE`` for expert parallel over ``group``, from outside.

    The routed experts are sharded (this rank keeps experts [rM, (r+1)M) of ``moe.experts.w1/w3/w2``, sliced from
    the full tensors it was built with); the router, W↓, the latent norm, W↑ and the shared experts stay
    replicated — reduce their gradients over the data-parallel group as usual (``replicated_parameters()``).
    The layer's own ``forward`` runs unchanged: only its ``routed(z, idx, p, record)`` step is redirected here.
    Every rank must pass the same number of tokens.
    """

    def __init__(self, moe: nn.Module, group=None, n_hot: int | None = None) -> None:
        super().__init__()
        group = group if group is not None else dist.group.WORLD
        R, rank = dist.get_world_size(group), dist.get_rank(group)
        E = moe.experts.n_experts
        if E % R:
            raise ValueError(f"the EP group size ({R}) must divide n_experts ({E})")
        M = E // R
        n_hot = default_n_hot(E, R) if n_hot is None else n_hot
        if isinstance(n_hot, bool) or not isinstance(n_hot, int) or not 0 <= n_hot <= M:
            raise ValueError(f"n_hot must be an integer in [0, n_experts/EP = {M}], got {n_hot!r}")
        self.moe, self.group, self.n_hot, self.rank, self.world = moe, group, n_hot, rank, R
        ex = moe.experts
        for name in ("w1", "w3", "w2"):
            full = getattr(ex, name)
            if full.shape[0] != E:
                raise ValueError(f"moe.experts.{name} must hold all {E} experts before sharding, got {full.shape[0]}")
            setattr(ex, name, nn.Parameter(full.detach()[rank * M:(rank + 1) * M].clone(),
                                           requires_grad=full.requires_grad))
        ex.ep_rank, ex.ep_size = rank, R
        self.last_stats: EPStats | None = None
        moe.routed = self._routed  # the layer's hook: forward() calls self.routed(z, idx, p, record)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)

    def _routed(self, z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor, record: bool = False) -> torch.Tensor:
        ex = self.moe.experts
        y, stats = ep_expert_rows(z, idx, ex.w1, ex.w3, ex.w2, self.group, self.n_hot, ex.beta1, ex.beta2)
        self.last_stats = stats
        if record:
            self.moe.last_load = stats.load.detach()
        S, k = idx.shape
        rows = torch.arange(S * k, device=z.device).view(S, k)
        return combine_norm_rows(y, rows, p, self.moe.routed_expert_norm.weight, self.moe.eps)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every EP rank holds in full (sum/average their gradients over the data-parallel group)."""
        sharded = {id(p) for p in self.moe.experts.parameters()}
        return [p for p in self.moe.parameters() if id(p) not in sharded]

    def check(self) -> None:
        """Raise if the last forward's plan was infeasible (synchronises: call it outside the hot loop)."""
        if self.last_stats is not None and not bool(self.last_stats.ok):
            raise RuntimeError(f"expert-parallel plan infeasible: n_hot={self.n_hot} hot experts per rank could not "
                               f"absorb a rank's excess rows; raise n_hot (>= {default_n_hot(self.moe.experts.n_experts, self.world)} always works)")


def parallelize_moe(model: nn.Module, group=None, n_hot: int | None = None) -> list[ExpertParallelMoE]:
    """Expert-parallelise every ``LatentMoE`` inside ``model`` in place (module names and state-dict keys stay;
    expert tensors become this rank's shard). Returns the wrappers (for ``check()`` and stats)."""
    return [ExpertParallelMoE(m, group, n_hot) for m in model.modules() if isinstance(m, LatentMoE)]
