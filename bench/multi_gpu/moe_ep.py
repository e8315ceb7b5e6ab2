"""The Latent MoE layer at K3 widths under expert parallel.

    torchrun --standalone --nproc_per_node N bench/multi_gpu/moe_ep.py --out $OUT/multi_gpu
    torchrun --standalone --nproc_per_node 2 bench/multi_gpu/moe_ep.py --smoke --out /tmp/mg   # CPU, gloo, tiny

In order (rank 0 prints a table last and writes ``moe_ep.json`` / ``moe_ep.md`` under ``--out``):
1. exactness on the real backend: a small fp32 layer, EP outputs and every gradient vs the unsharded layer;
2. the one-GPU reference (rank 0 alone): the unsharded layer, 896 experts, ``--tokens`` tokens, fwd+bwd;
3. the EP layer (each rank ``--tokens`` tokens, E/N experts) with random routing and with 50 % of the tokens routed
   to experts 0, 1, 2 (all homed on rank 0): rows computed per rank (exactly S·k), replicas, bytes moved,
   forward and forward+backward time, TFLOP/s per GPU (the layer's matmul FLOPs), host syncs per forward.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path

from _common import environment, gather_ints, init, log, timed, write

import torch
import torch.distributed as dist

from k3.config import K3Config
from k3.distributed.expert_parallel import apply_expert_parallel
from k3.layers.moe import LatentMoE


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def config(args: argparse.Namespace) -> K3Config:
    if args.smoke:
        return K3Config.from_preset("tiny", hidden_size=64, n_experts=16, top_k=4, expert_dim=64, latent_dim=32,
                                    dtype="float32")
    return K3Config.from_preset("k3", n_experts=args.experts, top_k=args.top_k)


def build(cfg: K3Config, device: torch.device, dtype: torch.dtype, group=None, seed: int = 0) -> LatentMoE:
    """The layer with only this rank's experts ever materialised (built on meta, sharded, then allocated)."""
    with torch.device("meta"):
        moe = LatentMoE(cfg)
    handles = apply_expert_parallel(moe, group) if group is not None else []
    moe = moe.to_empty(device=device)
    for p in moe.parameters():  # the QB bias buffer stays fp32
        p.data = p.data.to(dtype)
    g = torch.Generator(device=device).manual_seed(seed + 7 * dist.get_rank())
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
        moe.gate.e_score_correction_bias.zero_()
    moe.train()
    moe.handles = handles
    return moe


def skew(moe: LatentMoE) -> None:
    """Half of the tokens (the even ones) put experts 0, 1, 2 among their top-k (each of the three then gets 50 %
    of all tokens); their other choices are kept."""
    orig = moe.gate.forward

    def forward(x: torch.Tensor, *args, **kwargs):
        idx, p = orig(x, *args, **kwargs)
        k = idx.shape[1]
        hot = torch.tensor([0, 1, 2], device=idx.device)
        keep = ~torch.isin(idx, hot)
        rest = idx.gather(1, torch.argsort((~keep).to(torch.int8), dim=1, stable=True))[:, :k - 3]
        forced = torch.cat([hot.expand(idx.shape[0], 3), rest], 1)
        even = (torch.arange(idx.shape[0], device=idx.device) % 2 == 0)[:, None]
        return torch.where(even, forced, idx), p

    moe.gate.forward = forward


def layer_flops(cfg: K3Config, tokens: int) -> float:
    """Matmul FLOPs of one forward over ``tokens``: router, W↓, W↑, shared experts, top-k routed experts."""
    d, l, F = cfg.hidden_size, cfg.latent_dim, cfg.expert_dim
    per_token = 2 * d * cfg.n_experts + 2 * 2 * d * l + 2 * 3 * d * cfg.shared_dim + cfg.top_k * 2 * 3 * l * F
    return float(per_token) * tokens


def exactness(device: torch.device) -> float:
    """A small fp32 layer: EP (every rank its own tokens) vs the unsharded layer on all tokens; max rel error."""
    R, r = dist.get_world_size(), dist.get_rank()
    cfg = K3Config.from_preset("tiny", hidden_size=64, n_experts=8 * R, top_k=4, expert_dim=64, latent_dim=32,
                               dtype="float32")
    torch.manual_seed(0)
    ref = LatentMoE(cfg).to(device).train()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3) if p.dim() >= 2 else p.uniform_(0.5, 1.5)
    moe = copy.deepcopy(ref)
    S = 24
    x = torch.randn(R * S, 64, device=device, generator=torch.Generator(device=device).manual_seed(1))
    xr = x.clone().requires_grad_(True)
    ref(xr).pow(2).sum().backward()
    apply_expert_parallel(moe, dist.group.WORLD)
    xe = x[r * S:(r + 1) * S].clone().requires_grad_(True)
    out = moe(xe)
    out.pow(2).sum().backward()
    M = cfg.n_experts // R
    errs = [rel(out, ref(x)[r * S:(r + 1) * S]), rel(xe.grad, xr.grad[r * S:(r + 1) * S])]
    for (name, p), (_, q) in zip(moe.named_parameters(), ref.named_parameters()):
        g = p.grad.clone()
        if ".experts." in f".{name}":
            errs.append(rel(g, q.grad[r * M:(r + 1) * M]))
        else:
            dist.all_reduce(g)
            errs.append(rel(g, q.grad))
    worst = torch.tensor([max(errs)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def syncs_per_forward(moe: LatentMoE, x: torch.Tensor) -> int | None:
    if x.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.no_grad():
                moe(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def measure(moe: LatentMoE, x: torch.Tensor, device: torch.device, n: int) -> dict:
    dy = torch.randn_like(x)

    def fwd() -> None:
        moe(x)

    def fwd_bwd() -> None:
        moe(x).backward(dy)

    return {"fwd_ms": timed(fwd, device, n), "fwd_bwd_ms": timed(fwd_bwd, device, n)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU")
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-ref", action="store_true", help="skip the one-GPU reference (it needs ~125 GB on rank 0)")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny widths: checks the script end to end")
    args = ap.parse_args()
    rank, R, device = init(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = config(args)
    S = 32 if args.smoke else args.tokens
    report: dict = {"env": environment(device), "tokens_per_gpu": S, "experts": cfg.n_experts, "top_k": cfg.top_k,
                    "widths": {"d": cfg.hidden_size, "latent": cfg.latent_dim, "expert": cfg.expert_dim}}
    report["exactness_max_rel"] = exactness(device)
    log(f"exactness (fp32, EP vs unsharded, outputs + all grads): {report['exactness_max_rel']:.2e}")
    x = torch.randn(S, cfg.hidden_size, device=device, dtype=dtype) * 0.5
    flops = 3 * layer_flops(cfg, S)  # fwd + bwd

    if not args.no_ref:
        if rank == 0:
            ref = build(cfg, device, dtype)
            r = measure(ref, x, device=device, n=args.iters) if R == 1 else None
            if r is None:  # alone on rank 0 while the others wait: time it without collectives
                import time
                import statistics
                ts = []
                dy = torch.randn_like(x)
                for i in range(args.iters + 2):
                    t0 = time.perf_counter()
                    ref(x).backward(dy)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    ts.append((time.perf_counter() - t0) * 1e3)
                r = {"fwd_bwd_ms": statistics.median(ts[2:])}
            r["tflops_per_gpu"] = flops / r["fwd_bwd_ms"] / 1e9
            report["one_gpu"] = r
            del ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()

    for routing in ("random", "skewed"):
        moe = build(cfg, device, dtype, dist.group.WORLD, seed=1)
        if routing == "skewed":
            skew(moe)
        res = measure(moe, x, device, args.iters)
        with torch.no_grad():
            moe(x)
        st = moe.handles[0].last_stats
        res.update(rows_per_rank=gather_ints(st.rows), replicas_per_rank=gather_ints(st.replicas),
                   home_load_per_rank=[int(v) for v in st.load.view(R, -1).sum(1).tolist()], plan_ok=st.ok,
                   row_bytes_per_rank=gather_ints(st.bytes["rows_remote"]),
                   replica_bytes_per_rank=gather_ints(st.bytes["replica_weights"]), ideal_row_bytes=st.ideal_bytes,
                   tflops_per_gpu=flops / res["fwd_bwd_ms"] / 1e9, host_syncs_per_forward=syncs_per_forward(moe, x))
        if device.type == "cuda":
            res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        report[routing] = res
        del moe
        if device.type == "cuda":
            torch.cuda.empty_cache()

    md = [f"Exactness (small fp32 layer, EP vs unsharded, outputs and all gradients): max rel "
          f"{report['exactness_max_rel']:.2e}", "",
          f"Layer: {cfg.n_experts} experts top-{cfg.top_k}, d {cfg.hidden_size}, latent {cfg.latent_dim}, expert "
          f"{cfg.expert_dim}, {cfg.n_shared_experts} shared; {S} tokens per GPU (S·k = {S * cfg.top_k} rows).", "",
          "| case | fwd ms | fwd+bwd ms | TFLOP/s per GPU | rows per rank | replicas per rank | remote row bytes / "
          "rank (fwd) | replica weight bytes / rank (fwd) | host syncs / fwd |",
          "|---|---:|---:|---:|---|---|---|---|---:|"]
    if "one_gpu" in report:
        o = report["one_gpu"]
        md.append(f"| one GPU, unsharded | {o.get('fwd_ms', float('nan')):.1f} | {o['fwd_bwd_ms']:.1f} | "
                  f"{o['tflops_per_gpu']:.0f} | – | – | – | – | – |")
    for routing in ("random", "skewed"):
        r = report[routing]
        md.append(f"| EP {R}, {routing} routing | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | "
                  f"{r['tflops_per_gpu']:.0f} | {r['rows_per_rank']} | {r['replicas_per_rank']} | "
                  f"{r['row_bytes_per_rank']} | {r['replica_bytes_per_rank']} | {r['host_syncs_per_forward']} |")
    if "one_gpu" in report:
        md += ["", "EP TFLOP/s per GPU vs the one-GPU layer: " + ", ".join(
            f"{routing} {report[routing]['tflops_per_gpu'] / report['one_gpu']['tflops_per_gpu']:.0%}"
            for routing in ("random", "skewed")) + " (target ≥ 70 %)"]
    write(args.out, "moe_ep", report, md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
