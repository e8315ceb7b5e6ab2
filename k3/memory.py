"""Memory estimates made before any model is built, and the refusal of what cannot fit.

A config with ``num_experts`` 10⁸ or a ``--batch-size`` of 10¹² would otherwise allocate until the machine runs out
of memory. ``model_footprint(config)`` counts parameters and bytes exactly on the ``meta`` device (nothing is
allocated): one decoder layer of each kind present (KDA/MLA × dense/MoE) is built and multiplied by how many
layers of that kind the config has, so the count follows the real modules. ``training_footprint`` adds gradients,
optimizer states, the Quantile Balancing histograms and a lower bound on activations. ``check_fits`` compares the
total with the target device's memory (CPU: available RAM, within any cgroup limit; GPU: free memory) and raises
``ValueError`` — one line naming the fields that dominate and the estimate — unless the caller forces it
(``--force-memory``). Estimates are lower bounds: a refusal means it cannot fit; passing does not promise it will.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM

__all__ = ["Footprint", "model_footprint", "training_footprint", "available_memory", "check_fits", "human_bytes"]

# Which config fields size each part of the model (named in a refusal).
_PART_FIELDS = {
    "embedding and lm_head": ("vocab_size", "hidden_size"),
    "routed experts": ("n_experts", "expert_dim", "latent_dim", "num_layers"),
    "shared experts": ("n_shared_experts", "expert_dim", "hidden_size", "num_layers"),
    "router and latent projections": ("n_experts", "latent_dim", "hidden_size", "num_layers"),
    "KDA layers": ("kda_num_heads", "kda_head_dim", "kda_conv_size", "hidden_size", "num_layers"),
    "MLA layers": ("mla_num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "hidden_size",
                   "num_layers"),
    "dense MLP": ("dense_intermediate_size", "hidden_size", "first_k_dense"),
    "norms and AttnRes": ("hidden_size", "num_layers"),
    "QB histograms": ("n_experts", "qb_num_bins", "num_layers"),
    "logits": ("batch_size", "seq_len", "vocab_size"),
    "activations": ("batch_size", "seq_len", "hidden_size", "num_layers"),
    "short-conv inputs": ("batch_size", "seq_len", "kda_conv_size", "kda_num_heads", "kda_head_dim"),
}


@dataclass
class Footprint:
    """Parameters and bytes by part (``parts``: name → bytes)."""

    params: int
    parts: dict[str, int] = field(default_factory=dict)
    what: str = "loading the model"

    @property
    def bytes(self) -> int:
        return sum(self.parts.values())


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def _part(name: str, layer_type: str | None) -> str:
    """The part a parameter of a representative model belongs to."""
    if layer_type is None:
        return "embedding and lm_head" if ("embed_tokens" in name or "lm_head" in name) else "norms and AttnRes"
    if ".experts." in name:
        return "routed experts"
    if ".shared_experts." in name:
        return "shared experts"
    if ".block_sparse_moe." in name:
        return "router and latent projections"
    if ".self_attn." in name:
        return "KDA layers" if layer_type == "kda" else "MLA layers"
    if ".mlp." in name:
        return "dense MLP"
    return "norms and AttnRes"


def _layer_classes(config: K3Config) -> list[tuple[str, bool, int]]:
    """``(kind, is_moe, count)`` for each kind of decoder layer present (O(len(mla_layers)), whatever num_layers)."""
    L, fkd = config.num_layers, min(config.first_k_dense, config.num_layers)
    mla_dense = sum(1 for i in config.mla_layers if i < fkd)
    mla_moe = len(config.mla_layers) - mla_dense
    counts = {("kda", False): fkd - mla_dense, ("mla", False): mla_dense,
              ("kda", True): (L - fkd) - mla_moe, ("mla", True): mla_moe}
    return [(kind, moe, n) for (kind, moe), n in counts.items() if n > 0]


def _representative(config: K3Config, classes: list[tuple[str, bool, int]]) -> K3Config:
    """A config with one layer per kind (in ``classes``' order, dense kinds first); every other field as given."""
    return dataclasses.replace(config, num_layers=len(classes), first_k_dense=sum(1 for c in classes if not c[1]),
                               mla_layers=tuple(i for i, c in enumerate(classes) if c[0] == "mla"))


def model_footprint(config: K3Config, mxfp4_experts: bool = False, dtype: torch.dtype | None = None) -> Footprint:
    """Parameters and bytes of ``K3ForCausalLM(config)`` as loaded for inference (weights in the config's dtype, the
    fp32 tensors fp32; ``mxfp4_experts``: routed experts kept 4-bit, 17/32 byte per weight; ``dtype``: another
    weight dtype, e.g. fp32 master weights)."""
    classes = _layer_classes(config)  # dense kinds come first, as in the model
    with torch.device("meta"):
        model = K3ForCausalLM(_representative(config, classes))
    if dtype is not None:
        model._cast(dtype)
    mult = {f"model.layers.{i}.": n for i, (_, _, n) in enumerate(classes)}
    kinds = {f"model.layers.{i}.": k for i, (k, _, _) in enumerate(classes)}
    params, parts = 0, {}
    seen: set[int] = set()
    tensors = [*model.named_parameters(remove_duplicate=False),
               *((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))]
    for name, t in tensors:
        if id(t) in seen:  # tied embeddings count once
            continue
        seen.add(id(t))
        prefix = next((p for p in mult if name.startswith(p)), None)
        n = t.numel() * (mult[prefix] if prefix else 1)
        part = _part(name, kinds[prefix] if prefix else None)
        per = 17 / 32 if (mxfp4_experts and part == "routed experts") else t.element_size()
        params += n
        parts[part] = parts.get(part, 0) + math.ceil(n * per)
    return Footprint(params=params, parts=parts)


def training_footprint(config: K3Config, batch_size: int, seq_len: int, optimizer: str = "muon",
                       activation_checkpointing: bool = False, shards: int = 1) -> Footprint:
    """A lower bound on the memory of one training process: fp32 master weights, gradients and optimizer states
    (divided over ``shards`` ranks that shard them), the QB histograms, the logits and the activations kept for the
    backward pass of a micro-batch of ``batch_size × seq_len`` tokens."""
    fp = model_footprint(config, dtype=torch.float32)
    state = 3 if optimizer == "adamw" else 2  # weights + grads + (AdamW: 2 moments; Muon: ≥ 1 momentum)
    parts = {k: v * (1 + state) // max(shards, 1) for k, v in fp.parts.items()}
    n_moe = sum(n for _, moe, n in _layer_classes(config) if moe)
    parts["QB histograms"] = n_moe * config.n_experts * config.qb_num_bins * 4
    tokens = batch_size * seq_len
    parts["logits"] = tokens * config.vocab_size * 4 * 2  # fp32 logits and their gradient
    layers = 1 if activation_checkpointing else config.num_layers
    parts["activations"] = tokens * config.hidden_size * 4 * 4 * layers
    n_kda = 1 if activation_checkpointing else sum(n for kind, _, n in _layer_classes(config) if kind == "kda")
    conv_in = batch_size * (seq_len + config.kda_conv_size - 1) * config.kda_num_heads * config.kda_head_dim
    parts["short-conv inputs"] = 3 * conv_in * 4 * n_kda if n_kda else 0
    return Footprint(params=fp.params, parts=parts, what="training")


def _cgroup_room() -> int | None:
    """Bytes left under a cgroup2 memory limit, if one is set."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def available_memory(device: torch.device | str) -> int:
    """Bytes ``device`` can still give: free GPU memory, or the RAM Linux reports available (``MemAvailable``,
    capped by a cgroup limit); other systems: physical RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    room = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if room is None:
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cg = _cgroup_room()
    return min(room, cg) if cg is not None else room


def check_fits(fp: Footprint, device: torch.device | str, force: bool = False, config: K3Config | None = None,
               extra: dict[str, int] | None = None) -> None:
    """Raise ``ValueError`` (one line: the estimate, the dominating parts and their fields) when ``fp`` exceeds what
    ``device`` has available; ``force`` skips the check. ``config``/``extra`` supply field values for the message."""
    if force:
        return
    device = torch.device(device)
    room = available_memory(device)
    need = fp.bytes
    if need <= room:
        return
    values = {**(dataclasses.asdict(config) if config is not None else {}), **(extra or {})}
    top = sorted(fp.parts.items(), key=lambda kv: -kv[1])[:2]
    names = []
    for part, nbytes in top:
        fields = ", ".join(f"{f}={values[f]}" if f in values else f for f in _PART_FIELDS.get(part, ()))
        names.append(f"{part} {human_bytes(nbytes)} [{fields}]")
    raise ValueError(f"{fp.what} needs at least {human_bytes(need)} ({fp.params:.3g} parameters; largest: "
                     f"{'; '.join(names)}) but {device.type} has {human_bytes(room)} available; shrink those "
                     "fields, or pass --force-memory if you know better")
