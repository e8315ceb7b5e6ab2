#!/usr/bin/env python3
"""Nsight Compute stall samples per Triton source line: joins ncu's per-SASS-instruction source page (CSV) with the
line table of the same kernel's cubin from the Triton cache (``nvdisasm -g``).

    ncu --clock-control none --set full --kernel-name regex:_prep_solve --launch-count 1 --export rep \\
        python bench/ncu_kda.py --case prefill
    ncu -i rep.ncu-rep --page source --csv --print-source sass --kernel-name _prep_solve > solve.csv
    python bench/ncu_lines.py solve.csv _prep_solve [--top 25]

Run it where the profiled process ran (its Triton cache holds the cubin). Several cached builds of one kernel (other
constexpr variants) are told apart by matching their instruction sequence to the CSV's; the best match is used and
its agreement printed. Session 9 found with it that the rows prep waits on its loads (the first uses of E, q, k)
and the solve on its kg pass (``bench/results/NOTES_kda.md`` v11).
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import os
import re
import subprocess
import sys

_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")


def opcode(text: str) -> str:
    """The opcode of a SASS instruction, predicate guard (``@P0``, ``@!PT``) dropped."""
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def line_table(cubin: str, nvdisasm: str) -> list[tuple[tuple[str, int] | None, str]]:
    """(source file, line) and opcode of every instruction of the cubin, in address order."""
    out = subprocess.run([nvdisasm, "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    cur: tuple[str, int] | None = None
    seq = []
    for raw in out.splitlines():
        m = _LINE.search(raw)
        if m:
            cur = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = _INSN.match(raw)
        if m:
            seq.append((cur, opcode(m.group(2))))
    return seq


def read_csv(path: str) -> tuple[list[str], list[int], list[dict[str, int]], list[tuple[float, float]]]:
    """Opcodes, stall samples, per-reason stall samples and shared-memory wavefronts (all, excessive = bank
    conflicts) of every instruction in an ncu source-page CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[start], rows[start + 1:]
    i_src, i_w = hdr.index("Source"), hdr.index("Warp Stall Sampling (All Samples)")
    reasons = [(i, h[6:]) for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    ops = [opcode(r[i_src]) for r in data]
    samples = [int(r[i_w] or 0) for r in data]
    per = [{name: int(r[i] or 0) for i, name in reasons} for r in data]

    def num(r: list[str], name: str) -> float:
        return float((r[hdr.index(name)] or "0").replace(",", "")) if name in hdr else 0.0

    wave = [(num(r, "L1 Wavefronts Shared"), num(r, "L1 Wavefronts Shared Excessive")) for r in data]
    return ops, samples, per, wave


def best_cubin(name: str, ops: list[str], cache: str, nvdisasm: str):
    """The cached build of kernel ``name`` whose instruction sequence agrees most with the CSV's."""
    best = None
    for cubin in glob.glob(os.path.join(cache, "*", f"{name}.cubin")):
        seq = line_table(cubin, nvdisasm)
        agree = sum(a == b for (_, a), b in zip(seq, ops)) / max(len(ops), 1)
        score = (len(seq) == len(ops), agree)
        if best is None or score > best[0]:
            best = (score, cubin, seq)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("kernel")
    ap.add_argument("--cache", default=os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache")))
    ap.add_argument("--cubin", default=None, help="use this cubin instead of searching the cache")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    ops, samples, per, wave = read_csv(a.csv)
    if a.cubin:
        seq = line_table(a.cubin, nvdisasm)
        cubin, agree = a.cubin, sum(x == y for (_, x), y in zip(seq, ops)) / max(len(ops), 1)
    else:
        found = best_cubin(a.kernel, ops, a.cache, nvdisasm)
        if found is None:
            print(f"no cached cubin named {a.kernel}.cubin under {a.cache}", file=sys.stderr)
            return 2
        (_, agree), cubin, seq = found
    print(f"{cubin}: {len(seq)} instructions, CSV {len(ops)}, opcodes agreeing {100 * agree:.1f} %")
    total = sum(samples) or 1
    by_line: collections.Counter = collections.Counter()
    reasons: dict = collections.defaultdict(collections.Counter)
    kinds: dict = collections.defaultdict(collections.Counter)
    for (src, op), w, r in zip(seq, samples, per):
        by_line[src] += w
        reasons[src].update(r)
        kinds[src][op] += 1
    print("| share | line | top stall reasons | opcodes |\n|---:|---|---|---|")
    for src, w in by_line.most_common(a.top):
        top = ", ".join(f"{n} {100 * v / max(w, 1):.0f}%" for n, v in reasons[src].most_common(2) if v)
        ops_ = ", ".join(f"{o}×{c}" for o, c in kinds[src].most_common(3))
        where = f"{src[0]}:{src[1]}" if src else "?"
        print(f"| {100 * w / total:.1f}% | {where} | {top} | {ops_} |")
    waves: collections.Counter = collections.Counter()
    excess: collections.Counter = collections.Counter()
    smem_ops: dict = collections.defaultdict(collections.Counter)
    for (src, op), (wv, ex) in zip(seq, wave):
        if wv:
            waves[src] += wv
            excess[src] += ex
            smem_ops[src][op] += 1
    if waves:  # shared memory's bandwidth: one wavefront per cycle and SM
        all_w = sum(waves.values())
        print(f"\nshared-memory wavefronts: {all_w:.3g} ({sum(excess.values()) / all_w:.0%} excessive)")
        print("| share | line | excessive | shared-memory opcodes |\n|---:|---|---:|---|")
        for src, wv in waves.most_common(a.top):
            where = f"{src[0]}:{src[1]}" if src else "?"
            ops_ = ", ".join(f"{o}×{c}" for o, c in smem_ops[src].most_common(3))
            print(f"| {100 * wv / all_w:.1f}% | {where} | {excess[src] / wv:.0%} | {ops_} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
