"""K3Config: every number of the architecture in one keyword-only dataclass, plus named presets.

Presets
-------
``k3``         the released Kimi K3: 93 layers, 69 KDA + 24 Gated MLA, 896 latent experts, top-16.
``k3-linear``  the same with every attention layer KDA (no KV cache at all).
``small``      every mechanism at ~1B total parameters; trains on one 141 GB GPU.
``tiny``       every mechanism at ~0.3M parameters; trains on a 2-core CPU in about a minute.

The mechanisms and their numbers: docs/architecture.md. Layer indices in this class are 0-based (``mla_layers``);
the released ``config.json`` uses 1-based lists, which ``k3.ckpt.released`` translates.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3.utils import atomic_write_text, parse_json, read_json

__all__ = ["K3Config", "PRESETS", "MAX_INT", "MAX_LAYERS"]

MAX_INT = 2**31 - 1  # a tensor dimension or id past int32 breaks the kernels' index arithmetic
MAX_LAYERS = 65_536  # ~700x K3's depth; bounds the layer lists a config may describe


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


@dataclass(kw_only=True)
class K3Config:
    # --- trunk ---------------------------------------------------------------------------------------------
    vocab_size: int = 163_840
    hidden_size: int = 7168
    num_layers: int = 93
    mla_layers: tuple[int, ...] = tuple(range(3, 92, 4)) + (92,)  # 0-based; every other layer is KDA
    max_seq_len: int = 1_048_576
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 163_584
    eos_token_id: int | None = 163_586
    pad_token_id: int | None = 163_839
    # --- KDA (docs/architecture.md#kimi-delta-attention) -----------------------------------------------------------
    kda_num_heads: int = 96
    kda_head_dim: int = 128  # d_k = d_v
    kda_conv_size: int = 4
    kda_gate_lower_bound: float = -5.0
    # --- Gated MLA (docs/architecture.md#gated-mla) ----------------------------------------------------------------
    mla_num_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # kept in the dot product, never rotated (NoPE)
    v_head_dim: int = 128
    mla_lowrank_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm in the HF reference
    # --- dense MLP (layers < first_k_dense) and Latent MoE (docs/architecture.md#latent-moe) -----------------------
    first_k_dense: int = 1
    dense_intermediate_size: int = 33_792
    n_experts: int = 896
    top_k: int = 16
    expert_dim: int = 3072  # routed expert FFN width
    latent_dim: int = 3584  # ℓ: routed experts run at this width
    n_shared_experts: int = 2  # full-d shared experts, stored fused (width n_shared * expert_dim)
    routed_scaling_factor: float = 1.0
    qb_num_bins: int = 1000
    situ_beta1: float = 4.0
    situ_beta2: float = 25.0
    # --- Block AttnRes (docs/architecture.md#block-attention-residuals) --------------------------------------------
    attn_res_block_size: int = 12  # in decoder layers
    # --- numerics --------------------------------------------------------------------------------------------
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if isinstance(self.mla_layers, (list, tuple)):  # numpy / torch integers become ints; other types stay for
            self.mla_layers = tuple(i if isinstance(i, bool) or not hasattr(i, "__index__") else operator.index(i)
                                    for i in self.mla_layers)  # _check_types to name
        self.validate()

    # ---------------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field of the wrong type or out of range."""
        self._check_types()
        positive = ("vocab_size", "hidden_size", "num_layers", "max_seq_len", "kda_num_heads", "kda_head_dim",
                    "kda_conv_size", "mla_num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                    "v_head_dim", "dense_intermediate_size", "n_experts", "top_k", "expert_dim", "latent_dim",
                    "qb_num_bins", "attn_res_block_size")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"K3Config.{name} must be a positive integer, got {v!r}")
        for name in ("qk_rope_head_dim", "n_shared_experts", "first_k_dense"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"K3Config.{name} must be a non-negative integer, got {v!r}")
        for name in ("rms_norm_eps", "mla_lowrank_norm_eps", "initializer_range", "situ_beta1", "situ_beta2",
                     "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"K3Config.{name} must be > 0, got {getattr(self, name)!r}")
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"K3Config.num_layers must be <= {MAX_LAYERS} (every layer is a module of its own), "
                             f"got {self.num_layers}")
        if self.kda_conv_size > self.max_seq_len:
            raise ValueError(f"K3Config.kda_conv_size must be <= max_seq_len ({self.max_seq_len}): a causal "
                             f"convolution never sees more tokens than that; got {self.kda_conv_size}")
        if not (-5.0 <= self.kda_gate_lower_bound < 0.0):
            raise ValueError(f"K3Config.kda_gate_lower_bound must be in [-5, 0), got {self.kda_gate_lower_bound}")
        if self.top_k >= self.n_experts:
            raise ValueError(f"K3Config.top_k must be < n_experts ({self.n_experts}), got {self.top_k}")
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"K3Config.first_k_dense must be <= num_layers ({self.num_layers}), got {self.first_k_dense}")
        if len(set(self.mla_layers)) != len(self.mla_layers) or any(
            not 0 <= i < self.num_layers for i in self.mla_layers
        ):
            raise ValueError(
                f"K3Config.mla_layers must be distinct 0-based indices in [0, {self.num_layers}), got {self.mla_layers}"
            )
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"K3Config.dtype must be 'bfloat16', 'float16' or 'float32', got {self.dtype!r}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ValueError(f"K3Config.{name} must be in [0, vocab_size={self.vocab_size}) or None, got {v}")

    def _check_types(self) -> None:
        """Each field against its annotation (JSON gives strings, floats and lists where ints belong)."""
        for f in dataclasses.fields(self):
            v, kind = getattr(self, f.name), str(f.type)
            if kind == "bool":
                ok = isinstance(v, bool)
            elif kind.startswith("int"):  # int, int | None
                ok = (v is None and "None" in kind) or (isinstance(v, int) and not isinstance(v, bool)
                                                         and abs(v) <= MAX_INT)
            elif kind == "float":
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            elif kind == "str":
                ok = isinstance(v, str)
            else:  # tuple[int, ...]
                ok = isinstance(v, tuple) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
            if not ok:
                want = {"bool": "true or false", "float": "a finite number", "str": "a string"}.get(
                    kind, f"an integer below 2**31{' or null' if 'None' in kind else ''}" if kind.startswith("int")
                    else "a list of integers")
                raise ValueError(f"K3Config.{f.name} must be {want}, got {_short(v)}")

    # --- derived -----------------------------------------------------------------------------------------------
    def layer_type(self, i: int) -> str:
        """'mla' or 'kda' for 0-based decoder layer ``i``."""
        return "mla" if i in self.mla_layers else "kda"

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.mla_layers)

    @property
    def shared_dim(self) -> int:
        return self.n_shared_experts * self.expert_dim

    @property
    def mla_qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def torch_dtype(self) -> "torch.dtype":  # noqa: F821
        import torch

        return getattr(torch, self.dtype)

    # --- (de)serialisation ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mla_layers"] = list(self.mla_layers)
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        s = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            atomic_write_text(Path(path), s + "\n")
        return s

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config has unknown field(s) {unknown}; known fields: {sorted(known)}")
        d = dict(d)
        if "mla_layers" in d:
            if not isinstance(d["mla_layers"], (list, tuple)):
                raise ValueError(f"K3Config.mla_layers must be a list of integers, got {_short(d['mla_layers'])}")
            d["mla_layers"] = tuple(d["mla_layers"])
        return cls(**d)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "K3Config":
        """Parse a JSON string, or read a file when given a path (size and nesting bounded: see ``read_json``)."""
        s = str(text_or_path)
        if s.lstrip().startswith("{"):
            return cls.from_dict(parse_json(s, "config"))
        return cls.from_dict(read_json(Path(s), f"config file {s}"))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "K3Config":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        d = dict(PRESETS[name])
        d.update(overrides)
        return cls.from_dict(d)


def _every_fourth_mla(num_layers: int) -> list[int]:
    """K3's pattern: MLA at 1-based 4, 8, …, and always the last layer."""
    return sorted(set(range(3, num_layers, 4)) | {num_layers - 1})


PRESETS: dict[str, dict[str, Any]] = {
    "k3": {},
    "k3-linear": {"mla_layers": []},
    # ~1B parameters: 12 layers, 64 experts of a 512-wide latent; every mechanism present.
    "small": dict(
        vocab_size=32_768, hidden_size=1024, num_layers=12, mla_layers=_every_fourth_mla(12), max_seq_len=65_536,
        kda_num_heads=8, kda_head_dim=128, mla_num_heads=8, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=128, dense_intermediate_size=4096,
        n_experts=128, top_k=8, expert_dim=512, latent_dim=512, n_shared_experts=2, attn_res_block_size=3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    ),
    # byte-level vocabulary (256 bytes + specials); 4 layers: KDA, KDA, KDA, MLA; AttnRes blocks of 2 layers.
    "tiny": dict(
        vocab_size=260, hidden_size=64, num_layers=4, mla_layers=[3], max_seq_len=4096,
        kda_num_heads=2, kda_head_dim=32, mla_num_heads=2, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32, dense_intermediate_size=192,
        n_experts=8, top_k=2, expert_dim=64, latent_dim=32, n_shared_experts=2, attn_res_block_size=2,
        bos_token_id=256, eos_token_id=257, pad_token_id=259, dtype="float32",
    ),
}
