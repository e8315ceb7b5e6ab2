"""The memory estimate (``k3.memory``) counts exactly what the real model holds, and refuses what cannot fit."""

from __future__ import annotations

import pytest
import torch

from k3.config import K3Config
from k3.memory import available_memory, check_fits, model_footprint, training_footprint
from k3.model import K3ForCausalLM


def _held(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters + QB bias buffers, their bytes), tied tensors once: what the estimate must equal."""
    seen, n, nbytes = set(), 0, 0
    tensors = [*model.parameters(), *(b for k, b in model.named_buffers() if k.endswith("e_score_correction_bias"))]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel()
            nbytes += t.numel() * t.element_size()
    return n, nbytes


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True, "first_k_dense": 2, "mla_layers": [1, 3]},  # a dense MLA layer
    {"num_layers": 7, "first_k_dense": 0, "mla_layers": [], "dtype": "bfloat16"},  # KDA + MoE only
], ids=["tiny", "tied-dense-mla", "kda-moe-bf16"])
def test_estimate_equals_the_real_model(overrides):
    config = K3Config.from_preset("tiny", **overrides)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    fp = model_footprint(config)
    assert (fp.params, fp.bytes) == _held(model)
    assert fp.params == model.num_parameters()
    fp32 = model_footprint(config, dtype=torch.float32)
    assert fp32.bytes == 4 * fp32.params


def test_mxfp4_experts_and_training_parts():
    config = K3Config.from_preset("tiny")
    dense, packed = model_footprint(config), model_footprint(config, mxfp4_experts=True)
    assert packed.parts["routed experts"] * 4 * 32 == dense.parts["routed experts"] * 17
    t = training_footprint(config, batch_size=8, seq_len=64)
    assert t.parts["logits"] == 8 * 64 * config.vocab_size * 8
    assert t.parts["routed experts"] == 3 * dense.parts["routed experts"]  # fp32 weights + grads + momentum
    assert training_footprint(config, 8, 64, optimizer="adamw").bytes > t.bytes


def test_refusal_names_fields_and_force_skips_it():
    config = K3Config.from_preset("tiny", n_experts=10**8)
    fp = model_footprint(config)
    with pytest.raises(ValueError, match=r"loading the model needs at least .* routed experts .*n_experts=100000000"):
        check_fits(fp, "cpu", config=config)
    check_fits(fp, "cpu", force=True)
    check_fits(model_footprint(K3Config.from_preset("tiny")), "cpu")
    assert 0 < available_memory("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_estimate_matches_allocation_and_refuses_k3():
    config = K3Config.from_preset("small")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        model = K3ForCausalLM(config)
    allocated = torch.cuda.memory_allocated() - before
    fp = model_footprint(config)
    assert abs(allocated - fp.bytes) <= 0.01 * fp.bytes, (allocated, fp.bytes)
    del model
    with pytest.raises(ValueError, match="cuda has .* available"):
        check_fits(model_footprint(K3Config.from_preset("k3")), "cuda", config=K3Config.from_preset("k3"))
