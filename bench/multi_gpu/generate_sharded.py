"""The release expert-sharded: a few-layer checkpoint at K3 widths in the released layout (MXFP4
experts), loaded with each rank reading only its experts, logits against one GPU and decode tokens/s.

    python bench/multi_gpu/generate_sharded.py make --out $OUT/k3_mini                   # write the checkpoint once
    torchrun --standalone --nproc_per_node 1 bench/multi_gpu/generate_sharded.py run --model $OUT/k3_mini --out $OUT/multi_gpu
    torchrun --standalone --nproc_per_node 8 bench/multi_gpu/generate_sharded.py run --model $OUT/k3_mini --out $OUT/multi_gpu
    # the command users run (rank 0 prints):
    torchrun --standalone --nproc_per_node 8 -m k3 generate --model $OUT/k3_mini --prompt "The " --max-new-tokens 32
    # CPU, gloo, preset tiny end to end:
    python bench/multi_gpu/generate_sharded.py make --smoke --out /tmp/mg/ckpt
    torchrun --standalone --nproc_per_node 2 bench/multi_gpu/generate_sharded.py run --smoke --model /tmp/mg/ckpt --out /tmp/mg

``make``: K3's widths (d 7168, 896 experts of 3584 → 3072, top-16, vocab 163,840) with ``--layers`` layers (layer 0
dense, the rest MoE, the last one MLA); dense weights random bf16, experts random MXFP4 codes and scales (what the
kernels read; no quantisation pass), written by ``save_pretrained`` in shards, with a byte-level tokenizer file.
``run``: per-rank memory after loading (≈ dense + experts / N), the prompt's logits vs the one-GPU run's (saved by
the N = 1 run in ``--out``; bf16 ≤ 2e-2), greedy decode tokens/s and the same tokens as one GPU.
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from k3.config import K3Config  # noqa: E402


def mini_config(layers: int, smoke: bool, vocab: int = 163_840) -> K3Config:
    if smoke:
        return K3Config.from_preset("tiny", vocab_size=512, bos_token_id=256, eos_token_id=258, pad_token_id=511)
    specials = {} if vocab == 163_840 else dict(bos_token_id=256, eos_token_id=257, pad_token_id=vocab - 1)
    return K3Config.from_preset("k3", num_layers=layers, mla_layers=[layers - 1], attn_res_block_size=2,
                                vocab_size=vocab, **specials)


def make(args: argparse.Namespace) -> None:
    from k3.ckpt.released import save_pretrained
    from k3.layers.experts_mxfp4 import MXFP4GroupedExperts
    from k3.layers.moe import LatentMoE
    from k3.model import K3ForCausalLM

    cfg = mini_config(args.layers, args.smoke, args.vocab)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    for moe in (m for m in model.modules() if isinstance(m, LatentMoE)):
        e = moe.experts
        moe.experts = MXFP4GroupedExperts(e.n_experts, e.latent_dim, e.expert_dim, e.beta1, e.beta2, device="meta")
    model = model.to_empty(device=device)
    model.reset_parameters()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.02)  # pseudo-queries start at zero; give the depth mixes something to do
        for name, b in model.named_buffers():
            if name.endswith("_packed"):
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=device))
            elif name.endswith("_scale"):
                b.copy_(torch.randint(119, 124, b.shape, dtype=torch.uint8, device=device))  # 2^-8 … 2^-4
    save_pretrained(model, args.out, max_shard_bytes=(4 << 20) if args.smoke else (4 << 30))
    (Path(args.out) / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n"
                                                           for i in range(256)))
    print(f"wrote {args.out}: {cfg.num_layers} layers, {model.num_parameters():,} parameters")


def run(args: argparse.Namespace) -> None:
    from _common import environment, gather_ints, init, log, write
    import torch.distributed as dist

    from k3.ckpt.released import load_pretrained
    from k3.distributed.release import load_expert_sharded
    from k3.infer.generate import generate_ids

    rank, R, device = init(args.smoke)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if R == 1:
        model = load_pretrained(args.model, device=device, verbose=False)
    else:
        model = load_expert_sharded(args.model, dist.group.WORLD, device=device, verbose=False)
    load_s = time.perf_counter() - t0
    held = {"experts": sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".experts." in n),
            "dense": sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
                         if ".experts." not in n)}
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else held["experts"] + held["dense"]
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (1, args.prompt_tokens), generator=g)
    with torch.no_grad():
        logits = model(prompt.to(device)).logits[0].float().cpu()
    new, timing = generate_ids(model, prompt[0].tolist(), max_new_tokens=args.new_tokens, temperature=0.0,
                               device=device)
    report = {"env": environment(device), "ranks": R, "model": str(args.model), "load_s": load_s, "held_bytes": held,
              "context": args.prompt_tokens + args.new_tokens,
              "allocated_bytes_per_rank": gather_ints(allocated), "decode_tokens_per_s":
              timing["new_tokens"] / max(timing["decode_s"], 1e-9), "prefill_s": timing["prefill_s"],
              "new_ids": new}
    out = Path(args.out)
    ref_path = out / "generate_sharded_ref.pt"
    if R == 1 and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"logits": logits, "new_ids": new, "model": str(args.model)}, ref_path)
    elif ref_path.is_file():
        ref = torch.load(ref_path)
        a, b = logits.double(), ref["logits"].double()
        report["logits_rel_vs_one_gpu"] = float((a - b).norm() / b.norm())
        report["same_tokens_as_one_gpu"] = ref["new_ids"] == new
    log(f"loaded in {load_s:.1f} s; per-rank experts {held['experts'] / 2**30:.2f} GiB, dense "
        f"{held['dense'] / 2**30:.2f} GiB")
    md = [f"Checkpoint `{args.model}` (MXFP4 experts), {R} rank(s), expert-sharded; prompt {args.prompt_tokens} "
          f"tokens, {args.new_tokens} greedy tokens.", "",
          "| ranks | experts GiB / rank | dense GiB / rank | allocated GiB per rank | logits rel vs 1 GPU | same tokens | "
          "decode tokens/s | load s |", "|---:|---:|---:|---|---:|:--:|---:|---:|",
          f"| {R} | {held['experts'] / 2**30:.2f} | {held['dense'] / 2**30:.2f} | "
          f"{[round(a / 2**30, 2) for a in report['allocated_bytes_per_rank']]} | "
          f"{report.get('logits_rel_vs_one_gpu', float('nan')):.2e} | {report.get('same_tokens_as_one_gpu', '–')} | "
          f"{report['decode_tokens_per_s']:.1f} | {load_s:.1f} |"]
    write(out, f"generate_sharded_{R}", report, md)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=3)
    m.add_argument("--vocab", type=int, default=163_840, help="vocabulary (K3's by default; smaller writes faster)")
    m.add_argument("--smoke", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--prompt-tokens", type=int, default=32)
    r.add_argument("--new-tokens", type=int, default=64)
    r.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    make(args) if args.cmd == "make" else run(args)


if __name__ == "__main__":
    main()
