"""Context-parallel KDA on 2 GPUs vs 1 GPU: forward+backward time, exactness, bytes sent per layer.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 bench/kda_cp_multi_gpu.py [--T 524288] [--H 32] [--check-T 65536]

Rank 0 alone runs the full sequence (the 1-GPU time) while rank 1 waits; then both ranks run their slices with
``chunk_kda(..., cp_context=ctx)``, with the halves of a one-piece slice (the default) and without. Inputs are the K3
setting (bf16, K=V=128, bounded gate fused in the kernel, in-kernel L2 norm and β sigmoid), B=1. Uses the Triton backend
when present (K3_KDA_BACKEND is honoured). A smaller ``--check-T`` run compares the CP output and every gradient
against the single-GPU result, worst over ranks, three ways: the K3 init (states fade within a few tokens), slowly
decaying gates in bf16 and in fp32 (the entry state carries over the slice), each with how far the output would be
off if the entry state were lost. ``--check-only`` stops after the checks and the bytes. Prints a markdown table
last; ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast must stay off on the lent machines

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3.ops.kda import build_cp_context, chunk_kda, cp_conv_halo  # noqa: E402

FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
             safe_gate=True, lower_bound=-5.0)


def make(T: int, H: int, K: int, start: int, end: int, dev: torch.device, seed: int = 0,
         dt: torch.dtype | None = None) -> list[torch.Tensor]:
    """Tokens [start, end) of one global random stream (the same values whichever rank builds them); bf16 on GPUs
    unless ``dt`` is given, fp32 on CPU (the dry run may use Triton's interpreter: no bf16)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    dt = torch.float32 if dev.type == "cpu" else (dt or torch.bfloat16)
    full = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=dt)  # noqa: E731
    xs = []
    for shape in ((1, T, H, K), (1, T, H, K), (1, T, H, K), (1, T, H, K), (1, T, H)):
        xs.append(full(*shape)[:, start:end].contiguous())  # generated whole so every slice agrees
    return xs


def params(H: int, K: int, dev: torch.device, dt_bias: float = 0.0) -> list[torch.Tensor]:
    """A_log = 0 and dt_bias (the K3 init is 0: per-token log-decay ≈ −5·σ(g), so states fade within a few tokens;
    −8 gives ≈ −2e-3 per token, so a slice's entry state matters over the whole next slice)."""
    return [torch.zeros(H, device=dev).requires_grad_(), torch.full((H * K,), dt_bias, device=dev).requires_grad_()]


def fwd_bwd(xs: list[torch.Tensor], ps: list[torch.Tensor], ctx=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    xs = [x.detach().requires_grad_() for x in xs]
    cu = None if ctx is not None else torch.tensor([0, xs[0].shape[1]], device=xs[0].device)
    o, _ = chunk_kda(*xs, A_log=ps[0], dt_bias=ps[1], cu_seqlens=cu, cp_context=ctx, **FLAGS)
    grads = torch.autograd.grad(o.float().square().mean(), xs + ps)
    return o.detach(), list(grads)


def timed(fn, iters: int, warmup: int = 1, together: bool = True) -> float:
    """Median wall time in ms; ``together``: every rank runs it (barrier first), else this rank alone."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if together:
        dist.barrier()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=524288)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--check-T", type=int, default=65536)
    ap.add_argument("--bytes-T", type=int, nargs="+", default=[262144, 524288])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--check-only", action="store_true", help="exactness and bytes only, no timing")
    ap.add_argument("--cpu", action="store_true", help="dry run of this script with gloo on CPU (tiny sizes)")
    a = ap.parse_args()
    dist.init_process_group("gloo" if a.cpu else "nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    if a.cpu:
        dev = torch.device("cpu")
        torch.cuda.synchronize = lambda *_: None  # type: ignore[assignment]  # the dry run has no stream to wait on
        gpu = "cpu (dry run)"
    else:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
        gpu = torch.cuda.get_device_name(dev)
    H, K, res = a.H, a.K, {"world": W, "gpu": gpu, "torch": torch.__version__}
    from k3.ops.kda.args import select_backend

    res["backend"] = select_backend(dev)

    # 1. exactness at --check-T: CP slice vs this rank's slice of the single-GPU result (outputs, every gradient),
    # worst over ranks, with the K3 init (fast decay) and with slowly decaying gates (the entry state carries)
    Tc = a.check_T
    ctx = build_cp_context(torch.tensor([0, Tc]), conv1d_kernel_size=4)
    res["check"] = {"T": Tc}
    for label, dtb, dt in (("k3_init", 0.0, None), ("carry", -8.0, None), ("carry_fp32", -8.0, torch.float32)):
        full, ps = make(Tc, H, K, 0, Tc, dev, dt=dt), params(H, K, dev, dtb)
        o_ref, g_ref = fwd_bwd(full, ps)
        loc = [ctx.shard(x) for x in full]
        o_cp, g_cp = fwd_bwd(loc, ps, ctx)  # NB the loss is a mean over local tokens: rescale below
        scale = Tc / (ctx.end - ctx.start)
        errs = [rel(o_cp, ctx.shard(o_ref))]
        errs += [rel(g / scale, ctx.shard(gr)) for g, gr in zip(g_cp[:5], g_ref[:5])]
        for g, gr in zip(g_cp[5:], g_ref[5:]):
            g = g / scale
            dist.all_reduce(g)
            errs.append(rel(g, gr))
        # how far this rank's output is from its slice run alone from a zero state (the error a lost entry would
        # make: the check above can only fail where this is large)
        o_alone = chunk_kda(*[x.detach() for x in loc], A_log=ps[0].detach(), dt_bias=ps[1].detach(),
                            cu_seqlens=torch.tensor([0, ctx.end - ctx.start], device=dev), **FLAGS)[0]
        worst = torch.tensor(errs + [rel(o_alone, ctx.shard(o_ref))], device=dev)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        res["check"][label] = {"max_rel_err": float(worst[:-1].max()), "errs": worst[:-1].tolist(),
                               "entry_effect": float(worst[-1])}
        del full, o_ref, g_ref, loc, o_cp, g_cp, o_alone
    res["check"]["max_rel_err"] = max(res["check"][k]["max_rel_err"] for k in ("k3_init", "carry"))  # bf16
    ps = params(H, K, dev)
    if not a.cpu:
        torch.cuda.empty_cache()

    # 2. bytes sent per layer (summary all_gather + conv halo for q,k,v channels) at each T
    res["bytes"] = {}
    for Tb in a.bytes_T:
        c = build_cp_context(torch.tensor([0, Tb]), conv1d_kernel_size=4)
        xs = make(Tb, H, K, c.start, c.end, dev, seed=1)
        with torch.no_grad():
            cp_conv_halo(torch.zeros(1, c.end - c.start, 3 * H * K, device=dev, dtype=torch.bfloat16), c)
        fwd_bwd(xs, ps, c)  # the training call: the forward's summary gather and the backward's J gather
        res["bytes"][Tb] = {"summary": c.last_bytes_sent, "halo": c.last_halo_bytes,
                            "backward": c.last_bwd_bytes_sent}
        del xs
    if not a.cpu:
        torch.cuda.empty_cache()

    if a.check_only:
        if rank == 0:
            print(json.dumps(res, indent=1))
        dist.destroy_process_group()
        return
    # 3. timing: 1 GPU (rank 0, full T) then CP (every rank, its slice)
    T = a.T
    t1 = float("nan")
    if rank == 0:
        try:
            full = make(T, H, K, 0, T, dev, seed=2)
            t1 = timed(lambda: fwd_bwd(full, ps), a.iters, together=False)
            del full
        except torch.OutOfMemoryError:
            res["one_gpu_oom"] = True
        if not a.cpu:
            torch.cuda.empty_cache()
    dist.barrier()
    c = build_cp_context(torch.tensor([0, T]))
    xs = make(T, H, K, c.start, c.end, dev, seed=2)
    tcp = timed(lambda: fwd_bwd(xs, ps, c), a.iters)
    c.halves_min_chunks = 1 << 62  # the one-piece serial passes, for comparison
    t_one = timed(lambda: fwd_bwd(xs, ps, c), a.iters)
    c.halves_min_chunks = build_cp_context(torch.tensor([0, T])).halves_min_chunks
    tf = timed(lambda: torch.no_grad()(chunk_kda)(*xs, A_log=ps[0], dt_bias=ps[1], cp_context=c, **FLAGS), a.iters)
    t_all = torch.tensor([tcp, tf, t_one], device=dev)
    dist.all_reduce(t_all, op=dist.ReduceOp.MAX)
    res.update(T=T, H=H, K=K, one_gpu_fwd_bwd_ms=t1, cp_fwd_bwd_ms=float(t_all[0]), cp_fwd_ms=float(t_all[1]),
               speedup=t1 / float(t_all[0]), cp_fwd_bwd_ms_no_halves=float(t_all[2]))
    if rank == 0:
        print(json.dumps(res, indent=1))
        print(f"\n| case | ms |\n|---|---|\n| 1 GPU fwd+bwd, B=1 T={T:,} H={H} | {t1:.1f} |\n"
              f"| {W}-rank CP fwd+bwd | {res['cp_fwd_bwd_ms']:.1f} (x{res['speedup']:.2f}) |\n"
              f"| {W}-rank CP fwd+bwd, halves off | {res['cp_fwd_bwd_ms_no_halves']:.1f} "
              f"(x{t1 / res['cp_fwd_bwd_ms_no_halves']:.2f}) |\n"
              f"| {W}-rank CP fwd only | {res['cp_fwd_ms']:.1f} |\n")
        print("| T | forward summary bytes/rank/layer | backward J bytes | conv halo bytes | H·K·(K+V)·4 |\n"
              "|---|---|---|---|---|")
        for Tb, b in res["bytes"].items():
            print(f"| {Tb:,} | {b['summary']:,} | {b['backward']:,} | {b['halo']:,} | {H * K * 2 * K * 4:,} |")
        ck = res["check"]
        print(f"\nexactness at T={Tc:,} (worst rank): max rel-RMS over output and all gradients = "
              f"{ck['k3_init']['max_rel_err']:.2e} with the K3 init, {ck['carry']['max_rel_err']:.2e} with slowly "
              f"decaying gates (a lost entry state would cost {ck['k3_init']['entry_effect']:.1e} / "
              f"{ck['carry']['entry_effect']:.1e}); fp32 inputs, slow gates: {ck['carry_fp32']['max_rel_err']:.2e} "
              f"(backend {res['backend']}, {res['gpu']})")
        if a.json:
            from k3.utils import atomic_write_text

            atomic_write_text(a.json, json.dumps(res, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
