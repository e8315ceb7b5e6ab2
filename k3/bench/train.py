"""``python -m k3.bench train``: the trainer's real step (forward, backward, clip, optimizer, QB) on one GPU.

    python -m k3.bench train --preset small --seq-len 4096 --batch-size 8
    python -m k3.bench train --slice k3 --optimizer muon   # d 7168, 3 KDA + 1 MLA, 32 experts top-2 (7.0 B params)
    python -m k3.bench train --loss-curve 200      # fast vs reference path, same seed and data → loss_curve.png/json

Paths, each built fresh and timed in the same process (``--paths``):

``fast``            what ``k3 train`` runs on a GPU: ``parallelize_k3`` on a world-size-1 process group (bf16
                    parameters with fp32 masters beside them, regional ``torch.compile``), the trainer's
                    ``Stepper`` (AdamW fused over master, moments and bf16 weight / foreach Muon, QB step, metrics
                    read once per step), the whole step captured in one CUDA graph after two eager steps and
                    replayed (``k3.train.graph``)
``fast-eager``      the same step issued op by op from Python (``--cuda-graph off``)
``fast-muon``       the same with Muon whatever ``--optimizer`` says (Newton–Schulz on every weight matrix: its cost
                    grows with the parameters, not the batch — see ``optimizer ms``)
``fast-nocompile``  the same without ``torch.compile``, issued eagerly
``reference``       the eager path: fp32 weights under ``torch.autocast(bf16)``, logits + fp32 cross entropy, no
                    compile, no FSDP

Reported per path: ms per step (median of the timed steps), tokens/s, MFU, peak memory (allocated and reserved).
FLOPs per step = 3 × forward FLOPs: 2 × active matmul parameters per token (every Linear incl. the LM head and the
router, experts at top_k / n_experts; not the embedding) + MLA attention (causal: 2·T²/2·H·(d_qk + d_v) per sequence)
+ the KDA chunked algorithm (chunk C = 64: 6CK + 4CV + 6KV + C² per token and head). ``mfu_6n`` counts the matmul and
MLA terms only (the definition of the 12 % baseline). Peak: a bf16 8192³ matmul measured in the same run.
The fast path is also profiled (``torch.profiler``, CUDA kernels) and its kernel time split into classes by name.
Writes ``train.json`` and ``train.md`` (and ``loss_curve.json/png``) under ``--out``.
"""

from __future__ import annotations

import gc
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from k3.bench import BenchParser
from k3.config import K3Config
from k3.data import EMBEDDED, WindowLoader, load_tokenizer, text_streams
from k3.distributed.data_parallel import destroy_distributed, init_distributed
from k3.distributed.parallel_dims import ParallelDims
from k3.distributed.parallelize import parallelize_k3
from k3.layers.moe import GroupedExperts, MoEGate
from k3.model import AC_POLICIES, K3ForCausalLM
from k3.train.optim import build_optimizer, lr_factor
from k3.train.trainer import Stepper, TrainArgs, _Data, compute_dtype, resolve_device, use_cuda_graph
from k3.utils import atomic_write_text, atomic_write_with

__all__ = ["main", "slice_config", "step_flops", "classify_kernel"]

PATHS = ("fast", "fast-eager", "fast-muon", "fast-nocompile", "reference")
KDA_CHUNK = 64
_CLASSES = [  # (class, pattern on the lower-cased kernel name), first match wins
    # before kda: the flash MLA's backward has a "delta" kernel
    ("attention", r"flash|fmha|attention|sdpa|attn_fwd|attn_bwd|mla|cudnn.*(mha|sdpa)"),
    # before kda: the fused loss's kernel is ce_chunk
    ("loss", r"cross_entropy|crossentropy|linear_ce|ce_chunk|_ce_|loss|logsumexp|softmax"),
    # not FSDP2's chunk_cat (its gradient copy-in); the short convolution and the chunk preparation are KDA's
    ("kda", r"kda|chunk_(?!cat)|_wy|delta|recurrent|gated_delta|solve_tril|_span|short_conv|_prep_(blocks|rows|solve)"),
    ("attnres", r"attn_res|attnres"),
    # before norms: the gradient norm of the clip is a multi-tensor LpNorm
    ("optimizer", r"foreach|multi_tensor|adam"),
    ("norms", r"rms|norm"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|sm90_|sm80_|cublas|grouped_mm|_mm_|matmul|wgmma"),
    ("moe", r"situ|combine|router|rows_sum|permute|qb_|histogram"),
]


def slice_config() -> K3Config:
    """A K3-width slice: d 7168, 96 KDA + 96 MLA heads at K3's head dims, 4 layers (3 KDA + 1 MLA), every layer a
    Latent MoE at ℓ 3584 / expert width 3072 with 32 experts top-2 and K3's two shared experts; vocabulary 32 K
    (K3's 160 K embedding + head alone would be 2.3 B parameters, a third of the slice)."""
    return K3Config.from_preset("k3", num_layers=4, mla_layers=[3], first_k_dense=0, n_experts=32, top_k=2,
                                vocab_size=32_768, bos_token_id=None, eos_token_id=None, pad_token_id=None)


# --- FLOPs -------------------------------------------------------------------------------------------------------
def _active_matmul_params(model: torch.nn.Module) -> int:
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            n += m.weight.numel()
        elif isinstance(m, MoEGate):
            n += m.weight.numel()
        elif isinstance(m, GroupedExperts):
            per = sum(p.numel() for p in (m.w1, m.w2, m.w3)) // m.n_experts
            n += per * model.config.top_k
    return n


def step_flops(model: torch.nn.Module, batch: int, seq: int) -> dict[str, float]:
    """Training FLOPs of one step (forward × 3) by term, from the model's shapes."""
    c = model.config
    tokens = batch * seq
    matmul = 2 * _active_matmul_params(model) * tokens
    n_mla = len(c.mla_layers)
    mla = n_mla * batch * 2 * (seq * seq / 2) * c.mla_num_heads * (c.mla_qk_head_dim + c.v_head_dim)
    K = V = c.kda_head_dim
    C = KDA_CHUNK
    kda = len(c.kda_layers) * tokens * c.kda_num_heads * (6 * C * K + 4 * C * V + 6 * K * V + C * C)
    return {"matmul": 3 * matmul, "mla_attention": 3 * mla, "kda_chunked": 3 * kda,
            "total": 3 * (matmul + mla + kda), "six_n": 3 * (matmul + mla)}


def classify_kernel(name: str) -> str:
    low = name.lower()
    for cls, pat in _CLASSES:
        if re.search(pat, low):
            return cls
    return "other"


# --- data ---------------------------------------------------------------------------------------------------------
class RandomTokens:
    """The loader protocol of the trainer (``next_batch``): uniform random tokens, a fixed seed (timing only)."""

    def __init__(self, vocab: int, batch: int, seq: int, seed: int = 0) -> None:
        self.vocab, self.batch, self.seq = vocab, batch, seq
        self.gen = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.gen)
        return t[:, :-1], t[:, 1:]


def _text_loader(config: K3Config, batch: int, seq: int, seed: int) -> Any:
    """The embedded corpus through the trainer's own loader (real text: the loss curve falls)."""
    tok = load_tokenizer("byte")
    train, _ = text_streams(EMBEDDED, tok, seq, None, "text", None)
    return WindowLoader(train, batch, seq, seed)


# --- the paths ----------------------------------------------------------------------------------------------------
class _Run:
    """One path: ``step(i)`` runs optimizer step i and returns its loss (a float: one host read per step)."""

    def __init__(self, name: str, model: torch.nn.Module, step: Callable[[int], float],
                 opt: torch.optim.Optimizer | None = None, loader: Any = None) -> None:
        self.name, self.model, self.step, self.opt, self.loader = name, model, step, opt, loader


def _train_args(a: Any, steps: int) -> TrainArgs:
    return TrainArgs(preset="small", batch_size=a.batch_size, seq_len=a.seq_len, steps=steps, warmup=a.warmup_lr,
                     optimizer=a.optimizer, lr=a.lr, activation_checkpointing=a.ac, schedule="constant",
                     compile="on")


def _build(config: K3Config, device: torch.device, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        return K3ForCausalLM(config).float().train()


def _fast(name: str, config: K3Config, a: Any, loader: Any, d: Any, steps: int) -> _Run:
    model = _build(config, d.device, a.seed)
    parallelize_k3(model, d.dims, d.mesh, compile=name != "fast-nocompile", activation_checkpointing=a.ac,
                   mixed_precision=compute_dtype(config, d.device))
    targs = _train_args(a, steps)
    targs.optimizer = "muon" if name == "fast-muon" else a.optimizer
    targs.cuda_graph = "off" if name in ("fast-eager", "fast-nocompile") else "auto"
    opt = build_optimizer(model, targs.optimizer, a.lr, capturable=use_cuda_graph(targs, d, config))
    stepper = Stepper(model, opt, _Data(loader, None, None), targs, d)
    return _Run(name, model, lambda i: stepper(i)["loss"], opt, loader)


def _lr(opt: torch.optim.Optimizer, a: Any, i: int, steps: int) -> None:
    for g in opt.param_groups:
        g["lr"] = g["base_lr"] * lr_factor(i, steps, a.warmup_lr, "constant")


def _reference(config: K3Config, a: Any, loader: Any, device: torch.device, steps: int) -> _Run:
    """fp32 weights, eager forward under autocast, logits + fp32 cross entropy (the pre-FSDP trainer's step)."""
    model = _build(config, device, a.seed)
    if a.ac != "none":
        model.gradient_checkpointing_enable(a.ac)
    opt = build_optimizer(model, a.optimizer, a.lr)

    def step(i: int) -> float:
        _lr(opt, a, i, steps)
        x, y = (t.to(device, non_blocking=True) for t in loader.next_batch())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.qb_step()
        return float(loss.detach())

    return _Run("reference", model, step)


# --- measuring ----------------------------------------------------------------------------------------------------
def bench_peak(device: torch.device) -> float:
    """TFLOP/s of a bf16 8192³ matmul (the attainable dense peak of this GPU)."""
    if device.type != "cuda":
        return float("nan")
    import triton

    n = 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: x @ y, warmup=100, rep=500, return_mode="median")
    return 2 * n**3 / ms / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(run: _Run, device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    losses = []
    t_first = time.perf_counter()
    for i in range(warmup):  # compile + autotune happen here (and the CUDA graph's capture, at the third step)
        losses.append(run.step(i))
        if i == 0 and device.type == "cuda":
            # after the first step's compile and autotuning: the peak of the steps, also of a captured one, whose
            # activations are allocated once, during its capture
            _sync(device)
            torch.cuda.reset_peak_memory_stats()
    _sync(device)
    first_s = time.perf_counter() - t_first
    times = []
    for i in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        losses.append(run.step(i))  # the step reads its loss: it has finished on the device
        times.append(time.perf_counter() - t0)
    out = {"ms": 1e3 * statistics.median(times), "ms_all": [1e3 * t for t in times], "warmup_s": first_s,
           "losses": losses}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def _optimizer_ms(run: _Run, device: torch.device, n: int = 3) -> float:
    """Milliseconds of the optimizer step alone (on the gradients of one more forward/backward)."""
    assert run.opt is not None
    x, _ = run.loader.next_batch()
    run.model(x.to(device)).logits.float().mean().backward()
    times = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        run.opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    run.opt.zero_grad(set_to_none=True)
    return 1e3 * statistics.median(times)


_LAUNCH = re.compile(r"^cu(da)?LaunchKernel")
# runtime calls that block the host until the device has caught up (``.item()`` and ``.cpu()`` end in a stream
# synchronize; a plain cudaMemcpy waits by itself)
_SYNC = re.compile(r"^cuda(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy)$")
# ranges the profiler also reports on the device timeline (the optimizer's step, profiler steps): they span kernels
# already counted, so summing them would count those twice
_RANGE = re.compile(r"^(Optimizer\.|ProfilerStep#)")
# the allocator's runtime calls: a cudaFree waits for the whole device, a cudaMalloc may
_ALLOC = re.compile(r"^cuda(Malloc|Free)(Async)?$")


def is_kernel(name: str) -> bool:
    """Whether a device-side profiler event is a kernel or copy (not a range around them)."""
    return not _RANGE.match(name)


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the time the device ran at least one kernel (kernels of
    several streams overlap, so their durations' sum overstates it)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _profile(run: _Run, device: torch.device, start: int, n: int = 2) -> dict[str, Any]:
    """CUDA kernel time per step by class, the largest kernels, the device's busy time (the union of its kernels'
    intervals) against the profiled steps' wall time, and the host side per step: kernel launches, the runtime calls
    that wait for the device and the allocator's calls (what leaves the GPU idle when the step outruns its
    kernels)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(n):
            run.step(start + i)
        _sync(device)
        wall_ms = 1e3 * (time.perf_counter() - t0) / n
    per_kernel: dict[str, float] = {}
    host = {"launches": 0.0, "sync_calls": 0.0, "sync_ms": 0.0, "alloc_calls": 0.0, "alloc_ms": 0.0}
    for ev in prof.key_averages():
        if ev.device_type.name != "CUDA":
            if _LAUNCH.match(ev.key):
                host["launches"] += ev.count / n
            elif _SYNC.match(ev.key):
                host["sync_calls"] += ev.count / n
                host["sync_ms"] += ev.self_cpu_time_total / n / 1e3
            elif _ALLOC.match(ev.key):
                host["alloc_calls"] += ev.count / n
                host["alloc_ms"] += ev.self_cpu_time_total / n / 1e3
            continue
        if not is_kernel(ev.key):
            continue
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0.0)
        per_kernel[ev.key] = per_kernel.get(ev.key, 0.0) + us / n / 1e3
    classes: dict[str, float] = {}
    for k, ms in per_kernel.items():
        cls = classify_kernel(k)
        classes[cls] = classes.get(cls, 0.0) + ms
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    spans = [(ev.time_range.start, ev.time_range.end) for ev in prof.events()
             if ev.device_type.name == "CUDA" and is_kernel(ev.name)]
    out = {"classes_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])), "kernel_ms": sum(classes.values()),
           "wall_ms": wall_ms, "host": host,
           "top": [{"kernel": k[:100], "ms": ms, "class": classify_kernel(k)} for k, ms in ranked[:25]],
           # every kernel of ≥ 10 µs a step, full names: two runs' profiles can be diffed kernel by kernel
           "kernels": {k: round(ms, 4) for k, ms in ranked if ms >= 0.01}}
    if spans:  # kernel intervals, where this profiler build reports them
        out["device_busy_ms"] = busy_us(spans) / n / 1e3
    return out


def _free(run: _Run | None) -> None:
    """Drop what a path holds (model, optimizer state, its captured graph's memory pool) before the next is built."""
    if run is not None:
        run.step = run.model = run.opt = run.loader = None  # type: ignore[assignment]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _build_run(name: str, config: K3Config, a: Any, loader: Any, d: Any, steps: int) -> _Run:
    if name.startswith("fast"):
        return _fast(name, config, a, loader, d, steps)
    return _reference(config, a, loader, d.device, steps)


def bench_paths(config: K3Config, a: Any, d: Any, peak: float, save: Callable[[list], None]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name in a.paths:
        row: dict[str, Any] = {"path": name}
        run = None
        try:
            loader = RandomTokens(config.vocab_size, a.batch_size, a.seq_len, a.seed)
            run = _build_run(name, config, a, loader, d, a.warmup + a.steps + 2)
            flops = step_flops(run.model, a.batch_size, a.seq_len)
            row.update(_time(run, d.device, a.warmup, a.steps))
            s = row["ms"] / 1e3
            row["tokens_per_s"] = a.batch_size * a.seq_len / s
            row["tflops"] = flops["total"] / s / 1e12
            row["mfu"] = flops["total"] / s / 1e12 / peak
            row["mfu_6n"] = flops["six_n"] / s / 1e12 / peak
            row["mfu_vs_708"] = flops["total"] / s / 1e12 / 708.0
            row["flops"] = flops
            if name == "fast" and d.device.type == "cuda" and not a.no_profile:
                row["profile"] = _profile(run, d.device, a.warmup + a.steps)
            if name.startswith("fast"):
                row["optimizer_ms"] = _optimizer_ms(run, d.device)
            if name == "fast":
                import torch._dynamo.utils as du

                row["graph_breaks"] = int(sum(du.counters["graph_break"].values()))
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
        except Exception as e:  # one broken path must not hide the others' numbers
            import traceback

            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            row["traceback"] = traceback.format_exc()[-4000:]
            print(row["traceback"], file=sys.stderr, flush=True)
        print(json.dumps({k: v for k, v in row.items() if k not in ("profile", "ms_all", "flops")}), flush=True)
        rows.append(row)
        save(rows)  # after every path: a run cut short by a time limit keeps what it measured
        _free(run)
        run = None
    return rows


def loss_curve(config: K3Config, a: Any, d: Any, out: Path) -> dict[str, Any]:
    """``a.loss_curve`` steps of the fast and the reference path on the same text batches from the same seed."""
    curves: dict[str, list[float]] = {}
    for name in ("fast", "reference"):
        loader = _text_loader(config, a.batch_size, a.seq_len, a.seed)
        run = _build_run(name, config, a, loader, d, a.loss_curve)
        curves[name] = [run.step(i) for i in range(a.loss_curve)]
        _free(run)
    f, r = curves["fast"], curves["reference"]
    diff = [abs(x - y) for x, y in zip(f, r)]
    res = {"steps": a.loss_curve, "fast": f, "reference": r, "max_abs_diff": max(diff),
           "mean_abs_diff_last50": statistics.mean(diff[-50:]), "final_fast": f[-1], "final_reference": r[-1]}
    atomic_write_text(out / "loss_curve.json", json.dumps(res, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(1, len(r) + 1), r, label="reference (fp32 + autocast, eager)", lw=1.2)
        ax.plot(range(1, len(f) + 1), f, label="fast (FSDP2 bf16 compute, fp32 master, compiled)", lw=1.2, ls="--")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"{a.preset} · batch {a.batch_size} × {a.seq_len} · {a.optimizer} · same seed and data")
        ax.legend()
        fig.tight_layout()
        atomic_write_with(out / "loss_curve.png", lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
        plt.close(fig)
    except ImportError:
        res["plot"] = "matplotlib missing"
    return res


def _markdown(report: dict[str, Any]) -> str:
    lines = [f"# k3 training step — {report['case']}", "",
             f"{report['device']}, torch {report['torch']}, triton {report['triton']}; "
             f"`{report['command']}`", "",
             f"bf16 matmul peak measured in this run: {report['peak_tflops']:.0f} TFLOP/s. FLOPs per step: "
             f"{report['flops_total'] / 1e12:.1f} TFLOP (see `k3/bench/train.py` for the count).", "",
             "| path | ms/step | tokens/s | MFU | MFU (6N+MLA) | peak GiB | reserved GiB | optimizer ms | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["paths"]:
        if "error" in r:
            lines.append(f"| {r['path']} | | | | | | | | {r['error']} |")
            continue
        lines.append(f"| {r['path']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f} % | "
                     f"{100 * r['mfu_6n']:.1f} % | {r.get('peak_gib', float('nan')):.1f} | "
                     f"{r.get('reserved_gib', float('nan')):.1f} | {r.get('optimizer_ms', float('nan')):.1f} | "
                     f"first steps incl. compile {r['warmup_s']:.0f} s |")
    prof = next((r["profile"] for r in report["paths"] if "profile" in r), None)
    if prof:
        lines += ["", f"CUDA kernel time of the fast path per step: {prof['kernel_ms']:.1f} ms"]
        if "device_busy_ms" in prof:
            lines.append(f"Device busy (union of its kernels) {prof['device_busy_ms']:.1f} ms of a profiled step's "
                         f"{prof['wall_ms']:.1f} ms")
        if "host" in prof:
            h = prof["host"]
            lines.append(f"Host side per step (profiled): {h['launches']:.0f} kernel launches, {h['sync_calls']:.0f} "
                         f"runtime calls that wait for the device, {h['sync_ms']:.1f} ms inside them; "
                         f"{h.get('alloc_calls', 0):.0f} allocator calls (cudaMalloc/cudaFree), "
                         f"{h.get('alloc_ms', 0):.1f} ms")
        lines += ["", "| class | ms | share |", "|---|---:|---:|"]
        for cls, ms in prof["classes_ms"].items():
            lines.append(f"| {cls} | {ms:.2f} | {100 * ms / prof['kernel_ms']:.1f} % |")
        lines += ["", "| kernel | class | ms |", "|---|---|---:|"]
        for t in prof["top"][:15]:
            lines.append(f"| `{t['kernel']}` | {t['class']} | {t['ms']:.2f} |")
    if "loss_curve" in report:
        lc = report["loss_curve"]
        lines += ["", f"Loss curve ({lc['steps']} steps, same seed and data): max |Δ| {lc['max_abs_diff']:.4f}, "
                  f"mean |Δ| over the last 50 steps {lc['mean_abs_diff_last50']:.4f}; final loss fast "
                  f"{lc['final_fast']:.4f}, reference {lc['final_reference']:.4f} (`loss_curve.png`)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="python -m k3.bench train", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--slice", choices=["k3"], default=None, help="the K3-width slice instead of --preset")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per path")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, autotune)")
    ap.add_argument("--paths", default="fast,reference", help=f"comma list of {','.join(PATHS)}")
    ap.add_argument("--optimizer", choices=["muon", "adamw"], default="adamw",
                    help="of every path but fast-muon (default adamw, as the baseline measurement)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-lr", type=int, default=10, help="lr warmup steps of the schedule")
    ap.add_argument("--ac", choices=AC_POLICIES, default="none", help="activation checkpointing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss-curve", type=int, default=0, metavar="N", help="N steps of fast vs reference on text")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default="bench/results/train")
    a = ap.parse_args(argv)
    a.paths = [p for p in a.paths.split(",") if p]
    bad = [p for p in a.paths if p not in PATHS]
    if bad:
        ap.error(f"--paths: unknown {bad}; choose from {','.join(PATHS)}")
    device = resolve_device(a.device)
    config = slice_config() if a.slice else K3Config.from_preset(a.preset)
    case = ("K3-width slice" if a.slice else f"preset {a.preset}") + f", batch {a.batch_size} × {a.seq_len}"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    d = init_distributed(device, ParallelDims())  # the world-size-1 group of the fast path (none on a CPU)
    try:
        peak = bench_peak(device)
        report: dict[str, Any] = {
            "case": case, "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "command": "python -m k3.bench train " + " ".join(argv if argv is not None else sys.argv[1:]),
            "config": config.to_dict(), "optimizer": a.optimizer, "activation_checkpointing": a.ac,
            "peak_tflops": peak}
        with torch.device("meta"):
            meta = K3ForCausalLM(config)
        report["params"] = meta.num_parameters()
        report["active_params"] = meta.num_parameters(active=True)
        report["flops_total"] = step_flops(meta, a.batch_size, a.seq_len)["total"]
        del meta
        print(f"{case}: {report['params'] / 1e9:.2f} B params, {report['active_params'] / 1e9:.2f} B active, "
              f"peak {peak:.0f} TFLOP/s", flush=True)
        stem = "train_slice" if a.slice else ("train_curve" if a.loss_curve and not a.steps else "train")

        def save(rows: list) -> None:
            report["paths"] = rows
            atomic_write_text(out / f"{stem}.json", json.dumps(report, indent=1, default=str) + "\n")
            atomic_write_text(out / f"{stem}.md", _markdown(report))

        save(bench_paths(config, a, d, peak, save) if a.steps else [])
        if a.loss_curve:
            report["loss_curve"] = loss_curve(config, a, d, out)
            lc = report["loss_curve"]
            print(f"loss curve: max |Δ| {lc['max_abs_diff']:.4f}, final {lc['final_fast']:.4f} vs "
                  f"{lc['final_reference']:.4f}", flush=True)
            save(report["paths"])
    finally:
        destroy_distributed(d)
    print((out / f"{stem}.md").read_text(), flush=True)
    return 0
