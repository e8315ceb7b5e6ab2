"""One rank with low-precision compute: parameters in the compute dtype with fp32 masters beside them (no FSDP).

On a real world-size-1 gloo group, with fp16 compute (the CPU's Triton interpreter reads no bf16; the GPU tests run
bf16): the trainer's step follows FSDP2's with the same policy, every parameter is its master rounded, micro-batch gradients
are summed in fp32, and a DCP checkpoint holds the fp32 masters, resumes exactly and loads into an FSDP layout."""

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from k3.config import K3Config
from k3.data import load_tokenizer
from k3.distributed.checkpoint import load_distributed_checkpoint, save_distributed_checkpoint
from k3.distributed.data_parallel import Distributed
from k3.distributed.master_weights import accumulate_grads, master_of
from k3.distributed.parallel_dims import ParallelDims
from k3.distributed.parallelize import parallelize_k3
from k3.model import K3ForCausalLM, keeps_fp32
from k3.train.optim import MasterAdamW, Muon, build_optimizer
from k3.train.trainer import TrainArgs, _device_step
from tests.distributed._gloo import run_ranks

LOW = torch.float16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _setup(model: torch.nn.Module, low: torch.dtype | None, optimizer: str = "adamw"):
    dims = ParallelDims()
    mesh = dims.build_mesh("cpu")
    parallelize_k3(model, dims, mesh, mixed_precision=low)
    return Distributed(dims=dims, device=torch.device("cpu"), mesh=mesh), build_optimizer(model, optimizer, 3e-3)


def _batches(cfg: K3Config, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab_size, (2, 2, 25), generator=g)  # 2 micro-batches of 2 × 24 tokens
        out.append((t[..., :-1], t[..., 1:]))
    return out


def _assert_rounded_masters(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        m = master_of(p)
        if keeps_fp32(name):
            assert m is None and p.dtype == torch.float32, name
        else:
            assert p.dtype == LOW and m.dtype == torch.float32 and torch.equal(p.detach(), m.to(LOW)), name
            assert m.grad is None, name  # the fp32 micro-batch sums are released after the step


def _fsdp_one_rank(model: torch.nn.Module, low: torch.dtype) -> None:
    """What ``parallelize_k3`` did on one rank before: FSDP2 with the same mixed-precision policy."""
    from k3.distributed import parallelize as par

    dims = ParallelDims()
    state = par.ParallelModel(dims=dims, mesh=dims.build_mesh("cpu"), param_dtype=low, fsdp=True)
    state.replicated = par.replicated_params(model)
    par._apply_fsdp(model, dims, state.mesh, low, state.replicated)
    model.parallel = state


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _steps_follow_fsdp(rank: int, world: int, optimizer: str) -> None:
    cfg = K3Config.from_preset("tiny")
    torch.manual_seed(0)
    ref = K3ForCausalLM(cfg).float()
    model = copy.deepcopy(ref)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    d, opt = _setup(model, LOW, optimizer)
    assert model.parallel.master_weights and not model.parallel.fsdp
    assert isinstance(opt, MasterAdamW if optimizer == "adamw" else Muon)
    _assert_rounded_masters(model)
    _fsdp_one_rank(ref, LOW)
    ref_opt = build_optimizer(ref, optimizer, 3e-3)
    args = TrainArgs(grad_clip=0.5, grad_accum=2)
    for x, y in _batches(cfg, 3):
        sums, norm = _device_step(model, opt, args, d, False, x, y)
        sums_ref, norm_ref = _device_step(ref, ref_opt, args, d, False, x, y)
        assert abs(sums[0] - sums_ref[0]) < 1e-4 * abs(sums_ref[0])
        assert abs(norm - norm_ref) < 1e-3 * norm_ref
        _assert_rounded_masters(model)
    moved, want = [], []
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        moved.append((master_of(p) if master_of(p) is not None else p).detach().flatten() - start[n].flatten())
        want.append(_full(q).flatten() - start[n].flatten())
    # the same updates as FSDP2's (to the order of the optimizer's fp32 operations, and what fp16 then rounds
    # differently: ~3e-3 here; either against an fp32 run differs by ~0.13, the fp16 forward's noise)
    err = rel(torch.cat(moved), torch.cat(want))
    assert err < 2e-2, err


def test_one_rank_adamw_steps_follow_fsdp2_with_the_same_policy() -> None:
    run_ranks(_steps_follow_fsdp, 1, "adamw")


def test_one_rank_muon_steps_follow_fsdp2_with_the_same_policy() -> None:
    run_ranks(_steps_follow_fsdp, 1, "muon")


def _accumulates_in_fp32(rank: int, world: int) -> None:
    cfg = K3Config.from_preset("tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).float()
    _setup(model, LOW)
    params = [p for p in model.parameters() if master_of(p) is not None]
    (x0, y0), (x1, y1) = _batches(cfg, 2)
    grads = []
    for x, y in ((x0[0], y0[0]), (x1[0], y1[0])):
        model(x, labels=y).loss.backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    for x, y in ((x0[0], y0[0]), (x1[0], y1[0])):
        model(x, labels=y).loss.backward()
        accumulate_grads(params)
        assert all(p.grad is None for p in params)
    summed = 0
    for p, a, b in zip(params, *grads):
        if a is None:  # a parameter no token reaches (the first layer's unused AttnRes pair)
            assert b is None and master_of(p).grad is None
            continue
        assert master_of(p).grad.dtype == torch.float32
        assert torch.equal(master_of(p).grad, a.float() + b.float())
        summed += 1
    assert summed > len(params) // 2


def test_micro_batch_gradients_are_summed_in_fp32_on_the_masters() -> None:
    run_ranks(_accumulates_in_fp32, 1)


def _checkpoint_round_trip(rank: int, world: int, run_dir: str, optimizer: str) -> None:
    cfg = K3Config.from_preset("tiny")
    tok = load_tokenizer("byte")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).float()
    d, opt = _setup(model, LOW, optimizer)
    args = TrainArgs(grad_clip=1.0, grad_accum=2)
    batches = _batches(cfg, 3)
    for x, y in batches[:2]:
        _device_step(model, opt, args, d, False, x, y)
    ckpt = save_distributed_checkpoint(Path(run_dir), 2, model, opt, cfg, tok, {"step": 2}, {}, 2, d)
    at_save = {n: (master_of(p) if master_of(p) is not None else p).detach().clone()
               for n, p in model.named_parameters()}
    meta = FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    for name, p in model.named_parameters():
        assert meta[f"model.{name}"].properties.dtype == torch.float32, name  # the masters, not the fp16 weights

    torch.manual_seed(5)  # other initial weights: everything must come from the checkpoint
    resumed = K3ForCausalLM(cfg).float()
    _, opt2 = _setup(resumed, LOW, optimizer)
    load_distributed_checkpoint(ckpt, resumed, opt2, d)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a.detach(), b.detach()), name
        if master_of(a) is not None:
            assert torch.equal(master_of(a), master_of(b)), name
    x, y = batches[2]
    s1, n1 = _device_step(model, opt, args, d, False, x, y)
    s2, n2 = _device_step(resumed, opt2, args, d, False, x, y)
    assert torch.equal(s1, s2) and torch.equal(n1, n2)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a.detach(), b.detach()), name

    fsdp = K3ForCausalLM(cfg).float()  # fp32 compute on the one-rank group: FSDP2 shards, the same checkpoint
    _, opt3 = _setup(fsdp, None, optimizer)
    assert fsdp.parallel.fsdp
    load_distributed_checkpoint(ckpt, fsdp, opt3, d)
    for name, p in fsdp.named_parameters():
        assert torch.equal(_full(p), at_save[name]), name


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_checkpoint_holds_fp32_masters_resumes_exactly_and_loads_into_fsdp(tmp_path: Path, optimizer: str) -> None:
    """Bit-exact resume needs the moments (Muon: the momentum too) back in fp32, not cast to the parameters'
    dtype as torch's ``load_state_dict`` would."""
    run_ranks(_checkpoint_round_trip, 1, str(tmp_path), optimizer)
