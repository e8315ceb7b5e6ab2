"""Scaling of ``k3 train`` with FSDP2 data parallel: tokens/s per GPU at dp-shard 1, 2, 4, 8 with
the same per-GPU batch.

    python bench/multi_gpu/train_scaling.py --gpus 1 2 4 8 --out $OUT/multi_gpu
    python bench/multi_gpu/train_scaling.py --smoke --gpus 1 2 --out /tmp/mg        # CPU, gloo, preset tiny

Each point is one ``torchrun --standalone --nproc_per_node N -m k3 train --preset small --dp-shard N
--batch-size (per-GPU batch × N) …`` run; its tokens/s is the median of the logged steps after the warm-up ones
(``metrics.jsonl``), divided by N. Writes ``train_scaling.json`` / ``.md`` with the speedup over one GPU
(targets: ×1.85 at 2, ×3.6 at 4, ×7.0 at 8).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET = {2: 1.85, 4: 3.6, 8: 7.0}


def run_point(n: int, args: argparse.Namespace) -> dict:
    run = args.out / f"train_dp{n}"
    if run.exists():
        import shutil

        shutil.rmtree(run)
    preset, batch, seq, steps = ("tiny", 2, 64, 6) if args.smoke else (args.preset, args.batch_per_gpu,
                                                                       args.seq_len, args.steps)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), "-m", "k3",
           "train", "--preset", preset, "--batch-size", str(batch * n), "--seq-len", str(seq), "--steps", str(steps),
           "--warmup", "2", "--eval-batches", "1", "--sample-tokens", "0", "--no-plot", "--log-every", "1",
           "--out", str(run)] + (["--dp-shard", str(n)] if n > 1 else []) + (["--device", "cpu"] if args.smoke else [])
    env = {**os.environ, "PYTHONPATH": str(REPO), "NCCL_NVLS_ENABLE": "0"}
    if args.smoke:
        env["OMP_NUM_THREADS"] = "1"
    print("$", " ".join(cmd[1:]), flush=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return {"gpus": n, "error": r.stderr[-2000:]}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [m["tok_per_s"] for m in rows[min(len(rows) - 1, args.skip):]]
    return {"gpus": n, "command": " ".join(cmd[3:]), "tok_per_s": statistics.median(rates),
            "tok_per_s_per_gpu": statistics.median(rates) / n, "final_loss": rows[-1]["loss"], "steps": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-per-gpu", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median (compile, allocator)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.skip = 2
    points = [run_point(n, args) for n in args.gpus]
    base = next((p for p in points if p["gpus"] == 1 and "error" not in p), None)
    md = ["| GPUs | tokens/s | tokens/s per GPU | speedup vs 1 GPU | target |", "|---:|---:|---:|---:|---:|"]
    for p in points:
        if "error" in p:
            md.append(f"| {p['gpus']} | failed: {p['error'].splitlines()[-1] if p['error'] else '?'} | | | |")
            continue
        if base is not None:
            p["speedup"] = p["tok_per_s"] / base["tok_per_s"]
        md.append(f"| {p['gpus']} | {p['tok_per_s']:,.0f} | {p['tok_per_s_per_gpu']:,.0f} | "
                  f"{p.get('speedup', float('nan')):.2f} | {TARGET.get(p['gpus'], '–')} |")
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.smoke else platform.processor()
    report = {"device": device, "torch": torch.__version__, "points": points, "preset": "tiny" if args.smoke else
              args.preset, "batch_per_gpu": 2 if args.smoke else args.batch_per_gpu,
              "seq_len": 64 if args.smoke else args.seq_len,
              "command": " ".join(["bench/multi_gpu/train_scaling.py", *sys.argv[1:]])}
    (args.out / "train_scaling.json").write_text(json.dumps(report, indent=2) + "\n")
    head = [f"# train_scaling ({device})", "", f"torch {torch.__version__}; command: `python {report['command']}`",
            f"; preset {'tiny' if args.smoke else args.preset}, {args.batch_per_gpu if not args.smoke else 2} "
            f"sequences of {args.seq_len if not args.smoke else 64} tokens per GPU per step", ""]
    (args.out / "train_scaling.md").write_text("\n".join(head + md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
