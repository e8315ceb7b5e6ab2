"""The one-GPU training path on CUDA (skipped without a GPU): the world-size-1 step (bf16 parameters with fp32
masters, fp32 micro-batch sums) follows the eager fp32 + autocast reference within bf16 noise, compiling the sublayers
changes nothing but speed, the MoE layer compiles under inductor in one graph (also recomputing its experts), and a
GPU run's DCP checkpoints resume exactly."""

import copy

import pytest
import torch

import k3_runs
from k3.bench.train import RandomTokens, _build_run
from k3.config import K3Config
from k3.distributed.data_parallel import destroy_distributed, init_distributed
from k3.distributed.parallel_dims import ParallelDims

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _config() -> K3Config:
    return K3Config.from_preset("tiny", dtype="bfloat16", vocab_size=512, hidden_size=128, n_experts=16, top_k=4)


class _A:  # the benchmark's options, for its path builders
    batch_size, seq_len, optimizer, lr, warmup_lr, ac, seed = 4, 128, "muon", 3e-3, 2, "none", 0


def _losses(name: str, steps: int = 6) -> list[float]:
    config = _config()
    d = init_distributed(torch.device("cuda"), ParallelDims())
    try:
        run = _build_run(name, config, _A, RandomTokens(config.vocab_size, _A.batch_size, _A.seq_len), d, steps)
        return [run.step(i) for i in range(steps)]
    finally:
        destroy_distributed(d)


def test_one_gpu_step_follows_the_autocast_reference() -> None:
    ref, fast = _losses("reference"), _losses("fast-nocompile")
    assert all(abs(a - b) < 2e-2 * abs(b) for a, b in zip(fast, ref)), (fast, ref)


def test_compiled_sublayers_match_eager() -> None:
    eager, compiled = _losses("fast-nocompile"), _losses("fast")
    assert all(abs(a - b) < 1e-2 * abs(b) for a, b in zip(compiled, eager)), (compiled, eager)


@pytest.mark.parametrize("recompute_experts", [False, True])
def test_moe_layer_compiles_under_inductor_in_one_graph(recompute_experts: bool) -> None:
    """Also with the "experts" checkpointing policy: the expert rows recomputed inside the compiled graph."""
    from k3.layers.moe import LatentMoE

    torch.manual_seed(0)
    config = K3Config.from_preset("small")
    moe = LatentMoE(config, 1)
    with torch.no_grad():  # the layer's matrices start uninitialised (the model's reset_parameters fills them)
        for name, p in moe.named_parameters():
            torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.normal_(p, 0.0, 0.02)
    moe = moe.cuda().to(torch.bfloat16).train()
    moe.recompute_experts = recompute_experts
    twin = copy.deepcopy(moe)
    x = torch.randn(2, 1000, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    outs = []
    for m, fn in ((moe, moe), (twin, torch.compile(twin, fullgraph=True))):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(dy)
        outs.append((y.float(), xi.grad.float(), m.routed_expert_down_proj.weight.grad.float(), m.gate.qb_hist))
    for a, b in zip(outs[0][:3], outs[1][:3]):
        assert ((a - b).norm() / b.norm()) < 2e-2
    assert torch.equal(outs[0][3], outs[1][3])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_run_resumes_its_dcp_checkpoint_exactly(tmp_path, dtype: str) -> None:
    """fp32 steps run eagerly; bf16 ones are captured in a CUDA graph (saved between replays, and the resumed run's
    capturable optimizer loads the DCP state before its own capture)."""
    (tmp_path / "c.json").write_text(K3Config.from_preset("tiny", dtype=dtype).to_json())
    args = ["--steps", "6", "--save-every", "3", "--log-every", "1", "--compile", "off", "--config",
            str(tmp_path / "c.json"), *k3_runs.FAST]
    code, _, err = k3_runs.run_cli("train", "--out", str(tmp_path / "full"), "--device", "cuda", *args)
    assert code == 0, err
    assert (tmp_path / "full" / "checkpoints" / "step-00000006" / "dcp" / ".metadata").is_file()
    half = tmp_path / "half"
    code, _, err = k3_runs.run_cli("train", "--out", str(half), "--device", "cuda", *args[:1], "3", *args[2:])
    assert code == 0, err
    code, out, err = k3_runs.run_cli("train", "--resume", str(half), "--steps", "6")
    assert code == 0 and "resuming from step 3" in out, err
    a, b = k3_runs.losses(tmp_path / "full"), k3_runs.losses(half)
    assert max(abs(a[s] - b[s]) for s in range(4, 7)) < 1e-4, (a, b)
