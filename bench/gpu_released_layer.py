"""One-GPU check of the released-weights path at real K3 dimensions, plus the W4A16 grouped GEMM check and timings.

1. Build a 2-layer model with K3's real widths — layer 0: KDA (96×128) + dense SiTU MLP (33,792), layer 1: Gated
   MLA (96 heads, q_lora 1536, kv_lora 512) + Latent MoE (896 MXFP4 experts, ℓ 3584, F 3072, top-16) — with random
   weights (experts: random E2M1 bytes and E8M0 scales), write it in the released layout (``save_pretrained``:
   sharded safetensors + index + kimi_k3 config.json), load it with ``load_pretrained(device="cuda")`` and run a
   prefill; the MoE runs the Triton W4A16 kernels and is compared with the dequantise-per-expert path.
2. W4A16 grouped GEMM (bf16 activations) vs dequantise-then-multiply (fp32) on several shapes.
3. Timings: fused gate/up GEMM (+SiTU-GLU) and down GEMM at decode and prefill row counts, against bf16
   ``grouped_mm`` on the dequantised weights; and the whole MoE layer.

Usage: ``python bench/gpu_released_layer.py --out DIR [--tiny]`` (``--tiny``: small widths, runs on CPU with
``TRITON_INTERPRET=1 K3_MXFP4_BACKEND=triton`` to check the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3.ops.moe.mxfp4 import dequantize_mxfp4  # noqa: E402
from k3.ckpt.released import _swap_in_mxfp4, load_pretrained, save_pretrained  # noqa: E402
from k3.config import K3Config  # noqa: E402
from k3.layers.experts_mxfp4 import MXFP4GroupedExperts  # noqa: E402
from k3.model import K3ForCausalLM  # noqa: E402
from k3.ops.moe.grouped import grouped_mm  # noqa: E402
from k3.ops.moe.mxfp4_gemm import (mxfp4_grouped_glu, mxfp4_grouped_glu_reference, mxfp4_grouped_mm,  # noqa: E402
                                   mxfp4_grouped_mm_reference)

LOG_FILE: list[Path] = []


def log(msg: str) -> None:
    """Print and append to $OUT/released_layer.log at once (a run cut short still leaves its log)."""
    print(msg, flush=True)
    for f in LOG_FILE:
        with open(f, "a") as fh:
            fh.write(msg + "\n")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def layer_config(tiny: bool) -> K3Config:
    if tiny:
        return K3Config(vocab_size=512, hidden_size=64, num_layers=2, mla_layers=(1,), kda_num_heads=2,
                        kda_head_dim=16, mla_num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, dense_intermediate_size=96, n_experts=8, top_k=2,
                        expert_dim=64, latent_dim=32, attn_res_block_size=12, dtype="float32",
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    # every layer width as released (layer 0 KDA + dense MLP, layer 1 MLA + MoE); a 32k vocabulary keeps the
    # embedding/lm_head (not under test here) from dominating the checkpoint's size
    return K3Config(num_layers=2, mla_layers=(1,), vocab_size=32_768, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None)


@torch.no_grad()
def random_release_model(cfg: K3Config, device: torch.device) -> K3ForCausalLM:
    """K3ForCausalLM with MXFP4 experts and random weights on ``device`` (built on meta, then materialised)."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    _swap_in_mxfp4(model)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.dtype == torch.uint8:
            if name.endswith("_packed"):
                p.copy_(torch.randint(0, 256, p.shape, generator=g, device=device, dtype=torch.int32))
            else:  # E8M0 scales around 2^-8: codes (RMS ~3) × 2^-8 ~ 1/√fan_in
                p.copy_(torch.randint(119, 122, p.shape, generator=g, device=device, dtype=torch.int32))
        elif name.endswith(("A_log", "e_score_correction_bias")):
            p.copy_(0.1 * torch.randn(p.shape, generator=g, device=device))
        elif p.dim() == 1:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=device))
        else:
            fan_in = p.shape[-1] if not name.endswith("conv1d.weight") else 4
            scale = 1.0 if name.endswith("embed_tokens.weight") else fan_in ** -0.5
            p.copy_(scale * torch.randn(p.shape, generator=g, device=device))
    return model.eval()


def timed(fn, iters: int = 10, warmup: int = 3) -> float:
    """Mean milliseconds per call (CUDA events), or wall time on CPU."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1000 / iters


def routing(tokens: int, n_exp: int, k: int, device: torch.device) -> torch.Tensor:
    """offs [E] int32 for ``tokens`` tokens each routed to k distinct random experts."""
    idx = torch.rand(tokens, n_exp, device=device).topk(k, dim=1).indices
    return torch.cumsum(torch.bincount(idx.reshape(-1), minlength=n_exp), 0).to(torch.int32)


def check_gemm(device: torch.device, dtype: torch.dtype, tiny: bool) -> list[dict]:
    """W4A16 vs dequantise-then-multiply on a few shapes (uneven groups, empty experts, tail rows)."""
    rows = []
    shapes = [(4, 40, 96, [5, 0, 17, 1], 3)] if tiny else [
        (8, 384, 512, [0, 1, 7, 64, 200, 3, 0, 33], 5), (32, 3072, 3584, None, 0), (32, 3584, 3072, None, 0)]
    for E, N, K, counts, tail in shapes:
        g = torch.Generator(device=device).manual_seed(1)
        if counts is None:
            offs = routing(64, E, 4, device)
        else:
            offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        R = int(offs[-1]) + tail
        x = torch.randn(R, K, generator=g, device=device).to(dtype)
        mk = lambda: (torch.randint(0, 256, (E, N, K // 2), generator=g, device=device, dtype=torch.int32).to(torch.uint8),  # noqa: E731
                      torch.randint(119, 122, (E, N, K // 32), generator=g, device=device, dtype=torch.int32).to(torch.uint8))
        w1, w3 = mk(), mk()
        out = torch.full((R, N), float("nan"), device=device, dtype=dtype)
        y = mxfp4_grouped_mm(x, *w1, offs, out=out)
        e_mm = rel(y, mxfp4_grouped_mm_reference(x, *w1, offs))
        h = mxfp4_grouped_glu(x, w1, w3, offs)
        e_glu = rel(h, mxfp4_grouped_glu_reference(x, w1, w3, offs))
        ok = bool(torch.isfinite(y).all()) and bool(y[int(offs[-1]):].eq(0).all())
        rows.append(dict(E=E, N=N, K=K, R=R, rel_mm=e_mm, rel_glu=e_glu, finite_and_tail_zero=ok))
        log(f"  gemm E={E} N={N} K={K} R={R}: rel_err mm {e_mm:.2e}  glu {e_glu:.2e}  finite/tail-zero {ok}")
    return rows


def time_gemms(cfg: K3Config, device: torch.device) -> list[dict]:
    """Fused gate/up (+SiTU-GLU) and down at K3's expert shapes, decode and prefill row counts, vs bf16 grouped_mm."""
    E, F, Lt = cfg.n_experts, cfg.expert_dim, cfg.latent_dim
    g = torch.Generator(device=device).manual_seed(2)
    pk = lambda o, i: (torch.randint(0, 256, (E, o, i // 2), generator=g, device=device, dtype=torch.int32).to(torch.uint8),  # noqa: E731
                       torch.randint(119, 122, (E, o, i // 32), generator=g, device=device, dtype=torch.int32).to(torch.uint8))
    w1, w3, w2 = pk(F, Lt), pk(F, Lt), pk(Lt, F)
    w1_bf16 = torch.empty(E, F, Lt, device=device, dtype=torch.bfloat16)
    for e in range(E):  # one expert at a time: the fp32/int64 temporaries of all 896 would not fit
        w1_bf16[e] = dequantize_mxfp4(w1[0][e], w1[1][e], torch.bfloat16)
    w1_bf16_t = w1_bf16.transpose(1, 2)  # [E, ℓ, F] view, as GroupedExperts passes its weights to grouped_mm
    rows = []
    for tokens in (1, 8, 64, 512, 4096):
        offs = routing(tokens, E, cfg.top_k, device)
        R = tokens * cfg.top_k
        hit = int((torch.diff(offs, prepend=offs.new_zeros(1)) > 0).sum())
        x = torch.randn(R, Lt, device=device, dtype=torch.bfloat16)
        h = torch.randn(R, F, device=device, dtype=torch.bfloat16)
        t_glu = timed(lambda: mxfp4_grouped_glu(x, w1, w3, offs))
        t_w1 = timed(lambda: mxfp4_grouped_mm(x, *w1, offs))
        t_w2 = timed(lambda: mxfp4_grouped_mm(h, *w2, offs))
        t_bf16 = timed(lambda: grouped_mm(x, w1_bf16_t, offs))
        q_bytes = hit * F * Lt * 17 / 32  # packed + scales of one [F, ℓ] matrix per expert hit
        row = dict(tokens=tokens, rows=R, experts_hit=hit, glu_w1w3_ms=t_glu, w1_ms=t_w1, w2_ms=t_w2,
                   bf16_w1_ms=t_bf16, w1_GBps=q_bytes / t_w1 / 1e6, bf16_w1_GBps=hit * F * Lt * 2 / t_bf16 / 1e6,
                   w1_TFLOPs=2 * R * F * Lt / t_w1 / 1e9, bf16_w1_TFLOPs=2 * R * F * Lt / t_bf16 / 1e9)
        rows.append(row)
        log(f"  tokens {tokens:5d} rows {R:6d} hit {hit:3d}: glu(w1,w3) {t_glu:.3f} ms | w1 {t_w1:.3f} ms "
            f"({row['w1_GBps']:.0f} GB/s, {row['w1_TFLOPs']:.0f} TF/s) | bf16 w1 {t_bf16:.3f} ms "
            f"({row['bf16_w1_GBps']:.0f} GB/s, {row['bf16_w1_TFLOPs']:.0f} TF/s) | w2 {t_w2:.3f} ms")
    del w1_bf16_t, w1_bf16
    return rows


def ckpt_dir() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 40e9 else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="k3_layer_ckpt_", dir=base))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    LOG_FILE.append(out / "released_layer.log")
    (out / "released_layer.log").write_text("")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    act = torch.float32 if args.tiny and device.type == "cpu" else torch.bfloat16
    res: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                 "torch": torch.__version__, "python": platform.python_version(),
                 "command": " ".join([sys.executable, *sys.argv])}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    log(f"device {res['device']}  torch {res['torch']}  triton {res.get('triton')}  "
        f"env K3_KDA_BACKEND={os.environ.get('K3_KDA_BACKEND')} K3_MOE_BACKEND={os.environ.get('K3_MOE_BACKEND')}")
    start = time.perf_counter()

    log("1. W4A16 grouped GEMM vs dequantise-then-multiply")
    try:
        res["gemm_check"] = check_gemm(device, act, args.tiny)
    except Exception:  # keep going: the layer check can still run on the dequantising path
        log("  FAILED:\n" + traceback.format_exc())
        res["gemm_check"] = "failed"
        os.environ["K3_MXFP4_BACKEND"] = "torch"
    save(out, res)

    log(f"2. layer-sized checkpoint in the released layout  [t={time.perf_counter() - start:.0f} s]")
    cfg = layer_config(args.tiny)
    folder = ckpt_dir()
    try:
        t0 = time.perf_counter()
        model = random_release_model(cfg, device)
        t1 = time.perf_counter()
        save_pretrained(model, folder, max_shard_bytes=4 * 2**30)
        t2 = time.perf_counter()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        shards = len(list(folder.glob("model-*.safetensors")))
        log(f"  wrote {size / 1e9:.2f} GB in {shards} shards to {folder.parent} ({t2 - t1:.1f} s; init {t1 - t0:.1f} s)")
        t3 = time.perf_counter()
        model = load_pretrained(folder, device=device, verbose=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t4 = time.perf_counter()
        experts = model.model.layers[1].block_sparse_moe.experts
        assert isinstance(experts, MXFP4GroupedExperts), type(experts)
        mem = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        log(f"  loaded in {t4 - t3:.1f} s ({size / 1e9 / (t4 - t3):.1f} GB/s); GPU memory {mem:.1f} GiB; "
            f"experts {type(experts).__name__} {tuple(experts.w1_packed.shape)} u8")
        res.update(ckpt_GB=size / 1e9, shards=shards, save_s=t2 - t1, load_s=t4 - t3, gpu_mem_GiB=mem)

        log(f"3. [t={time.perf_counter() - start:.0f} s] prefill through the loaded model (Triton W4A16 experts vs dequantise-per-expert path)")
        ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(3)).to(device)
        with torch.no_grad():
            try:
                logits = model(ids).logits.float()
            except Exception:  # another op's kernel failing must not hide whether the checkpoint runs
                log("  default backends FAILED, retrying with K3_MOE_BACKEND=torch:\n" + traceback.format_exc())
                os.environ["K3_MOE_BACKEND"] = "torch"
                os.environ.setdefault("K3_MXFP4_BACKEND", "triton")
                res["moe_backend_fallback"] = True
                logits = model(ids).logits.float()
            before = os.environ.get("K3_MXFP4_BACKEND")
            os.environ["K3_MXFP4_BACKEND"] = "torch"
            logits_ref = model(ids).logits.float()
            if before is None:
                os.environ.pop("K3_MXFP4_BACKEND")
            else:
                os.environ["K3_MXFP4_BACKEND"] = before
        e = rel(logits, logits_ref)
        ok = bool(torch.isfinite(logits).all())
        log(f"  logits {tuple(logits.shape)} finite {ok}, std {logits.std():.3f}; rel err vs dequantised path {e:.2e}")
        res.update(prefill_logits_finite=ok, prefill_rel_err_vs_dequantised=e)
        save(out, res)
        moe = model.model.layers[1].block_sparse_moe
        for T in (1, 64, 1024) if not args.tiny else (1, 5):
            x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=cfg.torch_dtype)
            with torch.no_grad():
                t = timed(lambda: moe(x), iters=5, warmup=2)
            log(f"  MoE layer forward, {T} tokens: {t:.3f} ms")
            res[f"moe_layer_ms_T{T}"] = t
        del model, moe
        if device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    if not args.tiny and res["gemm_check"] != "failed":
        log(f"4. [t={time.perf_counter() - start:.0f} s] W4A16 timings at K3 expert shapes (E=896, F=3072, ℓ=3584, top-16)")
        res["timings"] = time_gemms(cfg, device)
    log(f"done in {time.perf_counter() - start:.0f} s")
    save(out, res)


def save(out: Path, res: dict) -> None:
    (out / "released_layer.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
