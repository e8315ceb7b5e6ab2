#!/usr/bin/env python3
"""One-call GPU sweep of k3's KDA kernel variants: compile, check, time, compare with fla 0.6.0.

    python bench/kda_sweep.py --out $OUT [--budget-s 200] [--jobs 14]
    python bench/kda_sweep.py --dry            # CPU interpreter, tiny shapes: checks the script's own paths

Phases (an internal time budget skips what no longer fits; every row is appended to ``$OUT/kda_sweep.jsonl`` at
once, so a run cut short keeps its numbers):

1. warm: every variant's kernels compiled in parallel subprocesses (``--warm UNIT``) into Triton's disk cache,
   fla's kernels and autotuning too; a unit that fails marks its variant failed (skipped later).
2. check: each variant in bf16 against the fp32 path (ieee dots) on the same (bf16-rounded) inputs: relative RMS
   error of o, final state and every gradient ≤ 2e-2, on random inputs, all gates at the lower bound, β ≈ 1 with
   identical keys, β ≈ 0.
3. time: per-kernel medians (``triton.testing.do_bench``) per variant group — prep kernel (K1) on one inference
   window of the 1M-token H=32 prefill and on the training shape, state pass (K2) likewise, the backward at
   B=8 T=4096 H=32, the decode step B=64 H=32 — then the fastest correct variant of each group is combined.
4. end to end, v2 vs the current defaults vs the sweep's best vs fla 0.6.0 in the same process: forward and forward+backward at
   B=8 T=4096 H=32, prefill B=1 T=1M at H=32 and H=8, decode B=64 H=32.

A short table is printed last; ``kda_sweep.json`` holds everything, ``best`` the chosen overrides.
The prep group has the v3 prep and the rows prep (the default since session 3) with its knobs. A failing variant can
leave the CUDA context unusable for every later variant of the same process: check new kernels with
``bench/profile_kernels.py`` or the gpu_quick tests first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DRY = "--dry" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["K3_KDA_BACKEND"] = "triton"  # CPU tensors would otherwise take the torch reference

import torch  # noqa: E402

from k3.ops.kda.triton import chunk_bwd as cb  # noqa: E402
from k3.ops.kda.triton import chunk_fwd as cf  # noqa: E402
from k3.ops.kda.triton import fused_recurrent as fr  # noqa: E402
from k3.ops.kda.triton._common import make_chunk_table  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402

DEV = "cpu" if DRY else "cuda"
DT = torch.float16 if DRY else torch.bfloat16  # the interpreter cannot load bf16
D = 32 if DRY else 128  # head dim K = V
LB = -5.0
TOL = 2e-2
GIB = 2**30
from k3.ops.kda import prefix as _prefix  # noqa: E402

CLASSES = {"F": cf.FwdConfig, "B": cb.BwdConfig, "D": fr.DecodeConfig, "P": _prefix}  # P: AUTO_SPLIT

# variant groups: name → overrides "Class.attr" → value ("F" FwdConfig, "B" BwdConfig, "D" DecodeConfig). Each
# variant spells out its whole group (v2's settings + its changes), so the labels stay true whatever the defaults.
PREP_V2 = {"F.prep_mode": "v3", "F.fold_output": False, "F.prep_warps": 8, "F.prep_ab_bf16": False,
           "F.prep_inv_scratch": False, "F.prep_split": False, "F.wu_warps": 4}
STATE_V2 = {"F.state_bv": 32, "F.state_warps": 4, "F.state_stages": 2}
BWD_V2 = {"B.state_bv": 32, "B.state_warps": 4, "B.state_stages": 2, "B.wy_bv": 64, "B.wy_warps": 8,
          "B.intra_warps": 8, "B.intra_prec_half": "tf32x3", "B.intra_recompute": False, "B.intra_split": False,
          "B.wy_kb": False, "B.wy_split": False}
DEC_V2 = {"D.bv": 32, "D.warps": 4, "D.stages": 1, "D.fused_out": False, "D.base_ptr": False, "D.evict": False,
          "D.persist": 0, "D.persist_stages": 3, "D.maxnreg": None}
V2 = {**PREP_V2, **STATE_V2, **BWD_V2, **DEC_V2}
_INV, _AB, _SPLIT = {"F.prep_inv_scratch": True}, {"F.prep_ab_bf16": True}, {"F.prep_split": True}
# v3 (run 3) measured every v2-era knob; run 4 keeps the v2 base and the v3 defaults and adds the v4 designs.
P7 = {**_INV, **_AB, **_SPLIT, "F.prep_warps": 4, "F.prep_mode": "v3"}
# v5 (session 3): the rows prep with the block pre-pass is the default; its knobs
_ROWS = {**P7, "F.prep_mode": "rows", "F.rows_pre": True, "F.rows_maxnreg": 128, "F.blocks_warps": 4,
         "F.blocks_per_program": 1, "F.prep_fast_gate": False, "F.rows_pre_e": False, "F.solve_bkw": 32}
PREP = {name: {**PREP_V2, **ch} for name, ch in {
    "p7 v3: split, scratch inverse, bf16 operands, 4w": P7,
    "r2 rows + block pre-pass, rows ≤128 regs (v5)": _ROWS,
    "r3 r2, pre-pass 2 warps": {**_ROWS, "F.blocks_warps": 2},
    "r4 r2, rows ≤96 regs": {**_ROWS, "F.rows_maxnreg": 96},
    "r5 r2, solve BKW 64": {**_ROWS, "F.solve_bkw": 64},
    "r6 r2, rows 2 warps": {**_ROWS, "F.rows_warps": 2, "F.rows_maxnreg": None},
    "r7 r2, pre-pass 2 blocks per program": {**_ROWS, "F.blocks_per_program": 2},
    "r8 r2, pre-pass 4 blocks per program": {**_ROWS, "F.blocks_per_program": 4},
    "r9 rows (v6 defaults: pre-pass 2 warps, solve BKW 64)": {**_ROWS, "F.blocks_warps": 2, "F.solve_bkw": 64,
                                                             "F.prep_fast_gate": False},
    "r10 r9 + fast bounded gate (rsqrt sigmoid)": {**_ROWS, "F.blocks_warps": 2, "F.solve_bkw": 64,
                                                   "F.prep_fast_gate": True},
    "r11 r10 + E from the pre-pass (v6c default)": {**_ROWS, "F.blocks_warps": 2, "F.solve_bkw": 64,
                                                     "F.prep_fast_gate": True, "F.rows_pre_e": True},
}.items()}
STATE = {f"s bv={bv} w={w} st={st}": {"F.state_bv": bv, "F.state_warps": w, "F.state_stages": st}
         for bv, w, st in ((32, 4, 3), (16, 2, 3), (64, 8, 3), (64, 4, 3))}
_SPL = {"B.intra_warps": 4, "B.intra_prec_half": "bf16x3", "B.intra_split": True, "B.intra_split_maxnreg": 0,
        "B.intra_split_bk": 64, "B.intra_split_stack": False}
BWD = {name: {**BWD_V2, **ch} for name, ch in {
    "b0 v2": {},
    "b3 v3: intra 4w bf16x3": {"B.intra_warps": 4, "B.intra_prec_half": "bf16x3"},
    "b12 v3 + state 3 stages": {"B.intra_warps": 4, "B.intra_prec_half": "bf16x3", "B.state_stages": 3},
    "s1 split intra (row blocks | dG pass)": _SPL,
    "s2 split intra, K-slice 128": {**_SPL, "B.intra_split_bk": 128},
    "s3 split intra, 8 warps": {**_SPL, "B.intra_split_warps": 8},
    "s4 split intra, maxnreg 128": {**_SPL, "B.intra_split_maxnreg": 128},
    "s5 split intra, K-slice 32": {**_SPL, "B.intra_split_bk": 32},
    "s6 s1 + state 3 stages": {**_SPL, "B.state_stages": 3},
    "s7 s1 + WY per K-block": {**_SPL, "B.wy_kb": True},
    "s8 s7 + state 3 stages": {**_SPL, "B.wy_kb": True, "B.state_stages": 3},
    "w1 v3 + WY per K-block": {"B.intra_warps": 4, "B.intra_prec_half": "bf16x3", "B.wy_kb": True},
    "s9 s4 (v4 default)": {**_SPL, "B.intra_split_maxnreg": 128, "B.state_stages": 3},
    "s10 s9 + WY as two launches (8 warps)": {**_SPL, "B.intra_split_maxnreg": 128, "B.state_stages": 3,
                                              "B.wy_split": True},
    "s11 s10, BV 32": {**_SPL, "B.intra_split_maxnreg": 128, "B.state_stages": 3, "B.wy_split": True,
                       "B.wy_bv": 32},
    "s12 s9 + stacked intra operands": {**_SPL, "B.intra_split_maxnreg": 128, "B.state_stages": 3,
                                        "B.intra_split_stack": True},
    "s13 s12 + reverse state pass BV 64": {**_SPL, "B.intra_split_maxnreg": 128, "B.state_stages": 3,
                                           "B.intra_split_stack": True, "B.state_bv": 64},
}.items()}
_DF = {"D.base_ptr": True, "D.fused_out": True}
DEC = {name: {**DEC_V2, **ch} for name, ch in {
    "d0 v2": {},
    "d12 persistent 10/SM 1w bv16": {**_DF, "D.persist": 10, "D.bv": 16, "D.warps": 1},
    "d13 persistent 8/SM 2w bv16": {**_DF, "D.persist": 8, "D.bv": 16, "D.warps": 2},
    "d14 d13 + evict": {**_DF, "D.persist": 8, "D.bv": 16, "D.warps": 2, "D.evict": True},
    "d15 d13, 2 stages": {**_DF, "D.persist": 8, "D.bv": 16, "D.warps": 2, "D.persist_stages": 2},
    "d16 d13, 4 stages": {**_DF, "D.persist": 8, "D.bv": 16, "D.warps": 2, "D.persist_stages": 4},
    "d17 persistent 16/SM 1w bv16": {**_DF, "D.persist": 16, "D.bv": 16, "D.warps": 1},
    "d18 persistent 8/SM 2w bv32": {**_DF, "D.persist": 8, "D.bv": 32, "D.warps": 2},
    "d19 persistent 6/SM 2w bv16": {**_DF, "D.persist": 6, "D.bv": 16, "D.warps": 2},
    "d20 persistent 7/SM 2w bv32": {**_DF, "D.persist": 7, "D.bv": 32, "D.warps": 2},
    "d21 persistent 6/SM 2w bv32": {**_DF, "D.persist": 6, "D.bv": 32, "D.warps": 2},
}.items()}
if DRY:  # keep the interpreter run short: one non-base variant per group
    PREP = dict(list(PREP.items())[:2])
    STATE = dict(list(STATE.items())[:2])
    BWD = dict(list(BWD.items())[:2])
    DEC = dict(list(DEC.items())[i] for i in (0, 2))
GROUPS = {"prep": PREP, "state": STATE, "bwd": BWD, "decode": DEC}
K3_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                safe_gate=True, lower_bound=LB)

# ------------------------------------------------------------------------------------------------ helpers


@contextlib.contextmanager
def config(overrides: dict) -> Iterator[None]:
    """Apply "Class.attr" overrides for the duration of the block."""
    per_class: dict[str, dict] = {}
    for key, val in overrides.items():
        cls, attr = key.split(".")
        per_class.setdefault(cls, {})[attr] = val
    with contextlib.ExitStack() as stack:
        for cls, values in per_class.items():
            stack.enter_context(overridden_attrs(CLASSES[cls], **values))
        yield


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def bench(fn: Callable[[], Any], rep_ms: float = 100.0) -> float:
    """Median ms (do_bench on CUDA; one timed call in the interpreter)."""
    if DEV == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=max(5, int(rep_ms // 8)), rep=rep_ms,
                                             return_mode="median"))
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def bench_few(fn: Callable[[], Any], n: int = 3) -> float:
    """Median of n event-timed calls after one warm call (for 100+ ms calls)."""
    fn()
    sync()
    ts = []
    for _ in range(n):
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[len(ts) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def inputs(B: int, T: int, H: int, seed: int = 0, grad: bool = False, case: str = "rand", dtype=DT) -> dict:
    """K3-setting inputs (raw gate, β logits) in ``dtype``; A_log, dt_bias fp32. Generated tensor by tensor so the
    1M-token cases never hold fp32 copies of everything."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=g, dtype=torch.float32)  # noqa: E731
    x = {}
    for n in ("q", "k", "v", "g"):
        t = r(B, T, H, D)
        if n == "g" and case == "bound":  # λ·σ(20 ± 0.3) rounds to λ in fp32: every log-decay at the bound
            t = (8.0 if DRY else 20.0) + 0.1 * t  # (fp16 in the dry run would flush d raw-gate ~ σ(−20) to 0)
        if n == "k" and case == "beta1_repkeys":
            t = t[:, :1].expand_as(t).contiguous()
        x[n] = t.to(dtype)
        del t
    b = r(B, T, H)
    if case == "beta1_repkeys":
        b = torch.full_like(b, 12.0)
    elif case == "beta0":
        b = torch.full_like(b, -8.0 if DRY else -12.0)
    x["beta"] = b.to(dtype)
    x["A_log"] = 0.5 * r(H)
    x["dt_bias"] = 0.5 * r(H * D)
    if case == "bound":  # z = e^{A}(g + dt) = g exactly
        x["A_log"].zero_()
        x["dt_bias"].zero_()
    if grad:
        for t in x.values():
            t.requires_grad_(True)
    return x


def ours(x: dict, **kw) -> tuple:
    from k3.ops.kda import chunk_kda

    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                     output_final_state=True, **{**K3_FLAGS, **kw})


def fla_mod():
    if DRY:
        return None
    try:
        import fla.ops.kda as fk

        return fk
    except Exception:  # noqa: BLE001 — optional
        return None


def fla(x: dict, **kw) -> tuple:
    return fla_mod().chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                               output_final_state=True, **{**K3_FLAGS, **kw})


def fwd_bwd(f: Callable, x: dict, do: torch.Tensor, dht: torch.Tensor, h0: torch.Tensor | None = None) -> tuple:
    """Outputs and gradients (cloned) of ⟨o, do⟩ + ⟨ht, dht⟩ (for the checks)."""
    for t in list(x.values()) + ([h0] if h0 is not None else []):
        t.grad = None
    o, ht = f(x, initial_state=h0) if h0 is not None else f(x)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht])
    grads = {n: t.grad.clone() for n, t in x.items() if t.grad is not None}
    if h0 is not None and h0.grad is not None:
        grads["h0"] = h0.grad.clone()
    return o.detach(), ht.detach(), grads


def train_step(f: Callable, x: dict, do: torch.Tensor, dht: torch.Tensor) -> None:
    """One forward+backward for timing (same loss as the checks, nothing cloned)."""
    o, ht = f(x)
    torch.autograd.backward([o, ht], [do, dht])


def fake_saved(B: int, T: int, H: int) -> tuple:
    """Chunk table and random 'saved' buffers of the training forward (to compile / time the backward alone)."""
    tab = make_chunk_table(B, T, None, torch.device(DEV))
    s = cf.alloc_chunk_buffers(H, tab.NC, D, D, DT, DEV, store_t=True)
    s.pop("LD")
    s["HS"] = torch.empty(H, tab.NC, D, D, dtype=DT, device=DEV)
    for n, t in s.items():
        if n == "GAM":
            t.uniform_(0.5, 1.0)
        else:
            t.normal_().mul_(0.1)
    return tab, s


# ------------------------------------------------------------------------------------------------ shapes

if DRY:
    TRAIN = (2, 130, 2)  # B, T, H
    WIN_H, DEC_B, DEC_H = 2, 3, 2
    PREFILL = [(2, 300)]  # (H, T)
    CHECK_BTH = {"rand": (1, 100, 2), "bound": (1, 70, 1), "beta1_repkeys": (1, 70, 1), "beta0": (1, 70, 1)}
else:
    TRAIN = (8, 4096, 32)
    WIN_H, DEC_B, DEC_H = 32, 64, 32
    PREFILL = [(32, 1 << 20), (8, 1 << 20)]
    CHECK_BTH = {"rand": (2, 1000, 4), "bound": (1, 300, 2), "beta1_repkeys": (1, 300, 2), "beta0": (1, 300, 2)}


def window_chunks() -> int:
    return 3 if DRY else max(1, cf.FwdConfig.window_bytes // cf.chunk_bytes(WIN_H, 128, 128, DT))


# ------------------------------------------------------------------------------------------------ warm units


def warm_units() -> list[str]:
    """Essential units first (references, fla, each group's base), then the variants."""
    units = ["ref32", "fla_train", "fla_fwd", "fla_decode"]
    units += [f"{grp}:{next(iter(vs))}" for grp, vs in GROUPS.items()]
    units += [f"{grp}:{name}" for grp, vs in GROUPS.items() for name in list(vs)[1:]]
    return units


FLAGS = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)


def warm(unit: str) -> None:
    """Compile what one unit needs, on tiny inputs with the benchmark's specializations (ints that vary are
    ``do_not_specialize``; fresh tensors are 16-byte aligned)."""
    grp, _, name = unit.partition(":")
    B, T, H = 2, 200, 2
    if grp in GROUPS:
        with config(GROUPS[grp][name]):
            x = inputs(B, T, H)
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"])
            tab = make_chunk_table(B, T, None, torch.device(DEV))
            if grp == "decode":
                decode_call(inputs(4, 1, 2), torch.randn(4, 2, D, D, device=DEV))()
            elif grp == "prep":
                for st in (True, False):
                    bufs = cf.alloc_chunk_buffers(H, tab.NC, D, D, DT, DEV, store_t=st)
                    cf.launch_prep(*args, bufs, tab, 0, tab.NC, D ** -0.5, LB, FLAGS, st)
            elif grp == "state":
                bufs = cf.alloc_chunk_buffers(H, tab.NC, D, D, DT, DEV, store_t=False)
                hs = torch.zeros(H, tab.NC, D, D, dtype=DT, device=DEV)
                o = torch.empty_like(x["v"])
                ht = torch.zeros(B, H, D, D, device=DEV)
                for t in bufs.values():
                    t.zero_()
                cf.launch_state(bufs, o, hs, ht, tab, 0, tab.NC, H, D, D)
                cf.launch_state(bufs, o, None, ht, tab, 0, tab.NC, H, D, D)
            elif grp == "bwd":
                tab, saved = fake_saved(B, T, H)
                do = torch.randn_like(x["v"])
                for dht in (torch.randn(B, H, D, D, device=DEV), None):
                    cb.kda_bwd(*args, None, D ** -0.5, do, dht, saved, tab, LB, FLAGS)
    elif unit == "ref32":
        for dt in (DT, torch.float32):  # the base config in bf16 (train + inference) and the fp32 reference
            x = inputs(B, T, H, grad=True, dtype=dt)
            h0 = torch.randn(B, H, D, D, device=DEV, requires_grad=True)
            fwd_bwd(ours, x, torch.randn_like(x["v"], dtype=torch.float32), torch.randn(B, H, D, D, device=DEV), h0)
            with torch.no_grad():
                ours(inputs(1, 300, 2, dtype=dt))
            decode_call(inputs(4, 1, 2, dtype=dt), torch.randn(4, 2, D, D, device=DEV))()
    elif unit == "fla_train" and fla_mod() is not None:
        x = inputs(*TRAIN, grad=True)
        train_step(fla, x, torch.randn_like(x["v"]), torch.randn(TRAIN[0], TRAIN[2], D, D, device=DEV))
        with torch.no_grad():
            fla(x)
    elif unit == "fla_fwd" and fla_mod() is not None:
        with torch.no_grad():
            for H, _ in PREFILL:
                fla(inputs(1, 65536, H))
    elif unit == "fla_decode" and fla_mod() is not None:
        fla_decode_call(inputs(DEC_B, 1, DEC_H), torch.randn(DEC_B, DEC_H, D, D, device=DEV))()
    sync()


def warm_all(jobs: int, limit_s: float, deadline_s: float, log: Callable, fla_limit_s: float = 120.0) -> set[str]:
    """Run every warm unit in parallel subprocesses; returns the units that failed or were not started before
    ``deadline_s`` (those variants are skipped rather than compiled inside the timed phase)."""
    units = warm_units()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()

    def one(u: str) -> tuple[str, int, float, str]:
        t = time.monotonic()
        if t - t0 > deadline_s:
            return u, -2, 0.0, "not started: warm deadline"
        try:
            cmd = [sys.executable, os.path.abspath(__file__), "--warm", u] + (["--dry"] if DRY else [])
            p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                               timeout=fla_limit_s if u.startswith(("fla", "ref")) else limit_s)
            return u, p.returncode, time.monotonic() - t, (p.stderr or "")[-400:]
        except subprocess.TimeoutExpired:
            return u, -9, time.monotonic() - t, "timeout"

    failed = set()
    with ThreadPoolExecutor(jobs) as ex:
        for u, rc, dt, err in ex.map(one, units):
            log(dict(phase="warm", unit=u, rc=rc, s=round(dt, 1), **({"err": err} if rc else {})))
            if rc != 0:
                failed.add(u)
    return failed


# ------------------------------------------------------------------------------------------------ checks


def check_refs() -> dict:
    """fp32 path (ieee dots, base config) on the bf16-rounded inputs of each check case, with gradients."""
    refs = {}
    for case, (B, T, H) in CHECK_BTH.items():
        xb = inputs(B, T, H, seed=11, case=case)
        g = torch.Generator(device=DEV).manual_seed(5)
        do = torch.randn(B, T, H, D, device=DEV, generator=g).to(DT).float()  # same values for both paths
        dht = torch.randn(B, H, D, D, device=DEV, generator=g)
        h0 = torch.randn(B, H, D, D, device=DEV, generator=g)
        x32 = {n: t.detach().float().clone().requires_grad_() for n, t in xb.items()}
        h = h0.clone().requires_grad_()
        refs[case] = dict(x=xb, do=do, dht=dht, h0=h0, ref=fwd_bwd(ours, x32, do, dht, h))
    return refs


def check_errors(refs: dict) -> dict:
    """Relative RMS error of every output and gradient per case: current config in bf16 vs the fp32 refs."""
    out = {}
    for case, r in refs.items():
        x = {n: t.detach().clone().requires_grad_() for n, t in r["x"].items()}
        h = r["h0"].clone().requires_grad_()
        o, ht, grads = fwd_bwd(ours, x, r["do"], r["dht"], h)
        ro, rh, rg = r["ref"]
        errs = {"o": rel(o, ro), "ht": rel(ht, rh)}
        for n, t in rg.items():
            errs["d" + n] = rel(grads[n], t) if n in grads else float("nan")
        out[case] = errs
    return out


BASE_ERRS: dict = {}


def check_variant(refs: dict) -> dict:
    """Per case: (worst tensor, its error, ok). ok = every error ≤ 2e-2, or — where the v2 base itself exceeds
    2e-2 (bf16 rounding of the chunk intermediates, not a kernel choice) — no worse than 1.5 × the base + 1e-3."""
    out = {}
    for case, errs in check_errors(refs).items():
        base = BASE_ERRS.get(case, {})
        ok = all(e <= max(TOL, 1.5 * base.get(n, 0.0) + 1e-3) for n, e in errs.items())  # NaN fails
        worst = max(errs, key=lambda n: errs[n] if errs[n] == errs[n] else float("inf"))
        out[case] = (worst, errs[worst], ok)
    return out


def passed(chk: dict) -> bool:
    return all(v[2] for v in chk.values())


def decode_call(x: dict, h0: torch.Tensor) -> Callable[[], Any]:
    from k3.ops.kda import fused_recurrent_kda

    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], **K3_FLAGS)
    return lambda: fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                       output_final_state=True, **kw)


def fla_decode_call(x: dict, h0: torch.Tensor) -> Callable[[], Any]:
    kw = {n: v for n, v in K3_FLAGS.items() if n != "safe_gate"}
    return lambda: fla_mod().fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                                 dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True,
                                                 **kw)


# ------------------------------------------------------------------------------------------------ main


class Run:
    def __init__(self, out: str | None, budget_s: float):
        self.t0 = time.monotonic()
        self.budget = budget_s
        self.rows: list[dict] = []
        self.jsonl = os.path.join(out, "kda_sweep.jsonl") if out else None
        self.out = out
        if self.jsonl:
            open(self.jsonl, "w").close()

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def log(self, row: dict) -> dict:
        row = dict(row, t=round(time.monotonic() - self.t0, 1))
        self.rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(line + "\n")
        return row


def time_group(run: Run, grp: str, failed: set, refs: dict, timer: Callable[[], dict], min_left: float) -> str:
    """Check then time every variant of a group; returns the fastest correct variant's name."""
    best, best_ms = None, float("inf")
    for name, ov in GROUPS[grp].items():
        if run.left() < min_left:
            run.log(dict(phase="time", group=grp, variant=name, error="skipped: time budget"))
            continue
        if f"{grp}:{name}" in failed:
            run.log(dict(phase="time", group=grp, variant=name, error="compile/warm failed"))
            continue
        try:
            with config(ov):
                chk = refs["check"](ov) if grp == "decode" else check_variant(refs)
                ok = passed(chk)
                ms = timer() if ok else {}
        except Exception as e:  # noqa: BLE001 — a broken variant is skipped, the sweep goes on
            run.log(dict(phase="time", group=grp, variant=name, error=repr(e)[:300]))
            continue
        score = ms.get("score", float("inf"))
        run.log(dict(phase="time", group=grp, variant=name, ok=ok,
                     check={c: [v[0], round(v[1], 5), v[2]] for c, v in chk.items()}, **ms))
        if ok and score < best_ms:
            best, best_ms = name, score
    return best


def main_run(a) -> int:
    run = Run(a.out, a.budget_s)
    import triton

    fk = fla_mod()
    header = dict(phase="header", gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
                  torch=torch.__version__, triton=triton.__version__,
                  fla=getattr(__import__("fla"), "__version__", "?") if fk is not None else "not available",
                  command="python bench/kda_sweep.py " + " ".join(sys.argv[1:]))
    run.log(header)
    failed = set()
    if not a.no_warm:
        failed = warm_all(a.jobs, a.warm_limit_s, a.warm_deadline_s, run.log, a.fla_warm_limit_s)
    # ---- checks need fp32 references
    refs = check_refs()
    d_x = inputs(DEC_B, 1, DEC_H, seed=3)
    d_h0 = torch.randn(DEC_B, DEC_H, D, D, device=DEV)
    d_ref = decode_call({n: t.float() for n, t in d_x.items()}, d_h0)()

    def dec_check(ov: dict) -> dict:
        o, h = decode_call(d_x, d_h0)()
        eo, eh = rel(o, d_ref[0]), rel(h, d_ref[1])
        return {"decode": ("o", eo, eo <= TOL), "decode_state": ("ht", eh, eh <= TOL)}

    with config(V2):
        BASE_ERRS.update(check_errors(refs))  # v2 in bf16
    run.log(dict(phase="base_errors", errors={c: {n: round(e, 5) for n, e in d.items()} for c, d in
                                              BASE_ERRS.items()}))

    refs_g = dict(refs, check=dec_check)
    refs_plain = refs

    # ---- per-group timers (shared inputs)
    B, T, H = TRAIN
    ncw = window_chunks()
    xw = inputs(1, ncw * 64, WIN_H, seed=1)
    tabw = make_chunk_table(1, ncw * 64, None, xw["q"].device)
    flags = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)
    argsw = (xw["q"], xw["k"], xw["v"], xw["g"], xw["beta"], xw["A_log"], xw["dt_bias"])
    scale = D ** -0.5
    win_per_1m = (1 << 20) / (ncw * 64)
    xt = inputs(B, T, H, seed=2)
    tabt = make_chunk_table(B, T, None, xt["q"].device)
    argst = (xt["q"], xt["k"], xt["v"], xt["g"], xt["beta"], xt["A_log"], xt["dt_bias"])

    def prep_timer() -> dict:
        bw = cf.alloc_chunk_buffers(WIN_H, ncw, D, D, DT, DEV, store_t=False)
        w = bench(lambda: cf.launch_prep(*argsw, bw, tabw, 0, ncw, scale, LB, flags, False))
        del bw
        bt = cf.alloc_chunk_buffers(H, tabt.NC, D, D, DT, DEV, store_t=True)
        t = bench(lambda: cf.launch_prep(*argst, bt, tabt, 0, tabt.NC, scale, LB, flags, True))
        del bt
        return dict(window_ms=w, ms_1M=w * win_per_1m, train_ms=t, score=w * win_per_1m + t)

    bw_state = cf.alloc_chunk_buffers(WIN_H, ncw, D, D, DT, DEV, store_t=False)
    cf.launch_prep(*argsw, bw_state, tabw, 0, ncw, scale, LB, flags, False)
    ow = torch.empty_like(xw["v"])
    htw = torch.zeros(1, WIN_H, D, D, device=DEV)
    _, _, saved = cf.kda_fwd(*argst[:5], xt["A_log"], xt["dt_bias"], scale, None, tabt, LB, flags, True)
    ot = torch.empty_like(xt["v"])
    htt = torch.zeros(B, H, D, D, device=DEV)
    do_t = torch.randn_like(xt["v"])
    dht_t = torch.randn(B, H, D, D, device=DEV)
    # the training state pass as the forward runs it: reading U and (FwdConfig.store_vn) writing V', into buffers
    # of its own so the backward timed below keeps the forward's V'
    vn_t = torch.empty_like(saved["VN"]) if "VN" in saved else None
    saved_st = dict(saved, U=saved["U"] if "U" in saved else torch.zeros_like(saved["VN"]))

    def state_timer() -> dict:
        w = bench(lambda: cf.launch_state(bw_state, ow, None, htw, tabw, 0, ncw, WIN_H, D, D))
        t = bench(lambda: cf.launch_state(saved_st, ot, saved["HS"], htt, tabt, 0, tabt.NC, H, D, D, vn=vn_t))
        return dict(window_ms=w, ms_1M=w * win_per_1m, train_ms=t, score=w * win_per_1m + t)

    def bwd_timer() -> dict:
        f = lambda: cb.kda_bwd(*argst[:5], xt["A_log"], xt["dt_bias"], None, scale, do_t, dht_t, saved,  # noqa
                               tabt, LB, flags)
        ms = bench(f, 200.0)
        return dict(train_bwd_ms=ms, score=ms)

    dec_ms = {}

    def dec_timer() -> dict:
        ms = bench(decode_call(d_x, d_h0), 100.0)
        return dict(ms=ms, state_TBps=2 * d_h0.numel() * 4 / ms / 1e9, score=ms)

    best = {}
    timers = {"prep": prep_timer, "state": state_timer, "bwd": bwd_timer, "decode": dec_timer}
    reserve = {"prep": 45, "state": 40, "bwd": 35, "decode": 50}  # seconds kept for the end-to-end rows
    for grp in ("decode", "prep", "state", "bwd"):
        best[grp] = time_group(run, grp, failed, refs_g if grp == "decode" else refs_plain, timers[grp],
                               reserve[grp] if not DRY else -1e9)
    del bw_state, saved, ow, ot, xw, xt, argst, argsw, do_t, refs, refs_g, refs_plain
    BASE_ERRS.clear()  # (holds floats only; the check tensors above are what the 1M-token fla run needs freed)
    if DEV == "cuda":
        torch.cuda.empty_cache()
    best_ov = {}
    for grp, name in best.items():
        if name is not None:
            best_ov.update(GROUPS[grp][name])
    run.log(dict(phase="best", variants=best, overrides=best_ov))

    # ---- end to end: base vs best vs fla
    e2e = []

    def row(case: str, impl: str, **kw) -> None:
        e2e.append(run.log(dict(phase="e2e", case=case, impl=impl, **kw)))

    impls = [("k3 v2", V2, ours), ("k3 defaults", {}, ours), ("k3 best", best_ov, ours)]
    if fk is not None and "fla_train" not in failed:
        impls.append(("fla 0.6.0", None, fla))
    x = inputs(B, T, H, seed=4, grad=True)
    do = torch.randn(B, T, H, D, device=DEV, dtype=DT)
    dht = torch.randn(B, H, D, D, device=DEV)
    for impl, ov, f in impls:
        if run.left() < 40 and not DRY:
            row(f"fwd+bwd B={B} T={T} H={H}", impl, error="skipped: time budget")
            continue
        try:
            with config(ov or {}):
                with torch.no_grad():
                    fwd = bench(lambda: f(x), 100.0)
                fb = bench(lambda: train_step(f, x, do, dht), 200.0)
            row(f"fwd B={B} T={T} H={H}", impl, ms=fwd)
            row(f"fwd+bwd B={B} T={T} H={H}", impl, ms=fb)
        except Exception as e:  # noqa: BLE001
            row(f"fwd+bwd B={B} T={T} H={H}", impl, error=repr(e)[:300])
    dimpls = [("k3 v2", V2), ("k3 defaults", {}), ("k3 best", best_ov)]
    for impl, ov in dimpls:
        with config(ov):
            ms = bench(decode_call(d_x, d_h0), 100.0)
        row(f"decode B={DEC_B} H={DEC_H}", impl, ms=ms, state_TBps=2 * d_h0.numel() * 4 / ms / 1e9)
    if fk is not None and "fla_decode" not in failed:
        try:
            ms = bench(fla_decode_call(d_x, d_h0), 100.0)
            row(f"decode B={DEC_B} H={DEC_H}", "fla 0.6.0", ms=ms, state_TBps=2 * d_h0.numel() * 4 / ms / 1e9)
        except Exception as e:  # noqa: BLE001
            row(f"decode B={DEC_B} H={DEC_H}", "fla 0.6.0", error=repr(e)[:300])
    del x, do, dht
    for Hp, Tp in PREFILL:
        case = f"prefill B=1 H={Hp} T={Tp}"
        xp = inputs(1, Tp, Hp, seed=6)
        unsplit = {**best_ov, "P.AUTO_SPLIT": False}
        pimpls = [("k3 best (auto split)", best_ov, ours), ("k3 best, unsplit", unsplit, ours),
                  ("k3 best, unsplit, overlapped windows", {**unsplit, "F.overlap_windows": True}, ours),
                  ("k3 best, auto split, overlapped windows", {**best_ov, "F.overlap_windows": True}, ours),
                  ("k3 best, auto split, overlapped, folded output",
                   {**best_ov, "F.overlap_windows": True, "F.fold_output": True}, ours),
                  ("k3 v2, unsplit", {**V2, "P.AUTO_SPLIT": False}, ours)]
        if fk is not None and "fla_fwd" not in failed:
            pimpls.append(("fla 0.6.0", None, fla))
        for impl, ov, f in pimpls:
            if run.left() < (25 if Hp == 32 else 8) and not DRY:
                row(case, impl, error="skipped: time budget")
                continue
            try:
                with config(ov or {}), torch.no_grad():
                    if DEV == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                        base_mem = torch.cuda.memory_allocated()
                    ms = bench_few(lambda: f(xp), 2 if Hp == 32 and not DRY else 3)
                    extra = (torch.cuda.max_memory_allocated() - base_mem) / GIB if DEV == "cuda" else 0.0
                row(case, impl, ms=ms, extra_gib=extra)
            except Exception as e:  # noqa: BLE001 — fla may run out of memory at 1M
                row(case, impl, error=repr(e)[:200])
            if DEV == "cuda":
                torch.cuda.empty_cache()
        del xp
    # ---- report
    table = report(run, e2e, best, best_ov)
    if a.out:
        from k3.utils import atomic_write_text

        atomic_write_text(os.path.join(a.out, "kda_sweep.json"),
                          json.dumps(dict(header=header, best=best, best_overrides=best_ov, rows=run.rows), indent=1))
        atomic_write_text(os.path.join(a.out, "kda_sweep.md"), table)
    print(table, flush=True)
    return 0


def report(run: Run, e2e: list[dict], best: dict, best_ov: dict) -> str:
    lines = ["", "## per-variant (ok = bf16 vs fp32 ≤ 2e-2 on all check cases)", "",
             "| group | variant | ok | ms (score) | detail |", "|---|---|---|---|---|"]
    for r in run.rows:
        if r.get("phase") == "time":
            d = {k: round(v, 3) for k, v in r.items() if k in ("window_ms", "ms_1M", "train_ms", "train_bwd_ms",
                                                               "state_TBps")}
            score = round(r["score"], 3) if "score" in r else r.get("error", "")
            lines.append(f"| {r['group']} | {r['variant']} | {r.get('ok', '')} | {score} | {d} |")
    lines += ["", f"best: {best}", f"overrides: {best_ov}", "",
              "| case | impl | ms | fla/k3 | extra GiB |", "|---|---|---|---|---|"]
    fla_ms = {r["case"]: r["ms"] for r in e2e if r["impl"].startswith("fla") and "ms" in r}
    for r in e2e:
        ms = r.get("ms")
        ratio = f"{fla_ms[r['case']] / ms:.2f}" if ms and r["case"] in fla_ms and not r["impl"].startswith("fla") \
            else ""
        lines.append(f"| {r['case']} | {r['impl']} | {round(ms, 3) if ms else r.get('error', '')} | {ratio} | "
                     f"{round(r['extra_gib'], 2) if 'extra_gib' in r else ''} |")
    lines.append(f"\n(total {time.monotonic() - run.t0:.0f} s)")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--warm-limit-s", type=float, default=80.0, help="per warm unit")
    ap.add_argument("--warm-deadline-s", type=float, default=70.0, help="start no warm unit after this")
    ap.add_argument("--fla-warm-limit-s", type=float, default=120.0,
                    help="fla's compile + autotune (run 3: > 80 s under 14 parallel compiles)")
    ap.add_argument("--warm", default=None, help="internal: compile one unit and exit")
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--dry", action="store_true", help="CPU interpreter, tiny shapes (checks the script itself)")
    a = ap.parse_args()
    if a.warm is not None:
        warm(a.warm)
        return 0
    if not DRY and not torch.cuda.is_available():
        print("kda_sweep needs a CUDA GPU (or --dry)", file=sys.stderr)
        return 2
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    return main_run(a)


if __name__ == "__main__":
    sys.exit(main())
