"""Expert parallel on 2 GPUs: the full 896-expert Latent MoE layer (K3 widths), NCCL.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 bench/x2_moe_ep.py --out bench/results/x2_ep

Checks, in order (rank 0 prints a table last and writes ``moe_ep_x2.md`` / ``.json`` under ``--out``):
1. correctness, small fp32 layer: EP outputs and every gradient vs the unsharded layer on all tokens (rel ≤ 1e-5);
2. the full layer (896 experts, d 7168, ℓ 3584, F 3072, 2 shared, top-16, ``--tokens`` per GPU), random routing:
   one forward under ``torch.cuda.set_sync_debug_mode("error")`` (no device-to-host sync), exactly S·k rows on each
   rank, fwd and fwd+bwd time;
3. the same under a router forced to send 50% of the tokens to 3 experts (all on rank 0): exact S·k rows per rank,
   replicas used, time;
4. the fixed-size all-to-all alone (one ``[2, S·k, ℓ]`` bf16 slab each way).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (see the device notes)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3.config import K3Config  # noqa: E402
from k3.distributed.expert_parallel import ExpertParallelMoE, _all_to_all  # noqa: E402
from k3.layers.moe import LatentMoE  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def log(rank: int, *a) -> None:
    if rank == 0:
        print(*a, flush=True)


def timed(fn, n: int = 5, warmup: int = 2) -> float:
    """Median ms over ``n`` runs (CUDA events), all ranks in step."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    t = torch.tensor([sorted(ts)[len(ts) // 2]], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(t)


def make_layer(cfg: K3Config, device: str, dtype: torch.dtype, seed: int = 0) -> LatentMoE:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            moe = LatentMoE(cfg)
    finally:
        torch.set_default_dtype(old)
    if device != "meta":
        init_(moe, seed, None)
    return moe.train()


@torch.no_grad()
def init_(moe: LatentMoE, seed: int, expert_seed: int | None) -> None:
    """Replicated weights from ``seed`` (identical on every rank); experts from ``expert_seed`` when given."""
    g = torch.Generator(device="cuda" if next(moe.parameters()).is_cuda else "cpu").manual_seed(seed)
    for name, p in moe.named_parameters():
        if name.startswith("experts.") and expert_seed is not None:
            continue
        p.normal_(0.0, 0.02, generator=g) if p.dim() >= 2 else p.fill_(1.0)
    if expert_seed is not None:
        ge = torch.Generator(device=g.device).manual_seed(expert_seed)
        for p in moe.experts.parameters():
            p.normal_(0.0, 0.02, generator=ge)
    moe.gate.e_score_correction_bias.zero_()


def skew_router(moe: LatentMoE, x: torch.Tensor, hot: list[int]) -> None:
    """Even tokens prefer the ``hot`` experts strongly, odd tokens avoid them."""
    with torch.no_grad():
        moe.gate.weight[hot, 0] = 5.0
        x[:, 0] = torch.where(torch.arange(x.shape[0], device=x.device) % 2 == 0, 2.0, -2.0).to(x.dtype)


def check_small(rank: int, world: int) -> dict:
    cfg = K3Config.from_preset("tiny", hidden_size=64, n_experts=16, top_k=4, expert_dim=48, latent_dim=32)
    moe = make_layer(cfg, "cuda", torch.float32)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(0, 0.1, generator=torch.Generator("cuda").manual_seed(3))
    S = 37
    gen = torch.Generator("cuda").manual_seed(1)
    x_all = torch.randn(world * S, 64, device="cuda", generator=gen)
    g_all = torch.randn(world * S, 64, device="cuda", generator=gen)
    skew_router(moe, x_all, [0, 1, 2])
    ref = copy.deepcopy(moe)
    x_ref = x_all.clone().requires_grad_(True)
    out_ref = ref(x_ref)
    (out_ref * g_all).sum().backward()
    ep = ExpertParallelMoE(moe, dist.group.WORLD)
    sl = slice(rank * S, (rank + 1) * S)
    x = x_all[sl].clone().requires_grad_(True)
    out = ep(x)
    (out * g_all[sl]).sum().backward()
    M = cfg.n_experts // world
    errs = {"out": rel(out, out_ref[sl]), "x.grad": rel(x.grad, x_ref.grad[sl])}
    refp = dict(ref.named_parameters())
    for name, p in moe.named_parameters():
        if name.startswith("experts."):
            want = refp[name].grad[rank * M:(rank + 1) * M]
        else:
            dist.all_reduce(p.grad)
            want = refp[name].grad
        errs[name] = rel(p.grad, want)
    worst = torch.tensor([max(errs.values())], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    rows_ok = int(ep.last_stats.rows) == S * cfg.top_k
    return {"max_rel_err": float(worst), "rows_exact": rows_ok, "pass": float(worst) <= 1e-5 and rows_ok}


def run_full(rank: int, world: int, args) -> dict:
    cfg = K3Config.from_preset("k3", n_experts=args.experts)
    moe = make_layer(cfg, "meta", torch.bfloat16)
    ep = ExpertParallelMoE(moe, dist.group.WORLD, n_hot=args.n_hot)
    moe.to_empty(device="cuda")
    init_(moe, seed=0, expert_seed=100 + rank)
    S, k, d = args.tokens, cfg.top_k, cfg.hidden_size
    C = S * k
    out: dict = {"tokens_per_gpu": S, "rows_per_gpu": C, "n_hot": ep.n_hot,
                 "weights_GiB_per_gpu": sum(p.numel() * p.element_size() for p in moe.parameters()) / 2**30}
    x = torch.randn(S, d, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(7 + rank))
    x.requires_grad_(True)
    do = torch.randn(S, d, device="cuda", dtype=torch.bfloat16)

    def fwd():
        return ep(x)

    def fwd_bwd():
        ep(x).backward(do)

    fwd()  # compile + allocator warm-up
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        y = fwd()
        torch.cuda.set_sync_debug_mode(0)
        out["sync_free_forward"] = "passed"
    except Exception as e:  # report it, do not hide it
        torch.cuda.set_sync_debug_mode(0)
        out["sync_free_forward"] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
        y = fwd()
    rows = torch.tensor([int(ep.last_stats.rows)], device="cuda")
    allrows = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(allrows, rows)
    out["random_rows_per_rank"] = [int(r) for r in allrows]
    out["random_plan_ok"] = bool(ep.last_stats.ok)
    out["random_finite"] = bool(torch.isfinite(y).all())
    del y
    with torch.no_grad():
        out["random_fwd_ms"] = timed(fwd)
    out["random_fwd_bwd_ms"] = timed(fwd_bwd, n=3, warmup=1)
    x.grad = None
    moe.zero_grad(set_to_none=True)

    with torch.no_grad():
        xs = x.detach().clone()
        skew_router(moe, xs, [0, 1, 2])
    xs.requires_grad_(True)
    ys = ep(xs)
    ys.backward(do)
    out["skew_plan_ok"] = bool(ep.last_stats.ok)  # False only if --n-hot is too small for this skew
    load = ep.last_stats.load
    rows = torch.tensor([int(ep.last_stats.rows), int(ep.last_stats.replicas)], device="cuda")
    allrows = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(allrows, rows)
    out["skew_token_share_per_hot_expert"] = float(load[:3].float().mean() / (S * world))
    out["skew_home_load_per_rank"] = [int(v) for v in load.view(world, -1).sum(1)]
    out["skew_rows_per_rank"] = [int(r[0]) for r in allrows]
    out["skew_replicas_per_rank"] = [int(r[1]) for r in allrows]
    out["skew_fwd_bwd_ms"] = timed(lambda: ep(xs).backward(do), n=3, warmup=1)
    del ys, xs
    moe.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.empty_cache()

    slab = torch.randn(world, C, cfg.latent_dim, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: _all_to_all(slab, dist.group.WORLD))
    out["all_to_all_slab_ms"] = t
    out["all_to_all_GBps_per_gpu"] = (world - 1) / world * slab.numel() * 2 / t / 1e6
    out["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    fl = 2 * S * k * 3 * cfg.expert_dim * cfg.latent_dim + 2 * S * 3 * d * cfg.shared_dim + 2 * S * 2 * d * \
        cfg.latent_dim + 2 * S * d * cfg.n_experts
    out["fwd_bwd_tflops_per_gpu"] = 3 * fl / out["random_fwd_bwd_ms"] / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--n-hot", type=int, default=32, help="hot experts per rank gathered as the replica pool")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.time()
    report = {"world": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "torchrun --standalone --nproc_per_node %d bench/x2_moe_ep.py %s" % (world, " ".join(
                  argv if argv is not None else sys.argv[1:]))}
    report["small_fp32_check"] = check_small(rank, world)
    log(rank, "small fp32 check:", report["small_fp32_check"])
    report["full_layer"] = run_full(rank, world, args)
    report["wall_s"] = time.time() - t0
    if rank == 0:
        f = report["full_layer"]
        lines = [f"# Expert parallel, {world} × {report['device']} (torch {report['torch']})", "",
                 f"`{report['command']}`", "",
                 "| check | result |", "|---|---|",
                 f"| small fp32 layer, EP vs unsharded (outputs + all grads) | max rel err "
                 f"{report['small_fp32_check']['max_rel_err']:.2e}, exact rows {report['small_fp32_check']['rows_exact']} |",
                 f"| full layer, forward under sync_debug_mode('error') | {f['sync_free_forward']} |",
                 f"| random routing: rows per rank (S·k = {f['rows_per_gpu']}) | {f['random_rows_per_rank']} "
                 f"(plan ok {f['random_plan_ok']}) |",
                 f"| 50% of tokens → 3 experts: home load per rank | {f['skew_home_load_per_rank']} |",
                 f"| 50% of tokens → 3 experts: rows computed per rank | {f['skew_rows_per_rank']} "
                 f"(replicas {f['skew_replicas_per_rank']}, plan ok {f['skew_plan_ok']}, token share per hot expert "
                 f"{f['skew_token_share_per_hot_expert']:.2f}) |", "",
                 "| full layer (896 experts, per GPU) | value |", "|---|---:|",
                 f"| tokens per GPU | {f['tokens_per_gpu']} |", f"| hot experts gathered per rank | {f['n_hot']} |",
                 f"| forward, random routing | {f['random_fwd_ms']:.1f} ms |",
                 f"| forward+backward, random routing | {f['random_fwd_bwd_ms']:.1f} ms "
                 f"({f['fwd_bwd_tflops_per_gpu']:.0f} TFLOP/s per GPU) |",
                 f"| forward+backward, skewed routing | {f['skew_fwd_bwd_ms']:.1f} ms |",
                 f"| one fixed-size all-to-all slab [{world}, S·k, ℓ] | {f['all_to_all_slab_ms']:.2f} ms "
                 f"({f['all_to_all_GBps_per_gpu']:.0f} GB/s off-GPU per GPU) |",
                 f"| peak memory | {f['peak_mem_GiB']:.1f} GiB |", ""]
        md = "\n".join(lines)
        print(md, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            from k3.utils import atomic_write_text

            atomic_write_text(os.path.join(args.out, "moe_ep_x2.md"), md)
            atomic_write_text(os.path.join(args.out, "moe_ep_x2.json"), json.dumps(report, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
