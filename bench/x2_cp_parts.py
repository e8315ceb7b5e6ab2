"""Where the context-parallel overhead goes: a per-rank kernel timeline of one CP training step, and the serial
passes timed alone and side by side on one GPU.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 bench/x2_cp_parts.py [--T 524288] [--H 32] [--out DIR]

1. timeline (every rank): one profiled CP forward+backward after two warm-ups; each rank writes
   ``DIR/timeline_r{rank}.txt`` (kernel start/end in ms from the step's first kernel on that rank, name) and
   prints its kernels grouped by phase. Timestamps are host-clock converted (one host), so ranks line up.
2. parts (rank 0 alone, its slice's buffers): the forward state pass over the slice, over two half segments in one
   launch, the span pass over a half (V + K columns) at several launch settings, state pass over half A beside the
   span of half B on two streams, and the reverse state pass whole vs two segments. ``do_bench`` medians (ms).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast must stay off on the lent machines

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.x2_kda_cp import FLAGS, fwd_bwd, make, params  # noqa: E402
from k3.ops.kda import build_cp_context  # noqa: E402


def timeline(fn, path: str) -> list[tuple[float, float, str]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    t0 = min(e.time_range.start for e in evs)
    rows = sorted((e.time_range.start - t0, e.time_range.end - t0, e.name) for e in evs)
    with open(path, "w") as f:
        for s, e, n in rows:
            f.write(f"{s / 1e3:9.3f} {e / 1e3:9.3f} {(e - s) / 1e3:8.3f}  {n[:90]}\n")
    return [(s / 1e3, e / 1e3, n) for s, e, n in rows]


def summarize(rank: int, rows: list[tuple[float, float, str]]) -> None:
    """Merge consecutive kernels of the same short name; print the big ones (≥ 0.3 ms) and the gaps."""
    out, prev_end = [], 0.0
    for s, e, n in rows:
        short = n.split("(")[0].split("<")[0][:40]
        if out and out[-1][2] == short and s - out[-1][1] < 0.05:
            out[-1][1] = max(out[-1][1], e)
            out[-1][3] += e - s
        else:
            out.append([s, e, short, e - s])
    print(f"--- rank {rank}: {len(rows)} kernels, span {rows[-1][1]:.2f} ms", flush=True)
    for s, e, n, busy in out:
        gap = s - prev_end
        if busy >= 0.3 or gap >= 0.3:
            print(f"r{rank} {s:8.2f} {e:8.2f} busy {busy:7.2f} gap-before {gap:6.2f}  {n}", flush=True)
        prev_end = max(prev_end, e)


def parts(L: int, H: int, dev: torch.device) -> None:
    import triton

    from k3.ops.kda.triton._common import BT, ChunkTable, dot_precision, make_chunk_table
    from k3.ops.kda.triton.chunk import _flags
    from k3.ops.kda.triton.chunk_bwd import bwd_state_pass
    from k3.ops.kda.triton.chunk_fwd import launch_state, prep_all
    from k3.ops.kda.triton.span import _kda_span_rows

    K = V = 128
    xs = make(L, H, K, 0, L, dev, seed=3)
    q, k, v, g, beta = xs
    A_log, dt_bias = torch.zeros(H, device=dev), torch.zeros(H * K, device=dev)
    tab = make_chunk_table(1, L, torch.tensor([0, L]), dev)
    flags = _flags(True, True, True, -5.0)
    bufs = prep_all(q, k, v, g, beta, A_log, dt_bias, K ** -0.5, tab, -5.0, flags)
    NC = tab.NC
    m = NC // 2
    to = dict(dtype=torch.int32, device=dev)
    seg = ChunkTable(2, NC, 0, 0, True, torch.tensor([0, m * BT, L], **to), tab.chunk_seq,
                     torch.tensor([0, m, NC], **to), [0, m * BT, L], [0, m, NC])
    half = ChunkTable(1, NC, 0, 0, True, torch.tensor([0, m * BT], **to), tab.chunk_seq,
                      torch.tensor([0, m], **to), [0, m * BT], [0, m])
    o = torch.empty(1, L, H, V, dtype=q.dtype, device=dev)
    hs = torch.empty(H, NC, K, V, dtype=q.dtype, device=dev)
    res = {}
    bench = lambda f: float(triton.testing.do_bench(f, warmup=5, rep=150, return_mode="median"))  # noqa: E731
    res["prep_all (training prep)"] = bench(lambda: prep_all(q, k, v, g, beta, A_log, dt_bias, K ** -0.5, tab,
                                                             -5.0, flags))
    ht1 = torch.zeros(1, H, K, V, device=dev)
    ht2 = torch.zeros(2, H, K, V, device=dev)
    res["state, whole slice (64 progs)"] = bench(lambda: launch_state(bufs, o, hs, ht1, tab, 0, NC, H, K, V))
    res["state, 2 segments one launch"] = bench(lambda: launch_state(bufs, o, hs, ht2, seg, 0, NC, H, K, V))
    res["state, half A alone"] = bench(lambda: launch_state(bufs, o, hs, ht1, half, 0, NC, H, K, V))

    def span(rows_cs, rows_ce, bv, warps, stages, with_m=True):
        R = len(rows_cs)
        cs, ce = torch.tensor(rows_cs, **to), torch.tensor(rows_ce, **to)
        rm = torch.tensor([int(with_m)] * R, **to)
        SE = torch.zeros(R, H, K, V, device=dev)
        Mt = torch.eye(K, device=dev).repeat(R, H, 1, 1)

        def f():
            _kda_span_rows[((V + K) // bv, R * H)](
                bufs["W"], bufs["U"], bufs["KG"], bufs["GAM"], SE, Mt, cs, ce, rm, 0, NC, H, K, V, BT=BT, BK=K,
                BV=bv, BVP=V, PREC=dot_precision(q.dtype), num_warps=warps, num_stages=stages)
        return f

    for bv, warps, stages in ((32, 4, 3), (32, 4, 2), (64, 4, 3), (64, 4, 2), (64, 8, 2)):
        try:
            res[f"span half (V+K) bv{bv} w{warps} s{stages}"] = bench(span([m], [NC], bv, warps, stages))
        except Exception as e:  # noqa: BLE001  (an over-budget shared memory launch)
            print("span variant failed", bv, warps, stages, type(e).__name__, str(e)[:100], flush=True)
    res["span half S-cols only bv64 s3"] = bench(span([m], [NC], 64, 4, 3, with_m=False))
    side = torch.cuda.Stream(dev)
    sp = span([m], [NC], 64, 4, 2)
    sp32 = span([m], [NC], 32, 4, 2)

    def both(f2):
        def f():
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                f2()
            launch_state(bufs, o, hs, ht1, half, 0, NC, H, K, V)
            torch.cuda.current_stream(dev).wait_stream(side)
        return f

    res["state A || span B bv64 s2 (2 streams)"] = bench(both(sp))
    res["state A || span B bv32 s2 (2 streams)"] = bench(both(sp32))
    saved = dict(bufs, HS=hs)
    do = torch.randn_like(o)
    res["reverse, whole slice"] = bench(lambda: bwd_state_pass(do, None, saved, tab, H, K, V, q.dtype))
    res["reverse, 2 segments one launch"] = bench(lambda: bwd_state_pass(do, None, saved, seg, H, K, V, q.dtype))
    res["reverse, half A alone"] = bench(lambda: bwd_state_pass(do, None, saved, half, H, K, V, q.dtype))
    print(f"\n| part (L={L:,}, H={H}, one H200) | ms |\n|---|---:|")
    for n, t in res.items():
        print(f"| {n} | {t:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=524288)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--out", default=".")
    ap.add_argument("--no-parts", action="store_true")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    os.makedirs(a.out, exist_ok=True)
    T, H, K = a.T, a.H, 128
    c = build_cp_context(torch.tensor([0, T]))
    xs, ps = make(T, H, K, c.start, c.end, dev, seed=2), params(H, K, dev)
    rows = timeline(lambda: fwd_bwd(xs, ps, c), os.path.join(a.out, f"timeline_r{rank}.txt"))
    for r in range(dist.get_world_size()):
        if r == rank:
            summarize(rank, rows)
        dist.barrier()
    del xs
    torch.cuda.empty_cache()
    if rank == 0 and not a.no_parts:
        parts(T // dist.get_world_size(), H, dev)
    dist.barrier()
    dist.destroy_process_group()


_ = FLAGS  # the K3 call the timeline runs (imported for the reader)

if __name__ == "__main__":
    main()
