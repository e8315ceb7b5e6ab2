"""The degrees of parallelism of a run and the named ``DeviceMesh`` they build (torchtitan's layout).

Letters: R world size, dp_replicate × dp_shard data ranks (each sees its own rows of the global batch), cp ranks per
sequence (each holds a contiguous slice of every sequence), ep ranks per expert group (each holds n_experts / ep
whole experts).

    world size R = dp_replicate · dp_shard · cp        (· tp, later)

Expert parallel is *not* an extra factor of R: its ranks must see different tokens, so ep is borrowed from the
dp_shard × cp ranks (cp | ep | dp_shard·cp). Within one dp_replicate group the dp_shard·cp ranks are cut into
``dp_shard_mod_ep`` groups of ``ep`` ranks; the experts are split over ``ep`` and FSDP-sharded over
``dp_shard_mod_ep``, every other parameter is FSDP-sharded over all dp_shard·cp ranks.

Mesh dimensions (``build_mesh``), each a view of one world mesh:

    dp            dp_replicate × dp_shard   which rows of the global batch a rank reads
    dp_cp         dp × cp                   ranks that see different tokens: loss averaging, QB histograms
    dp_shard_cp   dp_shard × cp             FSDP shards the dense parameters over it (HSDP with dp_replicate)
    dp_replicate  dp_replicate              HSDP's replicate dimension
    cp            cp                        context parallel (KDA ``cp_context``, MLA latent all-gather)
    ep            dp_shard_in_ep × cp       expert parallel (only when ep > 1)
    dp_shard_mod_ep                         the experts' FSDP dimension (only when ep > 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

__all__ = ["ParallelDims", "ParallelMesh"]

_FLAGS = {"dp_replicate": "--dp-replicate", "dp_shard": "--dp-shard", "cp": "--cp", "ep": "--ep", "tp": "--tp"}


def _positive(name: str, v: Any, allow_fill: bool = False) -> None:
    ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or (allow_fill and v == -1))
    if not ok:
        what = "a positive integer or -1 (fill the world)" if allow_fill else "a positive integer"
        raise ValueError(f"{_FLAGS[name]} must be {what}, got {v!r}")


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of a run, validated against ``world_size`` (``WORLD_SIZE`` under torchrun, 1 otherwise).

    ``dp_shard = -1`` takes whatever the other degrees leave of the world. Every error is a ``ValueError`` naming
    the command-line flag, raised identically on every rank before any collective (so no rank waits for another).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        for name in ("dp_replicate", "cp", "ep", "tp"):
            _positive(name, getattr(self, name))
        _positive("dp_shard", self.dp_shard, allow_fill=True)
        if self.tp != 1:
            raise ValueError(f"--tp {self.tp}: tensor parallel is not supported yet; use --tp 1")
        rest = self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % rest:
                raise ValueError(f"--dp-replicate {self.dp_replicate} × --cp {self.cp} = {rest} does not divide the "
                                 f"world size {self.world_size}{_launch_hint(rest)}")
            self.dp_shard = self.world_size // rest
        if self.dp_shard * rest != self.world_size:
            raise ValueError(f"--dp-replicate {self.dp_replicate} × --dp-shard {self.dp_shard} × --cp {self.cp} = "
                             f"{self.dp_shard * rest} ranks, but the world size is {self.world_size}"
                             f"{_launch_hint(self.dp_shard * rest)}")
        if self.ep > 1:
            if self.ep % self.cp:
                raise ValueError(f"--ep {self.ep} must be a multiple of --cp {self.cp} (expert parallel takes every "
                                 "context-parallel rank of a sequence)")
            if (self.dp_shard * self.cp) % self.ep:
                raise ValueError(f"--ep {self.ep} must divide --dp-shard × --cp = {self.dp_shard * self.cp}: expert "
                                 "parallel borrows its ranks from the sharded data ranks, it is not an extra factor "
                                 "of the world size")

    # --- derived degrees -----------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data ranks: how many ways the global batch's rows are split."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that see different tokens (loss averaging, Quantile Balancing histograms)."""
        return self.dp * self.cp

    @property
    def dp_shard_in_ep(self) -> int:
        return self.ep // self.cp if self.ep > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard * self.cp // self.ep if self.ep > 1 else self.dp_shard * self.cp

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def check_run(self, *, n_experts: int | None, seq_len: int, batch_size: int) -> None:
        """The checks that need the model and the batch: ep | n_experts, cp | seq_len, dp | batch_size."""
        if self.ep > 1:
            if not n_experts:
                raise ValueError(f"--ep {self.ep} needs a model with routed experts; this one has none")
            if n_experts % self.ep:
                raise ValueError(f"--ep {self.ep} must divide the model's n_experts ({n_experts})")
        if seq_len % self.cp:
            raise ValueError(f"--cp {self.cp} must divide --seq-len ({seq_len}): each rank holds an equal slice")
        if batch_size % self.dp:
            raise ValueError(f"--batch-size {batch_size} (the global batch) must be a multiple of the data-parallel "
                             f"degree --dp-replicate × --dp-shard = {self.dp}")

    def describe(self) -> str:
        """``dp_shard 2 × ep 2`` style summary of the degrees above 1 (``single process`` when none)."""
        parts = [f"{n} {getattr(self, n)}" for n in ("dp_replicate", "dp_shard", "cp", "ep") if getattr(self, n) > 1]
        return " × ".join(parts) if parts else "one rank"

    # --- mesh ----------------------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> "ParallelMesh":
        """Every named view of the module docstring, built once over the existing process group.

        Dimensions of size 1 are kept, so the common views exist whatever the degrees (``mesh["cp"]`` has size 1
        without context parallel); ``ep``, ``dp_shard_mod_ep`` and ``expert_fsdp`` exist only when ep > 1.
        ``fsdp`` / ``expert_fsdp`` are what ``fully_shard`` takes: 1-D, or 2-D (replicate, shard) for HSDP.
        """
        if self.ep > 1:
            names = ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp")
            shape = (self.dp_replicate, self.dp_shard_mod_ep, self.dp_shard_in_ep, self.cp)
            dp_shard = ("dp_shard_mod_ep", "dp_shard_in_ep")
        else:
            names = ("dp_replicate", "dp_shard", "cp")
            shape = (self.dp_replicate, self.dp_shard, self.cp)
            dp_shard = ("dp_shard",)
        world = init_device_mesh(device_type, shape, mesh_dim_names=names)
        views = {n: world[n] for n in names}
        # flattened views are kept here, not sliced from the root again (torch deprecates that)
        views["dp"] = world[("dp_replicate", *dp_shard)]._flatten("dp")
        views["dp_shard_cp"] = world[(*dp_shard, "cp")]._flatten("dp_shard_cp")
        views["dp_cp"] = world[names]._flatten("dp_cp")
        views["fsdp"] = (views["dp_shard_cp"] if self.dp_replicate == 1 else
                         views["dp_cp"]._unflatten(0, (self.dp_replicate, self.dp_shard * self.cp),
                                                   ("dp_replicate", "dp_shard_cp")))
        if self.ep > 1:
            views["dp_shard"] = world[dp_shard]._flatten("dp_shard")
            views["ep"] = world[("dp_shard_in_ep", "cp")]._flatten("ep")
            views["expert_fsdp"] = (world["dp_shard_mod_ep"] if self.dp_replicate == 1 else
                                    world[("dp_replicate", "dp_shard_mod_ep")])
        return ParallelMesh(dims=self, world=world, views=views)


@dataclass
class ParallelMesh:
    """The named views of one run's world mesh: ``mesh["dp"]``, ``mesh["fsdp"]``, ``mesh["ep"]`` …"""

    dims: ParallelDims
    world: Any  # DeviceMesh
    views: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        try:
            return self.views[name]
        except KeyError:
            raise KeyError(f"no mesh view {name!r} for {self.dims.describe()}; views: {sorted(self.views)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.views

    def group(self, name: str) -> Any:
        """The process group of 1-D view ``name`` (e.g. ``"dp_cp"`` for QB histograms and loss averaging)."""
        return self[name].get_group()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()


def _launch_hint(ranks: int) -> str:
    return (f"; launch with torchrun --nproc_per_node {ranks}" if ranks > 1 else
            "; with one process leave the parallel flags at their defaults")
