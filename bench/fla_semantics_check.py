"""k3's ``chunk_kda`` / ``fused_recurrent_kda`` against fla 0.6.0's own PyTorch references, on the CPU.

The drop-in claim, checked from fla's side: fla's ``naive_recurrent_kda`` (fp64) fed by fla's gate references
(``naive_kda_gate``, ``naive_kda_lowerbound_gate``), its l2 norm (x / sqrt(Σx² + 1e-6)) and β sigmoid is the
reference; k3 runs in fp32 with the same arguments. Every combination of: gate in kernel (off; softplus form;
lower bound −5 and −2.5; lower bound without A_log), in-kernel l2 norm and β sigmoid (on / off), initial state
(on / off), varlen ``cu_seqlens`` (on / off), scale (default / 0.7), grouped value heads (HV = H / 2H). Outputs and
final states, and for ``chunk_kda`` the gradients of q, k, v, g, β, h0, A_log and dt_bias, by relative RMS error.

fla's Triton kernels do not run in the interpreter (its autotuner and a ``range`` over tensors), so its references
are the comparison. Needs fla-core 0.6.0 and einops importable, e.g.
    pip install --no-deps --target /tmp/fla .whl/fla_core-0.6.0-py3-none-any.whl
    PYTHONPATH=/tmp/fla python bench/fla_semantics_check.py                     # k3's torch path
    TRITON_INTERPRET=1 K3_KDA_BACKEND=triton PYTHONPATH=/tmp/fla python bench/fla_semantics_check.py --no-grad
Exits 1 if any error exceeds --tol.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_recurrent_kda

from k3.ops.kda import chunk_kda, fused_recurrent_kda

# (use_gate_in_kernel, lower_bound, with A_log)
GATES = ((False, None, True), (True, None, True), (True, -5.0, True), (True, -2.5, True), (True, -5.0, False))


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def fla_reference(x: dict, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's references in fp64 on the raw inputs (differentiable, so gradients come from autograd)."""
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    A_log = x["A_log"].double() if x["A_log"] is not None else None
    dt = x["dt_bias"].double() if x["dt_bias"] is not None else None
    h0 = x["h0"].double() if x["h0"] is not None else None
    if c["l2"]:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if c["gate"]:
        g = (naive_kda_lowerbound_gate(g, A_log, dt, c["lb"], torch.float64) if c["lb"] is not None
             else naive_kda_gate(g, A_log, dt, torch.float64))
    if c["bsig"]:
        beta = beta.sigmoid()
    scale = c["scale"] if c["scale"] is not None else q.shape[-1] ** -0.5
    cu = c["cu"] or [0, q.shape[1]]
    outs, states = [], []
    for i in range(len(cu) - 1):  # varlen: one naive run per sequence, each from its own initial state
        s, e = cu[i], cu[i + 1]
        rows = slice(None) if c["cu"] is None else slice(i, i + 1)
        o, S = naive_recurrent_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale=scale,
                                   initial_state=None if h0 is None else h0[rows], output_final_state=True)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 1), torch.cat(states, 0)


def make_inputs(c: dict, gen: torch.Generator, T: int = 40, H: int = 2, K: int = 16, V: int = 8) -> dict:
    HV = H * c["group"]
    B = 1 if c["cu"] else 2
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, g = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, HV, V), mk(B, T, HV, K)
    if not c["l2"]:
        k = F.normalize(k, dim=-1)
    if not c["gate"]:
        g = -F.softplus(g)
    beta = mk(B, T, HV) if c["bsig"] else torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    N = len(c["cu"]) - 1 if c["cu"] else B
    A_log = mk(HV) * 0.5 if c["gate"] and c["withA"] else None
    dt_bias = mk(HV * K) * 0.5 if c["gate"] else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=mk(N, HV, K, V) if c["init"] else None, A_log=A_log, dt_bias=dt_bias)


def k3_kwargs(x: dict, c: dict) -> dict:
    return dict(scale=c["scale"], initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=c["l2"],
                use_gate_in_kernel=c["gate"], use_beta_sigmoid_in_kernel=c["bsig"], safe_gate=c["lb"] is not None,
                lower_bound=c["lb"], cu_seqlens=torch.tensor(c["cu"]) if c["cu"] else None, A_log=x["A_log"],
                dt_bias=x["dt_bias"])


def check(c: dict, gen: torch.Generator, grad: bool) -> dict[str, float]:
    x64 = make_inputs(c, gen)
    names = [n for n, t in x64.items() if t is not None]
    leaves64 = {n: x64[n].clone().requires_grad_(grad) for n in names}
    leaves32 = {n: x64[n].float().requires_grad_(grad) for n in names}
    x64 = {**x64, **leaves64}
    x32 = {**{n: None for n in x64}, **leaves32}
    o_r, s_r = fla_reference(x64, c)
    pos = (x32["q"], x32["k"], x32["v"], x32["g"], x32["beta"])
    o, s = chunk_kda(*pos, **k3_kwargs(x32, c))
    errs = {"o": rel_rms(o, o_r), "state": rel_rms(s, s_r)}
    with torch.no_grad():
        o2, s2 = fused_recurrent_kda(*pos, **k3_kwargs(x32, c))
    errs.update(rec_o=rel_rms(o2, o_r), rec_state=rel_rms(s2, s_r))
    if grad:
        do, ds = torch.randn(o_r.shape, generator=gen, dtype=torch.float64), torch.randn(s_r.shape, generator=gen,
                                                                                         dtype=torch.float64)
        ((o_r * do).sum() + (s_r * ds).sum()).backward()
        ((o * do.float()).sum() + (s * ds.float()).sum()).backward()
        errs.update({f"d{n}": rel_rms(leaves32[n].grad, leaves64[n].grad) for n in names})
    return errs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-grad", action="store_true", help="outputs and states only (faster in the interpreter)")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {}
    bad = 0
    for (gate, lb, withA), l2, bsig, init, cu, scale, group in itertools.product(
            GATES, (True, False), (True, False), (True, False), (None, [0, 5, 33, 40]), (None, 0.7), (1, 2)):
        c = dict(gate=gate, lb=lb, withA=withA, l2=l2, bsig=bsig, init=init, cu=cu, scale=scale, group=group)
        errs = check(c, gen, not a.no_grad)
        for n, e in errs.items():
            worst[n] = max(worst.get(n, 0.0), e)
        if max(errs.values()) > a.tol:
            bad += 1
            print("over tol:", c, {n: f"{e:.1e}" for n, e in errs.items() if e > a.tol}, flush=True)
    print(f"{bad} of {len(GATES) * 64} combinations over {a.tol:g}; worst per quantity:")
    print(" ".join(f"{n} {e:.1e}" for n, e in worst.items()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
