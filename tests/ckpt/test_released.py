"""Released K3 checkpoint layout: a miniature checkpoint written here by hand (names, dtypes, MXFP4 packing, A_log
padding, sharded index, 1-based layer lists, vision tensors) must load into a model whose logits match the model
built in memory from the same weights; load → save must reproduce every tensor bit-exactly; bad folders, shards,
tensors and configs must raise one-line ValueErrors.

The writer below spells the released names out independently of ``k3.ckpt.released``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3.ckpt.released import config_from_released, config_to_released, load_pretrained, save_pretrained
from k3.config import K3Config
from k3.layers.experts_mxfp4 import MXFP4GroupedExperts
from k3.layers.moe import GroupedExperts
from k3.model import K3ForCausalLM
from k3.ops.moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4

# ---------------------------------------------------------------------------------------------------------------
# a miniature release: 7 layers (1-based KDA 1,2,3,5; MLA 4 and the last two, 6,7), AttnRes blocks of 3
# ---------------------------------------------------------------------------------------------------------------
L, D, V = 7, 64, 300
H_KDA, DK = 2, 16
H_MLA, Q_LORA, KV_LORA, NOPE, ROPE, VD = 2, 32, 32, 16, 8, 16
DENSE, E, TOPK, F, LAT, NSH = 96, 8, 2, 64, 32, 2


def mini_config_json(**text_overrides) -> dict:
    kda = [l for l in range(1, L + 1) if l <= L - 2 and l % 4 != 0]
    full = [l for l in range(1, L + 1) if l not in kda]
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": V, "hidden_size": D,
        "num_hidden_layers": L, "intermediate_size": DENSE, "num_attention_heads": H_MLA,
        "num_key_value_heads": H_MLA, "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE, "v_head_dim": VD, "mla_use_nope": True, "mla_use_output_gate": True,
        "max_position_embeddings": 4096, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": E,
        "num_experts_per_token": TOPK, "num_shared_experts": NSH, "moe_intermediate_size": F,
        "routed_expert_hidden_size": LAT, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "attn_res_block_size": 3, "rms_norm_eps": 1e-5,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 258,
        "pad_token_id": 299, "initializer_range": 0.02, "dtype": "bfloat16", "use_cache": True,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full, "num_heads": H_KDA, "head_dim": DK,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                          "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                      "strategy": "group", "symmetric": True,
                                                      "scale_dtype": "torch.uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*lm_head.*"]},
    }
    text.update(text_overrides)
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "bos_token_id": 256,
            "eos_token_id": 258, "pad_token_id": 299, "dtype": "bfloat16", "tie_word_embeddings": False,
            "text_config": text, "vision_config": {"patch_size": 14, "vt_hidden_size": 16}}


def _w(g: torch.Generator, *shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(dtype)


def _gain(g: torch.Generator, n: int, dtype=torch.bfloat16) -> torch.Tensor:
    return (1 + 0.2 * torch.randn(n, generator=g)).to(dtype)


def mini_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the miniature release, in the released names/dtypes (experts already MXFP4)."""
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    mla = {l - 1 for l in mini_config_json()["text_config"]["linear_attn_config"]["full_attn_layers"]}
    for i in range(L):
        p = f"language_model.model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[p + n + ".weight"] = _gain(g, D)
        t[p + "self_attention_res_proj.weight"] = _w(g, 1, D)
        t[p + "mlp_res_proj.weight"] = _w(g, 1, D)
        a = p + "self_attn."
        if i in mla:
            t[a + "q_a_proj.weight"] = _w(g, Q_LORA, D)
            t[a + "q_a_layernorm.weight"] = _gain(g, Q_LORA)
            t[a + "q_b_proj.weight"] = _w(g, H_MLA * (NOPE + ROPE), Q_LORA)
            t[a + "kv_a_proj_with_mqa.weight"] = _w(g, KV_LORA + ROPE, D)
            t[a + "kv_a_layernorm.weight"] = _gain(g, KV_LORA)
            t[a + "kv_b_proj.weight"] = _w(g, H_MLA * (NOPE + VD), KV_LORA)
            t[a + "g_proj.weight"] = _w(g, H_MLA * VD, D)
            t[a + "o_proj.weight"] = _w(g, D, H_MLA * VD)
        else:
            P = H_KDA * DK
            for n in ("q", "k", "v"):
                t[a + f"{n}_proj.weight"] = _w(g, P, D)
                t[a + f"{n}_conv1d.weight"] = 0.5 * torch.randn(P, 1, 4, generator=g)
            t[a + "f_a_proj.weight"] = _w(g, DK, D)
            t[a + "f_b_proj.weight"] = _w(g, P, DK)
            t[a + "dt_bias"] = torch.randn(P, generator=g)
            t[a + "A_log"] = torch.cat([torch.randn(H_KDA, generator=g), torch.zeros(128 - H_KDA)])  # released pad
            t[a + "b_proj.weight"] = _w(g, H_KDA, D)
            t[a + "g_proj.weight"] = _w(g, P, D)
            t[a + "o_norm.weight"] = 1 + 0.2 * torch.randn(DK, generator=g)
            t[a + "o_proj.weight"] = _w(g, D, P)
        if i == 0:
            t[p + "mlp.gate_proj.weight"] = _w(g, DENSE, D)
            t[p + "mlp.up_proj.weight"] = _w(g, DENSE, D)
            t[p + "mlp.down_proj.weight"] = _w(g, D, DENSE)
            continue
        m = p + "block_sparse_moe."
        t[m + "gate.weight"] = _w(g, E, D)
        t[m + "gate.e_score_correction_bias"] = 0.1 * torch.randn(E, generator=g)
        t[m + "routed_expert_down_proj.weight"] = _w(g, LAT, D)
        t[m + "routed_expert_norm.weight"] = _gain(g, LAT)
        t[m + "routed_expert_up_proj.weight"] = _w(g, D, LAT)
        t[m + "shared_experts.gate_proj.weight"] = _w(g, NSH * F, D)
        t[m + "shared_experts.up_proj.weight"] = _w(g, NSH * F, D)
        t[m + "shared_experts.down_proj.weight"] = _w(g, D, NSH * F)
        for e in range(E):
            for w, (o, n) in (("w1", (F, LAT)), ("w3", (F, LAT)), ("w2", (LAT, F))):
                packed, scale = quantize_mxfp4(torch.randn(o, n, generator=g) / math.sqrt(n))
                t[m + f"experts.{e}.{w}.weight_packed"] = packed
                t[m + f"experts.{e}.{w}.weight_scale"] = scale
    t["language_model.model.embed_tokens.weight"] = _w(g, V, D) * 8
    t["language_model.lm_head.weight"] = _w(g, V, D)
    t["language_model.model.norm.weight"] = _gain(g, D)
    t["language_model.model.output_attn_res_norm.weight"] = _gain(g, D)
    t["language_model.model.output_attn_res_proj.weight"] = _w(g, 1, D)
    t["vision_tower.patch_embed.proj.weight"] = _w(g, 16, 3, 14, 14)  # skipped by the loader
    t["mm_projector.proj.0.weight"] = _w(g, 16, 16)
    return t


def write_mini_release(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> None:
    """Shards as in the release: layers spread over several files (one layer's experts straddle two), the global
    tensors in their own shard, the image encoder in the last; plus the index and config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    layer_names = [n for n in tensors if ".layers." in n]
    groups = [layer_names[k * len(layer_names) // 3:(k + 1) * len(layer_names) // 3] for k in range(3)]
    groups.append([n for n in tensors if n.startswith("language_model.") and ".layers." not in n])
    groups.append([n for n in tensors if not n.startswith("language_model.")])
    weight_map, total = {}, 0
    for k, names in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config or mini_config_json()))


def in_memory_model(tensors: dict[str, torch.Tensor], dtype=torch.float32) -> K3ForCausalLM:
    """The same weights put into a K3ForCausalLM by hand (experts dequantised and stacked)."""
    cfg = K3Config(vocab_size=V, hidden_size=D, num_layers=L, mla_layers=(3, 5, 6), max_seq_len=4096,
                   bos_token_id=256, eos_token_id=258, pad_token_id=299, kda_num_heads=H_KDA, kda_head_dim=DK,
                   mla_num_heads=H_MLA, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
                   qk_rope_head_dim=ROPE, v_head_dim=VD, dense_intermediate_size=DENSE, n_experts=E, top_k=TOPK,
                   expert_dim=F, latent_dim=LAT, n_shared_experts=NSH, attn_res_block_size=3,
                   dtype=str(dtype).removeprefix("torch."))
    model = K3ForCausalLM(cfg)
    sd = {}
    for name, t in tensors.items():
        if not name.startswith("language_model.") or ".experts." in name:
            continue
        key = name.removeprefix("language_model.")
        sd[key] = t[:H_KDA] if key.endswith("A_log") else t
    for i in range(1, L):
        p = f"language_model.model.layers.{i}.block_sparse_moe.experts."
        for w in ("w1", "w3", "w2"):
            sd[f"model.layers.{i}.block_sparse_moe.experts.{w}"] = torch.stack([
                dequantize_mxfp4(tensors[p + f"{e}.{w}.weight_packed"], tensors[p + f"{e}.{w}.weight_scale"],
                                 torch.float32) for e in range(E)])
    model.load_state_dict({k: v.to(torch.float32 if model.state_dict()[k].dtype == torch.float32 else dtype)
                           for k, v in sd.items()}, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("k3_release") / "Kimi-K3-mini"
    tensors = mini_tensors()
    write_mini_release(folder, tensors)
    return folder, tensors


IDS = torch.tensor([[1, 17, 255, 3, 99, 42, 7, 8, 200, 256, 5], [9, 0, 12, 299, 44, 41, 40, 6, 150, 2, 77]])


# ---------------------------------------------------------------------------------------------------------------
def test_load_keeps_mxfp4_and_matches_in_memory_model(release, capsys):
    folder, tensors = release
    model = load_pretrained(folder, dtype=torch.float32)
    assert "vision_tower" in capsys.readouterr().err  # the one-line note about the skipped image encoder
    assert not model.training
    moes = [l.block_sparse_moe for l in model.model.layers[1:]]
    assert all(isinstance(m.experts, MXFP4GroupedExperts) for m in moes)
    assert isinstance(model.model.layers[0].mlp.gate_proj.weight, torch.nn.Parameter)
    # the 4-bit bytes are the file's bytes
    p = "language_model.model.layers.2.block_sparse_moe.experts.5.w2."
    assert torch.equal(moes[1].experts.w2_packed[5], tensors[p + "weight_packed"])
    assert torch.equal(moes[1].experts.w2_scale[5], tensors[p + "weight_scale"])
    # A_log sliced to H, fp32 tensors kept fp32
    attn = model.model.layers[0].self_attn
    assert attn.A_log.shape == (H_KDA,) and attn.A_log.dtype == torch.float32
    assert model.model.layers[3].self_attn.q_a_layernorm.eps == 1e-6
    ref = in_memory_model(tensors)
    with torch.no_grad():
        got, want = model(IDS).logits, ref(IDS).logits
    assert torch.isfinite(want).all() and want.std() > 0.1
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_dequantized_load_equals_in_memory_model(release):
    folder, tensors = release
    model = load_pretrained(folder, dtype=torch.float32, dequantize=True, verbose=False)
    assert all(isinstance(l.block_sparse_moe.experts, GroupedExperts) for l in model.model.layers[1:])
    ref = in_memory_model(tensors)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert sd.keys() == ref_sd.keys()
    for k in sd:
        assert sd[k].dtype == ref_sd[k].dtype and torch.equal(sd[k], ref_sd[k]), k
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def test_bf16_load_runs_and_keeps_checkpoint_dtypes(release):
    folder, _ = release
    model = load_pretrained(folder, verbose=False)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_conv1d.weight.dtype == torch.float32
    assert model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    with torch.no_grad():
        logits = model(IDS[:, :5]).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(folder / shard), framework="pt") as f:
            for k in f.keys():
                assert index[k] == shard
                out[k] = f.get_tensor(k)
    return out


def test_load_save_reproduces_every_tensor_bit_exactly(release, tmp_path):
    folder, tensors = release
    model = load_pretrained(folder, verbose=False)
    out = tmp_path / "saved"
    (tmp_path / "saved").mkdir()
    (out / "tiktoken.model").write_text("keep me\n")  # non-weight files of the target survive
    save_pretrained(model, out, max_shard_bytes=200_000)
    saved = _read_all(out)
    original = {k: v for k, v in tensors.items() if k.startswith("language_model.")}
    assert saved.keys() == original.keys()
    for k, v in original.items():
        s = saved[k]
        assert s.dtype == v.dtype and s.shape == v.shape, k
        assert torch.equal(s.view(torch.uint8), v.contiguous().view(torch.uint8)), k  # bytes, not just values
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (out / "tiktoken.model").read_text() == "keep me\n"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["vision_config"] == mini_config_json()["vision_config"]
    assert config_from_released(cfg)[0] == config_from_released(mini_config_json())[0]
    assert not list(tmp_path.glob(".saved.*"))  # no temp folder left behind
    # the saved folder loads again (and via the model's own entry points)
    again = load_pretrained(str(out), dtype=torch.float32, verbose=False)
    assert isinstance(again.model.layers[1].block_sparse_moe.experts, MXFP4GroupedExperts)


def test_dequantized_save_and_requantize(release, tmp_path):
    folder, tensors = release
    dense = load_pretrained(folder, dequantize=True, verbose=False)
    save_pretrained(dense, tmp_path / "dense", max_shard_bytes=10**9)
    files = _read_all(tmp_path / "dense")
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1."
    assert files[name + "weight"].dtype == torch.bfloat16 and name + "weight_packed" not in files
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert "quantization_config" not in cfg["text_config"]
    assert len(list((tmp_path / "dense").glob("model-*.safetensors"))) == 1
    reloaded = load_pretrained(tmp_path / "dense", verbose=False)  # unquantised layout loads too
    assert torch.equal(reloaded.model.layers[1].block_sparse_moe.experts.w1, dense.model.layers[1].block_sparse_moe.experts.w1)
    # quantize=True writes MXFP4 again; values on the grid come back exactly
    save_pretrained(dense, str(tmp_path / "q"), quantize=True)
    q = _read_all(tmp_path / "q")
    want = dequantize_mxfp4(tensors[name + "weight_packed"], tensors[name + "weight_scale"], torch.float32)
    assert torch.equal(dequantize_mxfp4(q[name + "weight_packed"], q[name + "weight_scale"], torch.float32), want)
    with pytest.raises(ValueError, match="quantize=False"):
        save_pretrained(load_pretrained(folder, verbose=False), tmp_path / "x", quantize=False)


# --- config ------------------------------------------------------------------------------------------------------
def released_k3_config() -> dict:
    """The released config.json's language-model part."""
    L93 = 93
    kda = [l for l in range(1, L93 + 1) if l <= 91 and l % 4 != 0]
    text = dict(mini_config_json()["text_config"])
    text.update({
        "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93, "intermediate_size": 33792,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 1048576,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584, "attn_res_block_size": 12, "bos_token_id": 163584,
        "eos_token_id": 163586, "pad_token_id": 163839,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": [l for l in range(1, 94) if l not in kda],
                               "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    })
    return {**mini_config_json(), "text_config": text}


def test_released_config_is_the_k3_preset():
    raw = released_k3_config()
    assert len(raw["text_config"]["linear_attn_config"]["kda_layers"]) == 69
    cfg, info = config_from_released(raw)
    assert info.quantized
    assert cfg == K3Config.from_preset("k3")
    assert cfg.mla_layers[-2:] == (91, 92) and cfg.layer_type(0) == "kda" and not cfg.is_moe(0)
    back = config_to_released(cfg, quantized=True, base=raw)
    assert back["text_config"]["linear_attn_config"] == raw["text_config"]["linear_attn_config"]
    assert config_from_released(back)[0] == cfg
    # a bare text config (kimi_linear) is accepted too
    assert config_from_released(raw["text_config"])[0] == cfg
    for preset in ("tiny", "small", "k3-linear"):
        c = K3Config.from_preset(preset)
        assert config_from_released(config_to_released(c, quantized=False))[0] == c


@pytest.mark.parametrize("change, message", [
    ({"linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2, "head_dim": 16}},
     "gate_lower_bound"),
    ({"linear_attn_config": {"full_attn_layers": [2], "num_heads": 2, "head_dim": 16, "gate_lower_bound": -5.0,
                             "use_full_rank_gate": False}}, "use_full_rank_gate"),
    ({"linear_attn_config": {"full_attn_layers": [2], "num_heads": 2, "num_v_heads": 4, "head_dim": 16,
                             "gate_lower_bound": -5.0}}, "GVA"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [2], "num_heads": 2, "head_dim": 16,
                             "gate_lower_bound": -5.0}}, "partition"),
    ({"mla_use_nope": False}, "rotary"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_unsupported_configs_raise(change, message):
    raw = mini_config_json(**change)
    if change.get("num_hidden_layers", 0) is None:
        raw["text_config"].pop("num_hidden_layers")
    with pytest.raises(ValueError, match=message) as err:
        config_from_released(raw)
    assert "\n" not in str(err.value)


def test_vision_config_is_ignored_with_a_note(capsys):
    config_from_released(mini_config_json(), verbose=True)
    assert "vision_config ignored" in capsys.readouterr().err


# --- bad folders -------------------------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a Kimi K3 checkpoint"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(mini_config_json()))
    with pytest.raises(ValueError, match="neither"):
        load_pretrained(tmp_path)


def test_missing_shard(release, tmp_path):
    folder = _copy(release[0], tmp_path / "c")
    (folder / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(ValueError, match="missing: model-00002-of-00005"):
        load_pretrained(folder, verbose=False)


def test_wrong_shape_dtype_missing_and_extra_tensor(release, tmp_path):
    _, tensors = release
    name = "language_model.model.layers.4.self_attn.q_proj.weight"
    for bad, msg in ((tensors[name][:-1], "expected bfloat16 \\[32, 64\\]"),
                     (tensors[name].float(), "is F32 \\[32, 64\\], expected bfloat16")):
        t = dict(tensors)
        t[name] = bad
        folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        write_mini_release(folder, t)
        with pytest.raises(ValueError, match=msg):
            load_pretrained(folder, verbose=False)
    packed = "language_model.model.layers.3.block_sparse_moe.experts.1.w3.weight_packed"
    t = dict(tensors)
    t[packed] = t[packed].to(torch.int8)
    write_mini_release(tmp_path / "i8", t)
    with pytest.raises(ValueError, match="is I8"):
        load_pretrained(tmp_path / "i8", verbose=False)
    t = {k: v for k, v in tensors.items() if k != packed}
    write_mini_release(tmp_path / "missing", t)
    with pytest.raises(ValueError, match="lacks 1 tensor"):
        load_pretrained(tmp_path / "missing", verbose=False)
    t = dict(tensors)
    t["language_model.model.layers.2.self_attn.surprise"] = torch.zeros(3)
    write_mini_release(tmp_path / "extra", t)
    with pytest.raises(ValueError, match="does not use"):
        load_pretrained(tmp_path / "extra", verbose=False)
