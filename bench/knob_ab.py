#!/usr/bin/env python3
"""A/B of config knobs in one process: each variant's outputs against the default's, then its times.

    python bench/knob_ab.py --cases prefill32 prefill8 [--rounds 2] \\
        --variant st2 FwdConfig.state_stages=2 --variant win2g FwdConfig.window_bytes=2147483648

Knobs are ``Class.attr=value`` for FwdConfig, C16Config, BwdConfig (``chunk_fwd`` / ``chunk16`` / ``chunk_bwd``),
SplitConfig (``span``), DecodeConfig (``fused_recurrent``), GluonDecodeConfig (``decode_gluon``), GluonPrepConfig
(``prep_gluon``) and CPConfig
(``k3.ops.kda.cp``); values are Python literals; ``ENV.NAME=value`` sets an environment variable for the variant
(e.g. ``ENV.K3_KDA_SPLITS=8``). Cases (bf16, K = V = 128, the K3 call): ``prefill32`` / ``prefill16`` /
``prefill8`` / ``prefill4`` = B=1 T=1M at H=32 / 16 / 8 / 4 without grad (``prefill8mem``: H=8 with channel 0 of
every head never forgetting, ``k3.bench.kda.never_forgetting``), ``train`` = fwd+bwd B=8 T=4096 H=32,
``train32k`` = fwd+bwd B=1 T=32768 H=32, ``decode`` = one step B=64 H=32 from an fp32 state,
``decode_pool`` = the same step in place on a pool of 2B slots at random distinct slots.
Check: the variant's output of each prefill case at T=128K (every gradient of the train cases, output and state of
the decode) against the default's, relative RMS (bf16: ≤ 2e-2 passes). Times are ``do_bench`` medians (ms); one
table at the end. Training steps reset the inputs' ``.grad`` (~0.7 ms below the bench's B=8 T=4096 row, whose steps
add into it); ``--accumulate`` times them as the bench does; ``--graph`` replays the cases without grad from a CUDA
graph (the decode step's host cost hides its GPU time on a slow host). A variant that faults poisons the process: run doubtful ones in a process of their own.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import sys
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.bench.kda import K3_FLAGS, _cuda_graph, _inputs, _ours, never_forgetting  # noqa: E402
from k3.ops.kda.cp import CPConfig  # noqa: E402
from k3.ops.kda.triton.chunk_bwd import BwdConfig  # noqa: E402
from k3.ops.kda.triton.chunk16 import C16Config  # noqa: E402
from k3.ops.kda.triton.chunk_fwd import FwdConfig  # noqa: E402
from k3.ops.kda.triton.decode_gluon import GluonDecodeConfig  # noqa: E402
from k3.ops.kda.triton.prep_gluon import GluonPrepConfig  # noqa: E402
from k3.ops.kda.triton.fused_recurrent import DecodeConfig  # noqa: E402
from k3.ops.kda.triton.span import SplitConfig  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402

CLASSES = {c.__name__: c for c in (FwdConfig, C16Config, BwdConfig, SplitConfig, DecodeConfig, GluonDecodeConfig,
                                    GluonPrepConfig, CPConfig)}
CASES = {"prefill32": (1, 1 << 20, 32, False), "prefill8": (1, 1 << 20, 8, False),
         "prefill16": (1, 1 << 20, 16, False), "prefill4": (1, 1 << 20, 4, False),
         "prefill8mem": (1, 1 << 20, 8, False),
         "train": (8, 4096, 32, True), "train32k": (1, 32768, 32, True), "decode": (64, 1, 32, False),
         "decode_pool": (64, 1, 32, False)}


def parse(specs: list[str]) -> dict[Any, dict[str, Any]]:
    out: dict[Any, dict[str, Any]] = {}
    for spec in specs:
        lhs, val = spec.split("=", 1)
        cls, attr = lhs.split(".")
        if cls == "ENV":  # an environment variable for the variant's calls: ENV.K3_KDA_SPLITS=8
            out.setdefault("ENV", {})[attr] = val
            continue
        if cls not in CLASSES or not hasattr(CLASSES[cls], attr):
            raise ValueError(f"unknown knob {lhs!r}")
        try:
            value = ast.literal_eval(val)
        except (ValueError, SyntaxError):  # a bare word is a string: BwdConfig.intra_prec_half=tf32
            value = val
        out.setdefault(CLASSES[cls], {})[attr] = value
    return out


def variant_list(specs: list[list[str]]) -> list[tuple[str, dict[Any, dict[str, Any]]]]:
    """``--variant NAME KNOB…`` arguments → [("default", {}), (NAME, knobs), …]."""
    return [("default", {})] + [(v[0], parse(v[1:])) for v in specs]


def add_variant_args(ap: argparse.ArgumentParser, cases: list[str], default: list[str]) -> None:
    """The ``--cases`` and ``--variant`` options every knob script takes."""
    ap.add_argument("--cases", nargs="+", default=default, choices=cases)
    ap.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KNOB"))


def prefill_inputs(case: str) -> dict:
    """The inputs of a prefill case at its full size, with an fp32 initial state."""
    B, T, H, _ = CASES[case]
    x = _inputs(B, T, H)
    x["h0"] = torch.randn(B, H, 128, 128, device="cuda")
    return x


@contextlib.contextmanager
def applied(knobs: dict[Any, dict[str, Any]]) -> Iterator[None]:
    """Every (class → attrs) override at once, restored after the block."""
    with contextlib.ExitStack() as stack:
        for c, kv in knobs.items():
            if c == "ENV":
                stack.enter_context(_env(kv))
            else:
                stack.enter_context(overridden_attrs(c, **kv))
        yield


@contextlib.contextmanager
def _env(kv: dict[str, str]) -> Iterator[None]:
    old = {n: os.environ.get(n) for n in kv}
    os.environ.update(kv)
    try:
        yield
    finally:
        for n, v in old.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run(case: str, x: dict, do: torch.Tensor | None, accumulate: bool = False) -> list[torch.Tensor]:
    """One call of ``case``; training cases return the output and every input gradient. ``accumulate``: keep the
    inputs' ``.grad`` so autograd adds into it (what ``k3.bench kda`` and the fla anchor time: +5 adds per step)."""
    if case == "decode":  # one step from an fp32 state to a new one
        from k3.ops.kda import fused_recurrent_kda

        with torch.no_grad():
            return list(fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                            dt_bias=x["dt_bias"], initial_state=x["h0"], output_final_state=True,
                                            **K3_FLAGS))
    if case == "decode_pool":  # one step in place on a pool of 2B slots at random distinct slots (as the bench)
        from k3.ops.kda import fused_recurrent_kda

        if "pool0" in x:  # the check's inputs: every call from the same pool
            x["pool"].copy_(x["pool0"])
        with torch.no_grad():
            o, pool = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                          dt_bias=x["dt_bias"], initial_state=x["pool"], ssm_state_indices=x["idx"],
                                          **K3_FLAGS)
            return [o, pool[x["idx"]]] if "pool0" in x else [o]  # (timed calls: no gather of the slots)
    if do is None:
        with torch.no_grad():
            return [_ours(x)[0]]
    if not accumulate:
        for n in ("q", "k", "v", "g", "beta"):
            x[n].grad = None
    o, _ = _ours(x)
    o.backward(do)
    return [o.detach()] + [x[n].grad for n in ("q", "k", "v", "g", "beta")]


def main() -> int:
    ap = argparse.ArgumentParser()
    add_variant_args(ap, list(CASES), ["prefill32", "prefill8"])
    ap.add_argument("--rep", type=float, default=300.0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant this many times, interleaved (A B A B …): machine and clock drift "
                         "then shows as the spread within a variant instead of a difference between variants")
    ap.add_argument("--graph", action="store_true",
                    help="time the cases without grad as CUDA-graph replays (GPU time alone: the decode step's host "
                         "cost otherwise dominates on a slow host)")
    ap.add_argument("--accumulate", action="store_true",
                    help="time training steps that add into existing .grad, as the bench and the fla anchor do")
    a = ap.parse_args()
    variants = variant_list(a.variant)
    rows: dict[str, dict[str, str]] = {n: {} for n, _ in variants}
    for case in a.cases:
        B, T, H, grad = CASES[case]
        xc = _inputs(B, min(T, 1 << 17) if not grad else T, H, grad=grad, seed=1)
        x = _inputs(B, T, H, grad=grad)
        xc["h0"] = torch.randn(B, H, 128, 128, device="cuda")
        x["h0"] = torch.randn(B, H, 128, 128, device="cuda")
        if case.endswith("mem"):  # one channel per head that never forgets
            x, xc = never_forgetting(x), never_forgetting(xc)
        if case == "decode_pool":
            for d in (x, xc):
                d["pool"] = torch.randn(2 * B, H, 128, 128, device="cuda")
                d["idx"] = torch.randperm(2 * B, device="cuda")[:B]
            xc["pool0"] = xc["pool"].clone()
        doc = torch.randn_like(xc["v"]) if grad else None
        ref = [t.clone() for t in run(case, xc, doc)]
        do = torch.randn_like(x["v"]) if grad else None
        times: dict[str, list[float]] = {n: [] for n, _ in variants}
        errs: dict[str, float] = {}
        for _ in range(max(1, a.rounds)):
            for name, knobs in variants:
                with applied(knobs):
                    if name not in errs:
                        errs[name] = max(rel(u, r) for u, r in zip(run(case, xc, doc), ref))
                    fn = lambda: run(case, x, do, a.accumulate)  # noqa: E731
                    if a.graph and not grad:
                        fn = _cuda_graph(fn)
                    t = triton.testing.do_bench(fn, warmup=3, rep=a.rep, return_mode="median")
                times[name].append(t)
                print(f"{case} {name}: {t:.3f} ms, check {errs[name]:.1e}", flush=True)
        for name, _ in variants:
            cell = " / ".join(f"{t:.2f}" if t >= 1 else f"{t:.4f}" for t in times[name])
            rows[name][case] = cell + ("" if errs[name] <= 2e-2 else f" (FAIL {errs[name]:.1e})")
        del x, xc, ref
        torch.cuda.empty_cache()
    print("\n| variant | knobs | " + " | ".join(a.cases) + " |\n|---|---|" + "---:|" * len(a.cases))
    for name, knobs in variants:
        kn = ", ".join(f"{getattr(c, '__name__', c)}.{k}={v!r}" for c, kv in knobs.items() for k, v in kv.items()) or "—"
        print(f"| {name} | {kn} | " + " | ".join(rows[name].get(c, "") for c in a.cases) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
