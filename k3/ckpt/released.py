"""The released Kimi K3 checkpoint layout: ``config.json`` ⇄ ``K3Config``, tensor names, lazy sharded load, save.

A released folder holds ``config.json`` (a vision-language wrapper, ``model_type`` ``kimi_k3``, the language model
in ``text_config``), ``model.safetensors.index.json`` + shards ``model-000NN-of-000MM.safetensors``, and the
tokenizer (``tiktoken.model``; see ``k3.data.k3_tokenizer``).

Name mapping (checkpoint ↔ ``K3ForCausalLM.state_dict()``): drop / add the ``language_model.`` prefix, except
- routed experts: checkpoint ``…block_sparse_moe.experts.{e}.w{1,3,2}.weight_packed`` (uint8 [out, in/2]) and
  ``.weight_scale`` (uint8 [out, in/32]), one pair per expert ⇄ the stacked buffers ``experts.w1_packed`` [E, …] …
  of ``MXFP4GroupedExperts`` (kept 4-bit, bytes unchanged), or — with ``dequantize=True`` — dequantised into the
  stacked ``GroupedExperts`` parameters ``experts.w1`` [E, F, ℓ] …; an unquantised checkpoint stores
  ``experts.{e}.w1.weight``;
- ``self_attn.A_log``: checkpoint [⌈H/128⌉·128] fp32 zero-padded ⇄ model [H] (sliced on load, padded on save);
- ``vision_tower.*`` / ``mm_projector.*`` (the image encoder) are skipped with a note.
fp32 in the checkpoint: the short-conv weights, ``dt_bias``, ``A_log``, ``o_norm.weight``,
``gate.e_score_correction_bias`` (= the QB bias); MXFP4 parts uint8; everything else the config's ``dtype`` (bf16).

Loading builds the model on the ``meta`` device and fills it shard by shard (``safetensors.safe_open``, one shard
open at a time): host memory holds at most the tensors of one shard on their way to ``device``.  Loading a released
folder and saving it again reproduces every language-model tensor bit-exactly (names, dtypes, shapes, bytes).
Everything a user can get wrong raises ``ValueError`` with a one-line message.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from k3.config import MAX_INT, MAX_LAYERS, K3Config
from k3.layers.experts_mxfp4 import MXFP4GroupedExperts
from k3.layers.moe import LatentMoE
from k3.memory import check_fits, model_footprint
from k3.model import K3ForCausalLM, keeps_fp32
from k3.ops.moe.mxfp4 import GROUP, dequantize_mxfp4, quantize_mxfp4
from k3.utils import confined, read_json

__all__ = [
    "config_from_released", "config_to_released", "load_pretrained", "save_pretrained", "read_released_config",
    "released_name", "INDEX_NAME", "CONFIG_NAME",
]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
DEFAULT_SHARD_BYTES = 16 * 2**30
INDEX_MAX_BYTES = 256 << 20  # the release's index lists ~500k tensors (~50 MB)
_EXPERT_RE = re.compile(r"^(model\.layers\.(\d+)\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
MXFP4_QUANT_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
        "output_activations": None,
        "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True,
                    "scale_dtype": "torch.uint8", "observer": "minmax", "observer_kwargs": {}, "dynamic": False,
                    "actorder": None, "block_structure": None, "zp_dtype": None},
    }},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "global_compression_ratio": None,
}


def _note(msg: str, verbose: bool = True) -> None:
    if verbose:
        print(f"k3: note: {msg}", file=sys.stderr)


# =================================================================================================================
# config.json ⇄ K3Config
# =================================================================================================================
@dataclass
class ReleasedInfo:
    """What the config says beyond K3Config: whether experts are MXFP4, the raw wrapper, notes for the user."""

    quantized: bool
    raw: dict[str, Any]
    notes: list[str]
    mtp_layers: int = 0


def _need(d: dict[str, Any], key: str, where: str = "text_config") -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"config.json {where} lacks '{key}': not a Kimi K3 checkpoint config")
    return d[key]


def _expect(d: dict[str, Any], key: str, want: Any, what: str, default: Any = None) -> None:
    got = d.get(key, default)
    if got != want:
        raise ValueError(f"unsupported config: text_config.{key} = {got!r} ({what}); k3 supports only {want!r}")


def _check_quantization(q: Any) -> bool:
    """True for the released MXFP4 scheme; ``ValueError`` for any other quantization."""
    if q is None:
        return False
    if not isinstance(q, dict):
        raise ValueError(f"config.json quantization_config must be an object, got {type(q).__name__}")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) and isinstance(g.get("weights") or {}, dict)
                                               for g in groups.values()):
        raise ValueError("config.json quantization_config.config_groups must map names to objects with 'weights'")
    fmt = q.get("format")
    if q.get("quant_method") != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise ValueError(f"unsupported quantization: quant_method={q.get('quant_method')!r}, format={fmt!r}; "
                         "k3 reads only compressed-tensors 'mxfp4-pack-quantized' (the released experts)")
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", GROUP):
            raise ValueError(f"unsupported quantization group {name}: weights {w.get('num_bits')}-bit "
                             f"{w.get('type')} group {w.get('group_size')}; k3 reads only 4-bit float group 32")
        if (group or {}).get("input_activations") is not None:
            raise ValueError(f"unsupported quantization group {name}: quantized input activations (only W4A16)")
    return True


def _layer_list(lac: dict[str, Any], key: str, num_layers: int) -> set[int] | None:
    v = lac.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ValueError(f"config.json linear_attn_config.{key} must be a list of 1-based layer numbers, got "
                         f"{type(v).__name__}")
    bad = [i for i in v if not 1 <= i <= num_layers]
    if bad or len(set(v)) != len(v):
        raise ValueError(f"config.json linear_attn_config.{key} must hold distinct layer numbers in 1…{num_layers}"
                         + (f"; got {bad[0]}" if bad else "; got a repeat"))
    return set(v)


def _layer_lists(lac: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """1-based ``kda_layers`` / ``full_attn_layers`` → 0-based MLA layers, checking they partition 1…L."""
    _check_int("num_hidden_layers", num_layers, MAX_LAYERS)
    kda = _layer_list(lac, "kda_layers", num_layers)
    full = _layer_list(lac, "full_attn_layers", num_layers)
    if kda is None and full is None:
        raise ValueError("config.json linear_attn_config lacks kda_layers / full_attn_layers")
    if kda is not None and full is not None and (kda & full or len(kda) + len(full) != num_layers):
        raise ValueError(f"linear_attn_config: kda_layers and full_attn_layers must partition the 1-based layers "
                         f"1…{num_layers}; got {len(kda)} and {len(full)} layers, {len(kda & full)} in both")
    if full is None:
        full = set(range(1, num_layers + 1)) - kda  # type: ignore[operator]
    return tuple(sorted(i - 1 for i in full))


def _check_int(key: str, v: Any, most: int = MAX_INT) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= most:
        raise ValueError(f"config.json text_config.{key} must be a positive integer <= {most}, got "
                         f"{str(v)[:40]!r}")


def config_from_released(raw: dict[str, Any], verbose: bool = False) -> tuple[K3Config, ReleasedInfo]:
    """Released ``config.json`` (the kimi_k3 wrapper, or a bare kimi_linear text config) → ``(K3Config, info)``."""
    if not isinstance(raw, dict):
        raise ValueError("config.json must hold a JSON object")
    notes: list[str] = []
    mt = raw.get("model_type")
    if mt == "kimi_k3" or "text_config" in raw:
        tc = raw.get("text_config")
        if not isinstance(tc, dict):
            raise ValueError("config.json lacks text_config: not a Kimi K3 checkpoint config")
        if raw.get("vision_config") is not None:
            notes.append("vision_config ignored: k3 runs the language model only (vision_tower/mm_projector skipped)")
    elif mt == "kimi_linear":
        tc = raw
    else:
        raise ValueError(f"config.json model_type is {mt!r}: not a Kimi K3 checkpoint (expected 'kimi_k3')")
    if tc.get("model_type", "kimi_linear") != "kimi_linear":
        raise ValueError(f"text_config.model_type is {tc.get('model_type')!r}; expected 'kimi_linear'")
    lac = tc.get("linear_attn_config")
    if not isinstance(lac, dict):
        raise ValueError("config.json text_config lacks linear_attn_config: not a Kimi K3 checkpoint config")

    # --- unsupported variants: refuse rather than compute something else -------------------------------------
    glb = lac.get("gate_lower_bound")
    if isinstance(glb, bool) or not isinstance(glb, (int, float, type(None))):
        raise ValueError("config.json linear_attn_config.gate_lower_bound must be a number")
    if glb is None:
        raise ValueError("unsupported config: linear_attn_config has no gate_lower_bound (the unbounded softplus "
                         "KDA gate); k3 implements only K3's bounded gate, and running a checkpoint through the other "
                         "gate degrades it")
    if lac.get("use_full_rank_gate", True) is not True:
        raise ValueError("unsupported config: linear_attn_config.use_full_rank_gate = false (low-rank output "
                         "gate); k3 implements K3's full-rank gate only")
    H = _need(lac, "num_heads", "linear_attn_config")
    nv = lac.get("num_v_heads")
    if nv is not None and nv != H:
        raise ValueError(f"unsupported config: linear_attn_config.num_v_heads = {nv} != num_heads = {H} (GVA); "
                         "k3's KDA has as many value heads as key heads")
    if lac.get("head_dim") is not None and lac.get("head_k_dim", lac["head_dim"]) != lac["head_dim"]:
        raise ValueError("unsupported config: KDA head_k_dim != head_dim")
    _expect(tc, "mla_use_nope", True, "rotary MLA", True)
    _expect(tc, "mla_use_output_gate", True, "MLA without its output gate", True)
    _expect(tc, "hidden_act", "situ", "the MLP activation", "situ")
    _expect(tc, "moe_router_activation_func", "sigmoid", "the router score function", "sigmoid")
    _expect(tc, "moe_renormalize", True, "un-renormalised routing weights", True)
    _expect(tc, "latent_moe_use_norm", True, "Latent MoE without the RMSNorm before W_up", True)
    _expect(tc, "moe_layer_freq", 1, "MoE on only some layers", 1)
    _expect(tc, "topk_method", "noaux_tc", "the expert selection", "noaux_tc")
    if tc.get("use_grouped_topk") and (tc.get("num_expert_group", 1), tc.get("topk_group", 1)) != (1, 1):
        raise ValueError(f"unsupported config: grouped top-k with num_expert_group={tc.get('num_expert_group')}, "
                         f"topk_group={tc.get('topk_group')}; k3 routes over all experts (groups 1/1)")
    heads = _need(tc, "num_attention_heads")
    if tc.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"unsupported config: num_key_value_heads = {tc['num_key_value_heads']} != "
                         f"num_attention_heads = {heads}; K3's MLA has one latent KV per head")
    if tc.get("q_lora_rank") is None:
        raise ValueError("unsupported config: q_lora_rank is null (MLA without the query low-rank path)")
    if tc.get("routed_expert_hidden_size") is None:
        raise ValueError("unsupported config: no routed_expert_hidden_size (experts not on a latent); k3 builds "
                         "K3's Latent MoE only")
    for key in ("rope_scaling", "rope_theta"):
        if tc.get(key) is not None:
            notes.append(f"text_config.{key} ignored: K3's MLA uses no positional encoding")
    mtp = tc.get("num_nextn_predict_layers") or 0
    if isinstance(mtp, bool) or not isinstance(mtp, int) or not 0 <= mtp <= MAX_LAYERS:
        raise ValueError(f"config.json text_config.num_nextn_predict_layers must be a small integer, got "
                         f"{str(mtp)[:40]!r}")
    if mtp:
        notes.append(f"{mtp} multi-token-prediction layer(s) skipped: k3 generates with the main model only")
    quant = raw.get("quantization_config", tc.get("quantization_config"))
    quantized = _check_quantization(quant)

    L = _need(tc, "num_hidden_layers")
    dtype = tc.get("dtype") or tc.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported config: dtype {dtype!r}; k3 supports {sorted(_DTYPES)}")
    fields = dict(
        vocab_size=_need(tc, "vocab_size"), hidden_size=_need(tc, "hidden_size"), num_layers=L,
        mla_layers=_layer_lists(lac, L), max_seq_len=tc.get("max_position_embeddings", 1_048_576),
        rms_norm_eps=tc.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=tc.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)),
        initializer_range=tc.get("initializer_range", 0.02),
        bos_token_id=tc.get("bos_token_id"), eos_token_id=tc.get("eos_token_id"), pad_token_id=tc.get("pad_token_id"),
        kda_num_heads=H, kda_head_dim=_need(lac, "head_dim", "linear_attn_config"),
        kda_conv_size=lac.get("short_conv_kernel_size", 4), kda_gate_lower_bound=float(lac["gate_lower_bound"]),
        mla_num_heads=heads, q_lora_rank=tc["q_lora_rank"], kv_lora_rank=_need(tc, "kv_lora_rank"),
        qk_nope_head_dim=_need(tc, "qk_nope_head_dim"), qk_rope_head_dim=_need(tc, "qk_rope_head_dim"),
        v_head_dim=_need(tc, "v_head_dim"), mla_lowrank_norm_eps=tc.get("mla_lowrank_norm_eps", 1e-6),
        first_k_dense=tc.get("first_k_dense_replace", 1), dense_intermediate_size=_need(tc, "intermediate_size"),
        n_experts=_need(tc, "num_experts"), top_k=_need(tc, "num_experts_per_token"),
        expert_dim=_need(tc, "moe_intermediate_size"), latent_dim=tc["routed_expert_hidden_size"],
        n_shared_experts=tc.get("num_shared_experts", 0), routed_scaling_factor=tc.get("routed_scaling_factor", 1.0),
        situ_beta1=tc.get("activation_situ_beta", 4.0), situ_beta2=tc.get("activation_situ_linear_beta", 25.0),
        attn_res_block_size=_need(tc, "attn_res_block_size"), dtype=dtype,
    )
    if "qb_num_bins" in tc:
        fields["qb_num_bins"] = tc["qb_num_bins"]
    if not isinstance(fields["tie_word_embeddings"], bool):
        raise ValueError("config.json tie_word_embeddings must be true or false")
    try:
        config = K3Config(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.json describes an invalid model: {e}") from None
    if quantized and (config.latent_dim % GROUP or config.expert_dim % GROUP):
        raise ValueError(f"MXFP4 experts need routed_expert_hidden_size and moe_intermediate_size divisible by "
                         f"{GROUP}, got {config.latent_dim} and {config.expert_dim}")
    for n in notes:
        _note(n, verbose)
    return config, ReleasedInfo(quantized=quantized, raw=raw, notes=notes, mtp_layers=mtp)


def config_to_released(config: K3Config, quantized: bool = True, base: dict[str, Any] | None = None
                       ) -> dict[str, Any]:
    """K3Config → the released ``config.json`` wrapper (``text_config`` rebuilt from ``config``; the other top-level
    fields, e.g. ``vision_config``, are taken from ``base`` — the config the model was loaded from — when given)."""
    c = config
    L = c.num_layers
    full = [i + 1 for i in sorted(c.mla_layers)]
    kda = [i + 1 for i in range(L) if i not in c.mla_layers]
    tc: dict[str, Any] = dict((base or {}).get("text_config") or {})
    tc.update({
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": L,
        "intermediate_size": c.dense_intermediate_size, "num_attention_heads": c.mla_num_heads,
        "num_key_value_heads": c.mla_num_heads, "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim,
        "mla_use_nope": True, "mla_use_output_gate": True, "max_position_embeddings": c.max_seq_len,
        "hidden_act": "situ", "activation_situ_beta": c.situ_beta1, "activation_situ_linear_beta": c.situ_beta2,
        "first_k_dense_replace": c.first_k_dense, "moe_layer_freq": 1, "num_experts": c.n_experts,
        "num_experts_per_token": c.top_k, "num_shared_experts": c.n_shared_experts,
        "moe_intermediate_size": c.expert_dim, "routed_expert_hidden_size": c.latent_dim,
        "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": c.routed_scaling_factor, "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "attn_res_block_size": c.attn_res_block_size,
        "rms_norm_eps": c.rms_norm_eps, "num_nextn_predict_layers": 0, "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
        "initializer_range": c.initializer_range, "dtype": c.dtype, "use_cache": True,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full, "num_heads": c.kda_num_heads,
                               "head_dim": c.kda_head_dim, "short_conv_kernel_size": c.kda_conv_size,
                               "gate_lower_bound": c.kda_gate_lower_bound, "use_full_rank_gate": True},
    })
    tc.pop("torch_dtype", None)
    if c.mla_lowrank_norm_eps != 1e-6:  # not a released key: written only when it differs from the reference's
        tc["mla_lowrank_norm_eps"] = c.mla_lowrank_norm_eps
    else:
        tc.pop("mla_lowrank_norm_eps", None)
    if c.qb_num_bins != 1000:
        tc["qb_num_bins"] = c.qb_num_bins
    if quantized:
        tc["quantization_config"] = json.loads(json.dumps(MXFP4_QUANT_CONFIG))
    else:
        tc.pop("quantization_config", None)
    out: dict[str, Any] = {k: v for k, v in (base or {}).items() if k not in ("text_config", "quantization_config")}
    out.update({
        "architectures": out.get("architectures", ["KimiK3ForConditionalGeneration"]), "model_type": "kimi_k3",
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
        "dtype": c.dtype, "tie_word_embeddings": c.tie_word_embeddings, "text_config": tc,
    })
    if quantized:  # loaders copy it to the top level too
        out["quantization_config"] = tc["quantization_config"]
    return out


def read_released_config(path: str | Path, verbose: bool = False) -> tuple[K3Config, ReleasedInfo]:
    """``config.json`` of a checkpoint folder → ``(K3Config, info)``; ``ValueError`` if it is not a K3 folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory: expected a Kimi K3 checkpoint folder")
    cfg = folder / CONFIG_NAME
    if not cfg.is_file():
        raise ValueError(f"{folder} is not a Kimi K3 checkpoint: no {CONFIG_NAME}")
    raw = read_json(confined(folder, CONFIG_NAME, "the config file"), str(cfg))
    return config_from_released(raw, verbose=verbose)


# =================================================================================================================
# name mapping
# =================================================================================================================
def released_name(model_key: str) -> str:
    """Non-expert model key → checkpoint name (the expert stacks map to many names; see ``_plan``)."""
    return PREFIX + model_key


def _a_log_size(heads: int) -> int:
    return math.ceil(heads / 128) * 128


@dataclass
class _Slot:
    """Where one checkpoint tensor goes: model key (param/buffer), optional expert index, expected shape/dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    expert: int | None = None
    part: str | None = None  # "packed" / "scale" when a dequantising load needs both halves


def _plan(model: nn.Module, ckpt_dtype: torch.dtype, quantized: bool) -> dict[str, _Slot]:
    """Every checkpoint name the model needs → its slot (derived from the meta model's state_dict)."""
    plan: dict[str, _Slot] = {}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for key, t in model.state_dict(keep_vars=True).items():
        if tied and key == "lm_head.weight":
            continue
        m = re.match(r"^(.*\.experts)\.(w[123])(_packed|_scale)?$", key)
        if m is not None:
            base, w, part = m.groups()
            mod = model.get_submodule(base)
            E = t.shape[0]
            for e in range(E):
                stem = f"{PREFIX}{base}.{e}.{w}"
                if isinstance(mod, MXFP4GroupedExperts):
                    plan[f"{stem}.weight{part}"] = _Slot(key, tuple(t.shape[1:]), torch.uint8, e)
                elif quantized:  # dequantise into the stacked dense parameter
                    out_f, in_f = t.shape[1:]
                    plan[f"{stem}.weight_packed"] = _Slot(key, (out_f, in_f // 2), torch.uint8, e, "packed")
                    plan[f"{stem}.weight_scale"] = _Slot(key, (out_f, in_f // GROUP), torch.uint8, e, "scale")
                else:
                    plan[f"{stem}.weight"] = _Slot(key, tuple(t.shape[1:]), ckpt_dtype, e)
            continue
        shape = tuple(t.shape)
        if key.endswith(".self_attn.A_log"):
            shape = (_a_log_size(shape[0]),)
        plan[released_name(key)] = _Slot(key, shape, torch.float32 if keeps_fp32(key) else ckpt_dtype)
    return plan


# =================================================================================================================
# loading
# =================================================================================================================
def _weight_map(folder: Path) -> dict[str, str]:
    """Checkpoint tensor name → shard file name, from the index (or the single ``model.safetensors``)."""
    index = folder / INDEX_NAME
    if index.is_file():
        raw = read_json(confined(folder, INDEX_NAME, "the index"), str(index), max_bytes=INDEX_MAX_BYTES)
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise ValueError(f"{index} has no weight_map")
        for shard in set(wm.values()) if all(isinstance(v, str) for v in wm.values()) else wm.values():
            confined(folder, shard, f"{INDEX_NAME} weight_map")
        missing = sorted({f for f in wm.values() if not (folder / f).is_file()})
        if missing:
            raise ValueError(f"{folder}: shard(s) listed in {INDEX_NAME} are missing: {', '.join(missing[:4])}"
                             + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""))
        return wm
    single = folder / SINGLE_NAME
    if single.is_file():
        path = confined(folder, SINGLE_NAME, "the weights file")
        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: SINGLE_NAME for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types for torn files
            raise ValueError(f"{single} is not a readable safetensors file: {e}") from None
    raise ValueError(f"{folder} is not a Kimi K3 checkpoint: neither {INDEX_NAME} nor {SINGLE_NAME}")


def _check_names(wm: dict[str, str], plan: dict[str, _Slot], num_layers: int, mtp: int, verbose: bool
                 ) -> None:
    missing = [n for n in plan if n not in wm]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[0]!r} "
                         "(config.json and the weights disagree?)")
    skipped = [n for n in wm if n.startswith(SKIPPED_PREFIXES)]
    if skipped:
        _note(f"skipping {len(skipped)} image-encoder tensors (vision_tower.*, mm_projector.*): text only", verbose)
    extra = [n for n in wm if n not in plan and not n.startswith(SKIPPED_PREFIXES)]
    mtp_re = re.compile(rf"^{re.escape(PREFIX)}model\.layers\.(\d+)\.")
    mtp_names = [n for n in extra if mtp and (m := mtp_re.match(n)) and int(m.group(1)) >= num_layers]
    if mtp_names:
        _note(f"skipping {len(mtp_names)} multi-token-prediction tensors", verbose)
    extra = [n for n in extra if n not in set(mtp_names)]
    if extra:
        raise ValueError(f"checkpoint has {len(extra)} tensor(s) this config does not use, e.g. {extra[0]!r} "
                         "(config.json and the weights disagree?)")


class _Filler:
    """Assigns checkpoint tensors into a meta-built model, allocating stacked expert tensors on first touch."""

    def __init__(self, model: nn.Module, device: torch.device, dtype_of: dict[str, torch.dtype]) -> None:
        self.model, self.device, self.dtype_of = model, device, dtype_of
        self.filled: dict[str, set[int] | bool] = {}
        self.pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def _owner(self, key: str) -> tuple[nn.Module, str]:
        mod_name, _, attr = key.rpartition(".")
        return (self.model.get_submodule(mod_name) if mod_name else self.model), attr

    def _assign(self, key: str, value: torch.Tensor) -> None:
        mod, attr = self._owner(key)
        if attr in mod._parameters:
            old = mod._parameters[attr]
            mod._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad if old is not None else True)
        elif attr in mod._buffers:
            mod._buffers[attr] = value
        else:  # pragma: no cover - the plan comes from this model's state_dict
            raise AssertionError(f"{key} is neither a parameter nor a buffer")

    def _current(self, key: str) -> torch.Tensor:
        mod, attr = self._owner(key)
        return mod._parameters[attr] if attr in mod._parameters else mod._buffers[attr]

    def _stack(self, key: str) -> torch.Tensor:
        """The stacked expert tensor of ``key`` on the target device (allocated the first time)."""
        cur = self._current(key)
        if cur.is_meta:
            self._assign(key, torch.empty(cur.shape, dtype=self.dtype_of[key], device=self.device))
            cur = self._current(key)
        return cur

    def put(self, slot: _Slot, t: torch.Tensor) -> None:
        want = self.dtype_of[slot.key]
        if slot.expert is None:
            if slot.key.endswith(".self_attn.A_log"):
                t = t[: self._current(slot.key).shape[0]]
            self._assign(slot.key, t.to(device=self.device, dtype=want).contiguous())
            self.filled[slot.key] = True
            return
        if slot.part is not None:  # dequantising load: wait for the other half of the pair
            halves = self.pending.setdefault((slot.key, slot.expert), {})
            halves[slot.part] = t
            if len(halves) < 2:
                return
            del self.pending[(slot.key, slot.expert)]
            t = dequantize_mxfp4(halves["packed"].to(self.device), halves["scale"].to(self.device), dtype=want)
        with torch.no_grad():
            self._stack(slot.key)[slot.expert].copy_(t.to(device=self.device, dtype=want))
        done = self.filled.setdefault(slot.key, set())
        assert isinstance(done, set)
        done.add(slot.expert)


def _read_shard(folder: Path, shard: str, names: list[str], plan: dict[str, _Slot]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for ``names`` of one shard, checking dtype and shape before reading the bytes."""
    path = confined(folder, shard, f"{INDEX_NAME} weight_map")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for torn files
        raise ValueError(f"{folder / shard} is not a readable safetensors file: {e}") from None
    with handle as f:
        present = set(f.keys())
        for name in names:
            if name not in present:
                raise ValueError(f"{shard} lacks tensor {name!r} that {INDEX_NAME} places there")
            sl = f.get_slice(name)
            dtype = _ST_DTYPES.get(sl.get_dtype())
            shape = tuple(sl.get_shape())
            slot = plan[name]
            if dtype != slot.dtype or shape != slot.shape:
                raise ValueError(f"tensor {name!r} is {sl.get_dtype()} {list(shape)}, expected "
                                 f"{str(slot.dtype).removeprefix('torch.')} {list(slot.shape)}")
            yield name, f.get_tensor(name)


def _swap_in_mxfp4(model: nn.Module) -> None:
    for moe in (m for m in model.modules() if isinstance(m, LatentMoE)):
        e = moe.experts
        moe.experts = MXFP4GroupedExperts(e.n_experts, e.latent_dim, e.expert_dim, e.beta1, e.beta2, device="meta")


def load_pretrained(path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                    dequantize: bool = False, verbose: bool = True, force_memory: bool = False) -> K3ForCausalLM:
    """Build ``K3ForCausalLM`` from a released-layout folder (see the module docstring) and return it in eval mode.

    ``device``: where the weights go (default CPU).  ``dtype``: the dtype of the bf16-class weights (default: the
    checkpoint's); fp32 tensors stay fp32, MXFP4 experts stay uint8.  ``dequantize``: turn MXFP4 experts into dense
    ``dtype`` weights (``GroupedExperts``, trainable) instead of keeping them 4-bit (``MXFP4GroupedExperts``).
    Before anything is allocated, the model's bytes are estimated on ``meta`` and a model that cannot fit
    ``device``'s memory is refused (``ValueError``) unless ``force_memory``. Every file name the folder's index
    gives is confined to the folder.
    """
    folder = Path(path)
    config, info = read_released_config(folder, verbose=verbose)
    ckpt_dtype = _DTYPES[config.dtype]
    if dtype is not None:
        names = {v: k for k, v in _DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} as a torch.dtype, got {dtype!r}")
        config = K3Config.from_dict({**config.to_dict(), "dtype": names[dtype]})
    dev = torch.device(device) if device is not None else torch.device("cpu")
    check_fits(model_footprint(config, mxfp4_experts=info.quantized and not dequantize), dev, force_memory,
               config=config)
    wm = _weight_map(folder)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    if info.quantized and not dequantize:
        _swap_in_mxfp4(model)
    plan = _plan(model, ckpt_dtype, info.quantized)
    _check_names(wm, plan, config.num_layers, info.mtp_layers, verbose)
    dtype_of = {k: t.dtype for k, t in model.state_dict(keep_vars=True).items()}
    filler = _Filler(model, dev, dtype_of)
    by_shard: dict[str, list[str]] = {}
    for name in plan:
        by_shard.setdefault(wm[name], []).append(name)
    for shard in sorted(by_shard):
        for name, t in _read_shard(folder, shard, by_shard[shard], plan):
            filler.put(plan[name], t)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [k for k, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    assert not left and not filler.pending, f"unfilled after load: {left[:3]} {list(filler.pending)[:3]}"
    model._k3_released_config = info.raw  # lets save_pretrained keep the wrapper's other fields (vision_config…)
    return model.eval()


# =================================================================================================================
# saving
# =================================================================================================================
def _entries(model: nn.Module, save_dtype: torch.dtype, quantize: bool
             ) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, Any]]:
    """``(checkpoint name, shape, dtype, make)`` for every tensor to write, in model order; ``make()`` produces the
    CPU tensor only when its shard is written."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    seen_experts: set[str] = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if tied and key == "lm_head.weight":
            continue
        m = re.match(r"^(.*\.experts)\.(w[123])(_packed|_scale)?$", key)
        if m is not None:
            base = m.group(1)
            if base in seen_experts:
                continue
            seen_experts.add(base)
            yield from _expert_entries(model.get_submodule(base), base, save_dtype, quantize,
                                       isinstance(model.get_submodule(base), MXFP4GroupedExperts))
            continue
        want = torch.float32 if keeps_fp32(key) else save_dtype
        if key.endswith(".self_attn.A_log"):
            size = _a_log_size(t.shape[0])
            yield (released_name(key), (size,), want,
                   lambda t=t, size=size: torch.nn.functional.pad(t.detach().to("cpu", torch.float32),
                                                                  (0, size - t.shape[0])))
        else:
            yield released_name(key), tuple(t.shape), want, lambda t=t, want=want: t.detach().to("cpu", want)


def _expert_entries(mod: nn.Module, base: str, save_dtype: torch.dtype, quantize: bool, is_mxfp4: bool
                    ) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, Any]]:
    """Per-expert checkpoint tensors, experts outermost (e, then w1, w3, w2) as in the release."""
    E = mod.n_experts
    for e in range(E):
        for w in ("w1", "w3", "w2"):
            stem = f"{PREFIX}{base}.{e}.{w}"
            if is_mxfp4:
                for part in ("packed", "scale"):
                    buf = getattr(mod, f"{w}_{part}")
                    yield (f"{stem}.weight_{part}", tuple(buf.shape[1:]), torch.uint8,
                           lambda buf=buf, e=e: buf[e].detach().to("cpu").clone())
                continue
            p = getattr(mod, w)
            out_f, in_f = p.shape[1:]
            if quantize:
                cache: dict[str, torch.Tensor] = {}

                def half(part: str, p: torch.Tensor = p, e: int = e, cache: dict = cache) -> torch.Tensor:
                    if not cache:
                        cache["packed"], cache["scale"] = quantize_mxfp4(p[e].detach().float().cpu())
                    return cache.pop(part)

                yield f"{stem}.weight_packed", (out_f, in_f // 2), torch.uint8, lambda half=half: half("packed")
                yield f"{stem}.weight_scale", (out_f, in_f // GROUP), torch.uint8, lambda half=half: half("scale")
            else:
                yield f"{stem}.weight", (out_f, in_f), save_dtype, lambda p=p, e=e: p[e].detach().to("cpu", save_dtype).clone()


def _shard_plan(entries: list[tuple[str, tuple[int, ...], torch.dtype, Any]], max_bytes: int
                ) -> list[list[tuple[str, tuple[int, ...], torch.dtype, Any]]]:
    shards: list[list[Any]] = [[]]
    size = 0
    for ent in entries:
        nbytes = math.prod(ent[1]) * torch.empty(0, dtype=ent[2]).element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(ent)
        size += nbytes
    return shards


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, MXFP4GroupedExperts) for m in model.modules())


def save_pretrained(model: nn.Module, path: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    quantize: bool | None = None, extra_files: list[str | Path] | None = None) -> None:
    """Write ``model`` in the released layout: ``config.json``, ``model-0000i-of-0000N.safetensors`` shards of at most
    ``max_shard_bytes`` (a larger single tensor gets a shard of its own) and ``model.safetensors.index.json``.

    ``quantize``: experts in MXFP4 (default: as the model holds them — MXFP4GroupedExperts stay packed byte for
    byte; ``True`` quantises dense experts by round-to-nearest).  The folder is built beside ``path`` and renamed into
    place, so a crash leaves the old folder or the new one; files of an existing ``path`` that are not weights or
    config (the tokenizer, say) are carried over, and ``extra_files`` are copied in.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    config: K3Config = model.config
    held = _is_quantized(model)
    if quantize is None:
        quantize = held
    if held and not quantize:
        raise ValueError("quantize=False needs dense experts: this model holds MXFP4 experts (load it with "
                         "dequantize=True to write a dequantised copy)")
    save_dtype = _DTYPES[config.dtype]
    entries = list(_entries(model, save_dtype, quantize))
    shards = _shard_plan(entries, max_shard_bytes)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        weight_map: dict[str, str] = {}
        total = 0
        n = len(shards)
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            tensors = {name: make() for name, _, _, make in shard}
            for name, t in tensors.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        raw = config_to_released(config, quantized=quantize, base=getattr(model, "_k3_released_config", None))
        (tmp / CONFIG_NAME).write_text(json.dumps(raw, indent=2) + "\n")
        _carry_files(target, tmp, extra_files)
        _fsync_dir(tmp)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _carry_files(target: Path, tmp: Path, extra_files: list[str | Path] | None) -> None:
    ours = re.compile(r"^(model.*\.safetensors|model\.safetensors\.index\.json|config\.json)$")
    if target.is_dir():
        for f in target.iterdir():
            if f.is_file() and not ours.match(f.name):
                shutil.copy2(f, tmp / f.name)
    for f in extra_files or []:
        f = Path(f)
        if not f.is_file():
            raise ValueError(f"extra_files: {f} is not a file")
        shutil.copy2(f, tmp / f.name)


def _fsync_dir(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _replace_dir(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` is moved aside first and removed after."""
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory")
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rmdir(old)
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
