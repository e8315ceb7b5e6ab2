"""``k3 plan``'s estimates beside the multi-GPU measurements.

    python bench/multi_gpu/plan_vs_measured.py --results $OUT/multi_gpu

Reads what the other scripts wrote in ``--results`` (``train_scaling.json``, ``moe_ep.json``, ``cp_long_cp*.json``,
``generate_sharded_*.json``), evaluates ``k3.distributed.plan`` for the same model, layout and sizes with its default
H200 assumptions, and writes ``plan_vs_measured.json`` / ``.md``: estimate, measurement and their ratio per row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from k3.config import K3Config  # noqa: E402
from k3.distributed.plan import GB, Hardware, Layout, _a2a_seconds, model_stats, serve_estimate, train_estimate  # noqa: E402


def _row(what: str, est: float, got: float, unit: str) -> dict:
    return {"what": what, "estimate": est, "measured": got, "unit": unit, "ratio": est / got if got else None}


def rows(results: Path, hw: Hardware) -> list[dict]:
    out = []
    f = results / "train_scaling.json"
    if f.is_file():
        r = json.loads(f.read_text())
        ms = model_stats(K3Config.from_preset(r["preset"]))
        for p in r["points"]:
            if "error" in p:
                continue
            n, b = p["gpus"], r["batch_per_gpu"]
            e = train_estimate(ms, hw, Layout(dp_shard=n), r["seq_len"], b * n, b, "none", "muon")
            out.append(_row(f"train {r['preset']} dp-shard {n}: tokens/s per GPU", e.tokens / e.step_s / n,
                            p["tok_per_s_per_gpu"], "tokens/s"))
    f = results / "moe_ep.json"
    if f.is_file():
        r = json.loads(f.read_text())
        R, S, k = r["env"]["world_size"], r["tokens_per_gpu"], r["top_k"]
        w = r["widths"]
        cfg = K3Config.from_preset("k3", n_experts=r["experts"], top_k=k)
        per_token = (2 * w["d"] * r["experts"] + 4 * w["d"] * w["latent"] + 6 * w["d"] * cfg.shared_dim
                     + k * 6 * w["latent"] * w["expert"])
        compute = 3 * per_token * S / (hw.peak_tflops * 1e12 * hw.efficiency)
        a2a = _a2a_seconds(hw, 2 * 2 * S * k * w["latent"] * 2 * (R - 1) / R, R)
        for routing in ("random", "skewed"):
            if routing in r:
                out.append(_row(f"MoE layer EP {R}, {routing}: fwd+bwd ms", (compute + a2a) * 1e3,
                                r[routing]["fwd_bwd_ms"], "ms"))
    for f in sorted(results.glob("cp_long_cp*.json")):
        r = json.loads(f.read_text())
        ms = model_stats(K3Config.from_preset(r["preset"]))
        e = train_estimate(ms, hw, Layout(cp=r["cp"]), r["tokens"], 1, 1, r["checkpointing"], "muon")
        out.append(_row(f"{r['preset']} {r['tokens']:,} tokens cp {r['cp']}: fwd+bwd ms",
                        (e.compute_s + e.comm_s["CP all-gather"]) * 1e3, r["fwd_bwd_ms"], "ms"))
        if "peak_gib" in r:
            act = e.memory["activations"] + e.memory["logits"] + 2 * ms.total  # + the bf16 weights (no FSDP here)
            out.append(_row(f"{r['preset']} cp {r['cp']}: activations + weights GB", act / GB,
                            r["peak_gib"] * 2**30 / GB, "GB"))
    for f in sorted(results.glob("generate_sharded_*.json")):
        from k3.ckpt.released import read_released_config

        r = json.loads(f.read_text())
        held, R = r["held_bytes"], r["ranks"]
        ms = model_stats(read_released_config(r["model"])[0])
        s = serve_estimate(ms, hw, R, 1, r["context"])
        out.append(_row(f"generate {R} rank(s): experts GB per rank", s.memory["experts (MXFP4)"] / GB,
                        held["experts"] / GB, "GB"))
        out.append(_row(f"generate {R} rank(s): dense GB per rank", s.memory["dense weights (bf16)"] / GB,
                        held["dense"] / GB, "GB"))
        out.append(_row(f"generate {R} rank(s): decode tokens/s (batch 1)", 1 / s.decode_s,
                        r["decode_tokens_per_s"], "tokens/s"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=Path, required=True)
    args = ap.parse_args()
    hw = Hardware()
    rs = rows(args.results, hw)
    md = ["Estimates from `k3.distributed.plan` with its default assumptions (" + hw.lines()[0] + ").", "",
          "| quantity | plan | measured | plan / measured |", "|---|---:|---:|---:|"]
    for r in rs:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "–"
        md.append(f"| {r['what']} | {r['estimate']:,.2f} | {r['measured']:,.2f} | {ratio} |")
    (args.results / "plan_vs_measured.json").write_text(json.dumps(rs, indent=2) + "\n")
    (args.results / "plan_vs_measured.md").write_text("# plan_vs_measured\n\n" + "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
