"""K3ForCausalLM: one-shot == piecewise == token-by-token decode, the loss contract, training on a small batch,
gradients of every used parameter, QB through the model, activation checkpointing, meta-device parameter counts
of the released shape, and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

import k3_runs

from k3.config import K3Config
from k3.model import K3ForCausalLM, keeps_fp32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def tiny(seed: int = 0, **kw) -> K3ForCausalLM:
    return k3_runs.tiny_model(seed, **kw)


# --- decode --------------------------------------------------------------------------------------------------------
def test_one_shot_piecewise_token_by_token_agree() -> None:
    model = tiny(0).eval()
    ids = torch.randint(0, 256, (2, 37))
    with torch.no_grad():
        full = model(ids).logits
        st = model.init_state(2)
        pieces = [model(ids[:, a:b], state=st).logits for a, b in [(0, 1), (1, 17), (17, 18), (18, 37)]]
        assert st.position == 37
        assert rel(torch.cat(pieces, 1), full) <= 1e-5
        st = model.init_state(2)
        toks = [model(ids[:, t:t + 1], state=st).logits for t in range(37)]
        assert rel(torch.cat(toks, 1), full) <= 1e-5
    assert sum(1 for s in st.layers if hasattr(s, "recurrent")) == 3 and st.lengths.tolist() == [37, 37]


def test_decode_equivalence_without_mla_and_with_reference_kda() -> None:
    model = tiny(1, mla_layers=[])
    model.set_kda_impl("reference")
    model.eval()
    ids = torch.randint(0, 256, (1, 13))
    with torch.no_grad():
        full = model(ids).logits
        st = model.init_state(1)
        toks = torch.cat([model(ids[:, t:t + 1], state=st).logits for t in range(13)], 1)
    assert rel(toks, full) <= 1e-5
    assert st.nbytes() == 4 * (2 * 32 * 32 * 4 + 3 * 3 * 64 * 4)  # fixed size: S fp32 + three conv tails


# --- loss -----------------------------------------------------------------------------------------------------------
def test_loss_is_shifted_next_token_cross_entropy_with_ignore_index() -> None:
    model = tiny(2)
    ids = torch.randint(0, 256, (2, 9))
    labels = ids.clone()
    labels[0, 4] = -100
    out = model(ids, labels=labels)
    want = F.cross_entropy(out.logits[:, :-1].reshape(-1, 260).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100)
    assert out.loss.dtype == torch.float32 and rel(out.loss, want) < 1e-6
    assert model(ids).loss is None
    assert float(model(ids[:, :1], labels=ids[:, :1]).loss.detach()) == 0.0  # no target: 0, not NaN


def test_every_used_parameter_gets_a_finite_nonzero_gradient() -> None:
    model = tiny(3).train()  # pseudo-queries away from 0, else the AttnRes gains' gradients are exactly 0
    ids = torch.randint(0, 256, (2, 16))
    model(ids, labels=ids).loss.backward()
    never_read = {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    for name, p in model.named_parameters():
        if name in never_read:
            assert p.grad is None, name  # layer 0 uses the embedding directly (K3 rule)
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name


def test_loss_falls_on_a_small_batch() -> None:
    torch.manual_seed(3)
    model = K3ForCausalLM(K3Config.from_preset("tiny")).train()  # the training init: zero pseudo-queries
    ids = torch.randint(0, 256, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        out = model(ids, labels=ids)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        model.qb_step()
        losses.append(float(out.loss.detach()))
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.1 * losses[0], losses  # memorising 32 tokens: ~5.6 → ~0.02 in 20 steps
    assert 1.0 <= model.load_imbalance() < 8.0


def test_gradient_checkpointing_same_grads_and_qb_counted_once() -> None:
    ids = torch.randint(0, 256, (2, 11))
    grads, hists = [], []
    for ckpt in (False, True):
        model = tiny(4).train()
        model.gradient_checkpointing_enable(ckpt)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        hists.append([m.gate.qb_hist.clone() for m in model.moe_layers()])
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert rel(grads[1][n], grads[0][n]) < 1e-6, n
    for a, b in zip(*hists):
        assert torch.equal(a, b) and int(a.sum()) == 2 * 11 * 8


# --- Quantile Balancing through the model ----------------------------------------------------------------------
def test_qb_step_only_from_training_forwards() -> None:
    model = tiny(5)
    ids = torch.randint(0, 256, (2, 16))
    biases = lambda: torch.stack([m.gate.e_score_correction_bias.clone() for m in model.moe_layers()])  # noqa: E731
    b0 = biases()
    model.eval()
    model(ids)
    model.train()
    with torch.no_grad():
        model(ids)
    model.qb_step()
    assert torch.equal(biases(), b0) and math.isnan(model.load_imbalance())
    model(ids, labels=ids)
    assert torch.equal(biases(), b0)  # accumulated, not yet applied
    model.qb_step()
    b1 = biases()
    assert not torch.equal(b1, b0) and b1.abs().sum(1).gt(0).all()
    assert all(int(m.gate.qb_hist.sum()) == 0 for m in model.moe_layers())  # reset
    assert all(m.gate.e_score_correction_bias.dtype == torch.float32 for m in model.moe_layers())
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in model.state_dict()


# --- construction ---------------------------------------------------------------------------------------------
def test_released_shape_builds_on_meta_and_counts_2_78T_total_104_2B_active() -> None:
    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.from_preset("k3"))
    total, active = model.num_parameters(), model.num_parameters(active=True)
    assert abs(total / 2.78e12 - 1) < 0.01, total
    assert abs(active / 104.2e9 - 1) < 0.01, active
    layers = model.model.layers
    assert [i for i, l in enumerate(layers) if type(l.self_attn).__name__ == "GatedMLA"] == list(range(3, 92, 4)) + [92]
    assert hasattr(layers[0], "mlp") and all(hasattr(l, "block_sparse_moe") for l in layers[1:])
    sd = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    assert sd["model.layers.0.self_attn.A_log"] == ((96,), torch.float32)
    assert sd["model.layers.0.mlp.gate_proj.weight"] == ((33792, 7168), torch.bfloat16)
    assert sd["model.layers.1.block_sparse_moe.experts.w1"] == ((896, 3072, 3584), torch.bfloat16)
    assert sd["model.layers.1.block_sparse_moe.experts.w2"] == ((896, 3584, 3072), torch.bfloat16)
    assert sd["model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight"] == ((6144, 7168), torch.bfloat16)
    assert sd["model.layers.3.self_attn.kv_b_proj.weight"] == ((24576, 512), torch.bfloat16)
    assert sd["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == ((576, 7168), torch.bfloat16)
    assert sd["model.output_attn_res_proj.weight"] == ((1, 7168), torch.bfloat16)
    assert sd["lm_head.weight"] == ((163840, 7168), torch.bfloat16)
    for k, (_, dt) in sd.items():
        assert (dt == torch.float32) == keeps_fp32(k), k
    # decode state of one sequence: 69 fp32 KDA states [96, 128, 128] + bf16 conv tails, fixed size
    st = model.init_state(1, device="meta")
    kda = [s for s in st.layers if hasattr(s, "recurrent")]
    assert len(kda) == 69 and sum(s.recurrent.numel() * 4 for s in kda) == 434_110_464
    assert sum(t.numel() * t.element_size() for s in kda for t in s.conv) == 15_261_696
    assert all(s.buf.shape[-1] == 576 for s in st.layers if not hasattr(s, "recurrent"))  # latent per token


def test_init_values() -> None:
    model = K3ForCausalLM(K3Config.from_preset("tiny"))
    for name, p in model.named_parameters():
        if name.endswith("_res_proj.weight") or name.endswith("A_log"):
            assert (p == 0).all(), name
        elif name.endswith("norm.weight"):
            assert (p == 1).all(), name
    w = model.model.layers[1].block_sparse_moe.experts.w1
    assert abs(float(w.std()) - 0.02) < 0.004


def test_bf16_model_trains_a_step() -> None:
    torch.manual_seed(6)
    model = K3ForCausalLM(K3Config.from_preset("tiny", dtype="bfloat16")).train()
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_conv1d.weight.dtype == torch.float32
    ids = torch.randint(0, 256, (2, 12))
    out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- bad input --------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_value_error_naming_the_argument() -> None:
    model = tiny(7)
    ids = torch.randint(0, 256, (2, 5))
    with pytest.raises(ValueError, match="input_ids"):
        model(ids.float())
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[0])
    with pytest.raises(ValueError, match="input_ids"):
        model(ids.tolist())
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.full((1, 3), 260))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.full((1, 3), -1))
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[:, :0])
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids[:, :4])
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=torch.full_like(ids, 260))
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids.float())
    with pytest.raises(ValueError, match="state"):
        model(ids, state=model.init_state(3))
    with pytest.raises(ValueError, match="state"):
        model(ids, state=model.init_state(2, device="meta"))
    with pytest.raises(ValueError, match="state"):
        model(ids, state={"layers": []})
    with pytest.raises(ValueError, match="batch_size"):
        model.init_state(0)
    with pytest.raises(ValueError, match="config"):
        K3ForCausalLM({"hidden_size": 8})
    with pytest.raises(ValueError, match="impl"):
        model.set_kda_impl("fast")
