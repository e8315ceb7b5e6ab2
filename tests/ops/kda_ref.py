"""Shared pieces of the KDA kernel tests: random inputs, the fp64 token recurrence with the in-kernel activations
written out independently of k3's helpers, and errors (relative RMS) of a call's outputs and gradients against it."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import naive_recurrent_kda

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
cpu_only = pytest.mark.skipif(CUDA, reason="interpreter-sized cases (CPU)")
K3 = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
          lower_bound=-5.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ‖a − b‖ / ‖b‖ in fp64 (NaN when a has a NaN: every check then fails)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def make_inputs(B: int, T: int, H: int, K: int, V: int, N: int | None = None, seed: int = 0, h0: bool = True,
                g_const: float | None = None, beta_logit: float | None = None, repeat_keys: bool = False,
                log_decay: bool = False) -> dict[str, torch.Tensor]:
    """fp64 inputs: raw gate pre-activations ``g`` (``log_decay``: a log-decay ≤ 0 instead), β logits, A_log ``A``,
    dt_bias ``dt``, initial states ``s0`` (N of them, N = B unless given)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=r(B, T, H, K), beta=r(B, T, H), A=r(H) * 0.5,
             dt=r(H * K) * 0.5)
    if log_decay:
        x["g"] = -x["g"].abs()
    if repeat_keys:
        x["k"] = x["k"][:, :1].expand_as(x["k"]).clone()
    if g_const is not None:
        x["g"] = torch.full_like(x["g"], g_const)
    if beta_logit is not None:
        x["beta"] = torch.full_like(x["beta"], beta_logit)
    if h0:
        x["s0"] = r(N if N is not None else B, H, K, V)
    return x


def activations(x: dict, gate: bool, lb: float | None, l2: bool = True, bsig: bool = True, beta_scale: float = 1.0):
    """(q, k, g, β) after the in-kernel activations, in fp64 (β = beta_scale·σ(logit): 2 is fla's
    ``allow_neg_eigval``)."""
    q, k, g, beta = x["q"], x["k"], x["g"], x["beta"]
    H, K = q.shape[-2], q.shape[-1]
    if l2:
        q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    if gate:
        f = g + x["dt"].view(H, K)
        g = lb * torch.sigmoid(f * x["A"].exp()[:, None]) if lb is not None else \
            -x["A"].exp()[:, None] * F.softplus(f)
    return q, k, g, (beta.sigmoid() * beta_scale if bsig else beta)


def reference(x: dict, gate: bool = True, lb: float | None = -5.0, cu: list[int] | None = None, l2: bool = True,
              bsig: bool = True, scale: float | None = None, beta_scale: float = 1.0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 token recurrence per sequence → (o, final states)."""
    q, k, g, beta = activations(x, gate, lb, l2, bsig, beta_scale)
    v, s0 = x["v"], x.get("s0")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu is None:
        return naive_recurrent_kda(q, k, v, g, beta, scale, s0, True)
    outs, states = [], []
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        o, s = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale,
                                   None if s0 is None else s0[i:i + 1], True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


def on_device(x: dict, dtype: torch.dtype, grad: bool) -> dict[str, torch.Tensor]:
    """x on DEV in ``dtype`` (A_log, dt_bias and states fp32)."""
    return {n: t.to(DEV, torch.float32 if n in ("A", "dt", "s0") else dtype).requires_grad_(grad)
            for n, t in x.items()}


def errors(run: Callable[[dict], tuple[torch.Tensor, torch.Tensor]], x: dict, dtype: torch.dtype = torch.float32,
           grad: bool = True, **ref_kw: Any) -> dict[str, float]:
    """Relative RMS errors of ``run(inputs on DEV)`` → (o, final states) and, with ``grad``, of every gradient of
    Σ o·do + Σ ht·dht (random do, dht) against :func:`reference` (``ref_kw``)."""
    xd = on_device(x, dtype, grad)
    if grad:
        o, ht = run(xd)
    else:
        with torch.no_grad():
            o, ht = run(xd)
    # the reference sees the inputs the kernel sees (rounded to ``dtype``, as on_device stores them), so the errors
    # are the kernel's own: for the per-head dA_log, a sum over T·K terms that cancel strongly, bf16 rounding of the
    # inputs alone moves the exact gradient by up to 2 % (fla's tests likewise feed their reference the same tensors)
    xr = {n: (t if n in ("A", "dt", "s0") else t.to(dtype).to(t.dtype)).clone().requires_grad_(grad)
          for n, t in x.items()}
    ro, rh = reference(xr, **ref_kw)
    errs = {"o": rel(o, ro), "ht": rel(ht, rh)}
    if grad:
        gen = torch.Generator().manual_seed(1)
        do = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
        dht = torch.randn(rh.shape, generator=gen, dtype=torch.float64)
        ((o.double() * do.to(o.device)).sum() + (ht.double() * dht.to(o.device)).sum()).backward()
        ((ro * do).sum() + (rh * dht).sum()).backward()
        for n, t in xr.items():
            if t.grad is not None:
                assert xd[n].grad is not None, f"no gradient for {n}"
                errs["d" + n] = rel(xd[n].grad, t.grad)
    return errs


def assert_close(errs: dict[str, float], tol: float, **tols: float) -> None:
    bad = {n: e for n, e in errs.items() if not e <= tols.get(n, tol)}  # NaN fails too
    assert not bad, f"relative RMS error above {tol}: {bad} (all: {errs})"


def public_call(cu: list[int] | None = None, gate: bool = True, lb: float | None = -5.0, l2: bool = True,
                bsig: bool = True, **kw: Any) -> Callable[[dict], tuple[torch.Tensor, torch.Tensor]]:
    """``k3.ops.kda.chunk_kda`` on a dict of device inputs."""
    from k3.ops.kda import chunk_kda

    def run(d: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d.get("s0"),
                         output_final_state=True, use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate,
                         use_beta_sigmoid_in_kernel=bsig, safe_gate=lb is not None, lower_bound=lb,
                         cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV),
                         A_log=d["A"] if gate else None, dt_bias=d["dt"] if gate else None, **kw)
    return run


def kda_args(x: dict, cu: list[int] | None = None, gate: bool = True, lb: float | None = -5.0, l2: bool = True,
             bsig: bool = True, output_final_state: bool = True):
    """The :class:`k3.ops.kda.args.KDAArgs` of such a call (for the backend functions)."""
    from k3.ops.kda.args import KDAArgs

    K = x["q"].shape[-1]
    cus = None if cu is None else torch.tensor(cu, device=DEV)
    N = x["q"].shape[0] if cu is None else len(cu) - 1
    return KDAArgs(K ** -0.5, output_final_state, l2, gate, bsig, lb, cus, N)


def backend_call(fn: Callable, cu: list[int] | None = None, gate: bool = True, lb: float | None = -5.0,
                 l2: bool = True, bsig: bool = True, **kw: Any) -> Callable[[dict], tuple[torch.Tensor, torch.Tensor]]:
    """A backend function ``fn(q, k, v, g, beta, initial_state, A_log, dt_bias, args, **kw)`` on device inputs."""
    def run(d: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return fn(d["q"], d["k"], d["v"], d["g"], d["beta"], d.get("s0"), d["A"] if gate else None,
                  d["dt"] if gate else None, kda_args(d, cu, gate, lb, l2, bsig), **kw)
    return run
