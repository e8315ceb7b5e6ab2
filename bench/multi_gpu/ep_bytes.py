"""Bytes the expert-parallel MoE layer moves per forward at K3 widths, from the device plan alone (one CPU process,
no GPUs): every rank's routing is simulated, the plan built, and each rank's row destinations and replica transfers
counted exactly as ``ep_expert_rows`` sends them.

    python bench/multi_gpu/ep_bytes.py [--ranks 8 16 64] [--tokens 8192] [--out bench/results/multi_gpu]

Routing: random (each token k distinct uniform experts) and skewed (half of the tokens take experts 0, 1, 2 — all
homed on rank 0 — among their k). Reported per rank and forward, bf16 activations and weights (MXFP4 in brackets):
rows sent to other ranks (there + back), the ideal (each routed row there and back), positions + counts metadata,
replica weights actually sent, and what the padded-slab + whole-pool all-gather design moved.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from k3.distributed.expert_parallel import default_n_hot, plan_rows, row_targets, source_prefix  # noqa: E402


def routing(R: int, S: int, k: int, E: int, skewed: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(R, S, E, generator=g).topk(k, dim=-1).indices  # k distinct uniform experts per token
    if skewed:
        hot = torch.tensor([0, 1, 2])
        keep = ~torch.isin(idx, hot)
        rest = idx.gather(2, torch.argsort((~keep).to(torch.int8), dim=2, stable=True))[..., :k - 3]
        forced = torch.cat([hot.expand(R, S, 3), rest], 2)
        idx = torch.where((torch.arange(S) % 2 == 0)[None, :, None], forced, idx)
    return idx


def measure(R: int, S: int, k: int, E: int, L: int, F: int, skewed: bool) -> dict:
    idx = routing(R, S, k, E, skewed)
    counts = torch.stack([torch.bincount(idx[r].flatten(), minlength=E) for r in range(R)])
    C, H = S * k, default_n_hot(E, R)
    plan = plan_rows(counts, C, H)
    prefix = source_prefix(counts)
    remote = 0
    for r in range(R):
        dest, _ = row_targets(plan, prefix, r, idx[r])
        remote = max(remote, int((dest != r).sum()))
    pairs = (plan.overlap > 0).sum(1)  # replica experts each rank receives
    per_expert = 3 * L * F
    return {"ranks": R, "skewed": skewed, "ok": bool(plan.ok), "rows_per_rank": C,
            "max_remote_rows_per_rank": remote, "ideal_bytes": 2 * C * L * 2,
            "remote_row_bytes_max": 2 * remote * L * 2, "meta_bytes": C * 8 + (E + 1) * 8 * (R - 1),
            "replica_experts_max": int(pairs.max()), "replica_bytes_max_bf16": int(pairs.max()) * per_expert * 2,
            "replica_bytes_max_mxfp4": int(pairs.max()) * per_expert * 17 // 32,
            "padded_design_bytes": 2 * R * C * L * 2 + R * H * per_expert * 2, "n_hot": H}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    E, k, L, F = 896, 16, 3584, 3072
    res = [measure(R, args.tokens, k, E, L, F, sk) for R in args.ranks for sk in (False, True)]
    G = 1e9
    md = [f"K3 widths (896 experts top-16, latent {L}, expert {F}), {args.tokens} tokens per rank, bf16; per rank and "
          "forward (the backward moves the same again); the worst rank.", "",
          "| ranks | routing | ideal rows GB (there+back) | remote rows GB | positions+counts MB | replica experts | "
          "replica weights GB bf16 (MXFP4) | padded slabs + pool all-gather GB |",
          "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in res:
        md.append(f"| {r['ranks']} | {'skewed' if r['skewed'] else 'random'} | {r['ideal_bytes'] / G:.2f} | "
                  f"{r['remote_row_bytes_max'] / G:.2f} | {r['meta_bytes'] / 1e6:.2f} | {r['replica_experts_max']} | "
                  f"{r['replica_bytes_max_bf16'] / G:.2f} ({r['replica_bytes_max_mxfp4'] / G:.2f}) | "
                  f"{r['padded_design_bytes'] / G:,.1f} |")
    print("\n".join(md))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ep_bytes.json").write_text(json.dumps(res, indent=2) + "\n")
        (args.out / "ep_bytes.md").write_text("# ep_bytes (from the device plan, one CPU process)\n\n"
                                              f"`python bench/multi_gpu/ep_bytes.py --ranks {' '.join(map(str, args.ranks))} "
                                              f"--tokens {args.tokens}`\n\n" + "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
