"""Regional compile with activation checkpointing (CPU, ``aot_eager``: what inductor is given, without code
generation): gradients equal the plain model's, and Quantile Balancing records each training forward once — the
checkpointed recompute in the backward records nothing."""

import copy

import pytest
import torch

from k3.config import K3Config
from k3.distributed.parallel_dims import ParallelDims
from k3.distributed.parallelize import parallelize_k3
from k3.model import K3ForCausalLM


@pytest.mark.parametrize("policy", ["full", "selective", "experts"])
def test_compiled_checkpointed_layers_match_and_record_qb_once(policy: str) -> None:
    torch.manual_seed(0)
    plain = K3ForCausalLM(K3Config.from_preset("tiny")).train()
    with torch.no_grad():  # AttnRes pseudo-queries start at zero: give every path a gradient signal
        for name, p in plain.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.5)
    model = parallelize_k3(copy.deepcopy(plain), ParallelDims(), None, compile="aot_eager",
                           activation_checkpointing=policy)
    assert model.model.gradient_checkpointing == policy and model.parallel.compiled
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    for m in (plain, model):
        m(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    for a, b in zip(model.moe_layers(), plain.moe_layers()):
        assert int(b.gate.qb_hist.sum()) == 2 * 24 * b.gate.n_experts  # each token once, every expert
        assert torch.equal(a.gate.qb_hist, b.gate.qb_hist) and torch.equal(a.last_load, b.last_load)


def test_experts_policy_is_refused_with_expert_parallel() -> None:
    """Under --ep the routed experts sit behind an all-to-all: recomputing them would run it again."""
    from k3.train.trainer import TrainArgs

    with pytest.raises(ValueError, match="activation-checkpointing experts"):
        TrainArgs(activation_checkpointing="experts", ep=2).validate()
    TrainArgs(activation_checkpointing="experts").validate()
    with pytest.raises(ValueError, match="activation-checkpointing experts"):
        parallelize_k3(K3ForCausalLM(K3Config.from_preset("tiny")), ParallelDims(dp_shard=2, ep=2, world_size=2),
                       None, activation_checkpointing="experts")
