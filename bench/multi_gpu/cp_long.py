"""Whole-model context parallel on long sequences: ``small`` at 256K tokens, fwd+bwd.

    torchrun --standalone --nproc_per_node 1 bench/multi_gpu/cp_long.py --out $OUT/multi_gpu     # the one-GPU time
    torchrun --standalone --nproc_per_node 2 bench/multi_gpu/cp_long.py --out $OUT/multi_gpu     # cp 2
    torchrun --standalone --nproc_per_node 4 bench/multi_gpu/cp_long.py --out $OUT/multi_gpu     # cp 4
    torchrun --standalone --nproc_per_node 2 bench/multi_gpu/cp_long.py --smoke --out /tmp/mg   # CPU, gloo, tiny

Every rank holds T/cp tokens of one sequence (``apply_context_parallel``); the model is replicated (no FSDP: the
measurement is the model's forward + backward, with full activation checkpointing). Writes ``cp_long_cp{N}.json``
/ ``.md``; with the one-GPU result in the same folder, the speedup. Also: exactness at a shorter length (CP vs one
GPU, logits and loss), and the bytes each rank sends per layer at T and at T/4 (KDA traffic independent of T).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import environment, init, log, timed, write

import torch
import torch.distributed as dist

from k3.config import K3Config
from k3.distributed.context_parallel import apply_context_parallel
from k3.model import K3ForCausalLM


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def chunked_loss(logits: torch.Tensor, ids: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """Next-token cross entropy within this slice, 16K positions at a time, each recomputed in the backward: the
    fp32 copies of [T, vocab] logits (34 GB at 256K tokens and vocab 32K) never exist at once."""
    from torch.utils.checkpoint import checkpoint

    def part(lg: torch.Tensor, tg: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(lg.float(), tg, reduction="sum")

    T = logits.shape[1] - 1  # split, not slices: the backward concatenates the chunks' gradients once
    total = sum(checkpoint(part, lg, tg, use_reentrant=False)
                for lg, tg in zip(logits[0, :-1].split(chunk), ids[0, 1:].split(chunk)))
    return total / T


def make_model(cfg: K3Config, device: torch.device, checkpointing: str) -> K3ForCausalLM:
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(device)
    model.gradient_checkpointing_enable(checkpointing)
    return model.train()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=262144, help="sequence length (all cp ranks together)")
    ap.add_argument("--check-tokens", type=int, default=16384, help="length of the exactness check")
    ap.add_argument("--checkpointing", default="full", choices=["none", "full", "selective"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, preset tiny at 64 tokens")
    args = ap.parse_args()
    rank, R, device = init(args.smoke)
    preset, T, Tc = ("tiny", 64, 32) if args.smoke else (args.preset, args.tokens, args.check_tokens)
    cfg = K3Config.from_preset(preset)
    model = make_model(cfg, device, args.checkpointing)
    cp = apply_context_parallel(model, dist.group.WORLD) if R > 1 else None
    shard = cp.shard if cp is not None else (lambda t: t)
    g = torch.Generator().manual_seed(1)
    report: dict = {"env": environment(device), "preset": preset, "tokens": T, "cp": R,
                    "checkpointing": args.checkpointing}

    # exactness: CP vs this GPU alone on the whole (shorter) sequence
    if R > 1:
        ids = torch.randint(0, cfg.vocab_size, (1, Tc), generator=g).to(device)
        ref = make_model(cfg, device, "none")
        with torch.no_grad():
            want = ref(ids, labels=ids)
            got = model(shard(ids), labels=shard(ids))
        report["check"] = {"tokens": Tc, "logits_rel": rel(got.logits, shard(want.logits)),
                           "loss_abs": abs(float(got.loss) - float(want.loss))}
        del ref, want, got
        log(f"exactness at {Tc} tokens: {report['check']}")

    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g).to(device)
    local = shard(ids)

    def step() -> None:
        chunked_loss(model(local).logits, local).backward()
        for p in model.parameters():
            p.grad = None

    ms = timed(step, device, args.iters, warmup=1)
    report.update(fwd_bwd_ms=ms, tokens_per_s=T / ms * 1e3)
    if device.type == "cuda":
        report["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if cp is not None:
        n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
        per_layer = {}
        for t in (T, T // 4):
            with torch.no_grad():
                model(shard(ids[:, :t]))
            b = cp.bytes
            per_layer[t] = {"kda_state_bytes": b["kda_states"] // max(n_kda, 1),
                            "conv_halo_bytes": b["conv_halos"] // max(n_kda, 1),
                            "mla_latent_bytes": b["mla_latents"] // max(n_mla, 1)}
        report["bytes_per_rank_per_layer_fwd"] = per_layer
    one = args.out / "cp_long_cp1.json"
    if R > 1 and one.is_file():
        base = json.loads(one.read_text())
        if base.get("tokens") == T and base.get("preset") == preset:
            report["speedup_vs_one_gpu"] = base["fwd_bwd_ms"] / ms

    md = [f"`{preset}`, one sequence of {T:,} tokens, cp {R} ({T // R:,} tokens per rank), activation "
          f"checkpointing {args.checkpointing}, fwd+bwd (next-token loss within each slice, in 16K-position chunks).",
          "",
          "| cp | fwd+bwd ms | tokens/s | speedup vs one GPU | peak GiB |", "|---:|---:|---:|---:|---:|",
          f"| {R} | {ms:.1f} | {report['tokens_per_s']:,.0f} | "
          f"{report.get('speedup_vs_one_gpu', float('nan')):.2f} | {report.get('peak_gib', float('nan')):.1f} |"]
    if cp is not None:
        md += ["", f"Exactness at {Tc:,} tokens (CP vs one GPU): logits rel {report['check']['logits_rel']:.2e}, "
               f"loss |Δ| {report['check']['loss_abs']:.2e}", "",
               "| T | KDA state bytes / layer | conv halo bytes / layer | MLA latent bytes / layer |",
               "|---:|---:|---:|---:|"]
        for t, b in report["bytes_per_rank_per_layer_fwd"].items():
            md.append(f"| {t:,} | {b['kda_state_bytes']:,} | {b['conv_halo_bytes']:,} | {b['mla_latent_bytes']:,} |")
    write(args.out, f"cp_long_cp{R}", report, md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
