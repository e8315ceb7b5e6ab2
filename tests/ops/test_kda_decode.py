"""KDA decode (``fused_recurrent_kda`` on the Triton backend) against the fp64 token recurrence, for every
``DecodeConfig`` variant; and the host side of one decode call (what it validates, how many torch ops it runs).

CPU: the kernels run in Triton's interpreter (TRITON_INTERPRET=1, fp32/fp16, small K/V). Outputs and states are
allocated inside the calls; ``torch.empty`` is poisoned with NaN so an element a kernel forgets to write shows up.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

import k3.ops.kda.triton.decode_gluon as dg  # noqa: E402
import k3.ops.kda.triton.fused_recurrent as fr  # noqa: E402
from k3.ops.kda import fused_recurrent_kda, naive_recurrent_kda  # noqa: E402
from k3.ops.kda.checks import _checked_dims, _common_call_dims, check_kda_call  # noqa: E402
from k3.ops.kda.gate import kda_gate_fused  # noqa: E402
from k3.ops.kda.triton import fused_recurrent_kda_triton  # noqa: E402
from tests.ops.kernel_spy import KernelSpy  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-sized cases (CPU)")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

H, K, V = 2, 16, 32
LB = -5.0
# DecodeConfig overrides, as the sweep spells them ("D.<knob>"); "v2" = the defaults.
VARIANTS = {
    "v2": {},
    "fused+base_ptr+evict": dict(fused_out=True, base_ptr=True, evict=True),
    "bv16 fused": dict(bv=16, fused_out=True, base_ptr=True),
    "persistent": dict(persist=2, persist_stages=3, fused_out=True, base_ptr=True, evict=True, maxnreg=96),
    "persistent bv16 unfused": dict(persist=1, persist_stages=2, bv=16),
    "persistent, 3 programs": dict(persist=2, persist_stages=3, programs=3),  # a grid that does not divide the tiles
}


@pytest.fixture(params=list(VARIANTS))
def variant(request, monkeypatch):
    """Apply one variant's knobs (monkeypatch restores them) and force the Triton backend on CPU tensors. The Gluon
    kernel is switched off, so that on a GPU these variants run the Triton kernels (``test_kda_decode_gluon.py``
    checks the Gluon one)."""
    monkeypatch.setattr(dg.GluonDecodeConfig, "enabled", False)
    for name, val in VARIANTS[request.param].items():
        assert hasattr(fr.DecodeConfig, name), name
        monkeypatch.setattr(fr.DecodeConfig, name, val)
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    return request.param


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def make(B: int, T: int, N: int | None = None, seed: int = 0, g_raw: float | None = None,
         beta_logit: float | None = None, repeat_keys: bool = False, K: int = K, V: int = V) -> dict:
    """fp64 inputs in the K3 setting: raw gate pre-activations, β logits, A_log [H], dt_bias [H·K], state s0."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=r(B, T, H, K), beta=r(B, T, H),
             A=0.5 * r(H), dt=0.5 * r(H * K), s0=r(N or B, H, K, V))
    if repeat_keys:
        x["k"] = x["k"][:, :1].expand_as(x["k"]).clone()
    if g_raw is not None:  # λ·σ(e^A (60 + dt)) rounds to λ: every log-decay at the bound
        x["g"] = torch.full_like(x["g"], g_raw)
    if beta_logit is not None:
        x["beta"] = torch.full_like(x["beta"], beta_logit)
    return x


def cast(x: dict, dtype: torch.dtype) -> dict:
    """Inputs in ``dtype`` (states and gate parameters fp32), and the same values back in fp64 for the reference."""
    lo = {n: t.to(torch.float32 if n in ("A", "dt", "s0") else dtype) for n, t in x.items()}
    return lo, {n: t.double() for n, t in lo.items()}


def reference(x: dict, cu: list[int] | None = None, h0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64: L2 norm of q/k, bounded gate, β sigmoid, then the token recurrence per sequence."""
    nrm = lambda t: t / (t.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    q, k, v = nrm(x["q"]), nrm(x["k"]), x["v"]
    g, b = kda_gate_fused(x["g"], x["A"], x["dt"], LB), x["beta"].sigmoid()
    s0 = x["s0"] if h0 else torch.zeros_like(x["s0"])
    scale = q.shape[-1] ** -0.5
    if cu is None:
        return naive_recurrent_kda(q, k, v, g, b, scale, s0, True)
    outs, states = [], []
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        o, s = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], b[:, sl], scale, s0[i:i + 1], True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


def ours(x: dict, h0: bool = True, cu: list[int] | None = None, **kw) -> tuple:
    """The public API with the K3 flags (gate, L2 norm and β sigmoid in the kernel)."""
    return fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["s0"] if h0 else None,
                               output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, A_log=x["A"],
                               dt_bias=x["dt"], cu_seqlens=torch.tensor(cu) if cu is not None else None, **kw)


def assert_close(o, s, ro, rs, tol_o: float, tol_s: float = 1e-5) -> None:
    eo, es = rel(o, ro), rel(s, rs)
    assert eo <= tol_o and es <= tol_s, f"o {eo:.2e} (tol {tol_o}), state {es:.2e} (tol {tol_s})"  # NaN fails


# ------------------------------------------------------------------------------------------------ kernels


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h0", [True, False])
def test_decode_step(variant, nan_empty, dtype, h0):
    """One token (B = 3), with and without an initial state: output and final state."""
    lo, hi = cast(make(3, 1, seed=1), dtype)
    o, s = ours(lo, h0=h0)
    assert o.dtype == dtype and s.dtype == torch.float32
    ro, rs = reference(hi, h0=h0)
    assert_close(o, s, ro, rs, 1e-5 if dtype == torch.float32 else 2e-3)


@cpu_only
def test_decode_odd_head_dims(variant, nan_empty):
    """K = 12, V = 20: padded tiles (masked rows and columns; two V-blocks with BV 16)."""
    lo, hi = cast(make(2, 1, seed=6, K=12, V=20), torch.float32)
    assert_close(*ours(lo), *reference(hi), 1e-5)


@cpu_only
def test_decode_few_tokens_dense_and_varlen(variant, nan_empty):
    """T = 5 dense, and a varlen batch with an empty sequence (tiled kernel: the persistent one is T = 1 only)."""
    lo, hi = cast(make(2, 5, seed=2), torch.float32)
    assert_close(*ours(lo), *reference(hi), 1e-5)
    cu = [0, 2, 2, 7]
    lo, hi = cast(make(1, 7, N=3, seed=3), torch.float32)
    assert_close(*ours(lo, cu=cu), *reference(hi, cu=cu), 1e-5)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_extremes(variant, nan_empty, dtype):
    """Every log-decay at the bound with β ≈ 1 and identical keys; β ≈ 0 (3 tokens, so the state feeds back)."""
    for beta_logit, rep in ((12.0, True), (-12.0, False)):
        lo, hi = cast(make(3, 3, seed=4, g_raw=60.0, beta_logit=beta_logit, repeat_keys=rep), dtype)
        assert bool((kda_gate_fused(hi["g"], hi["A"], hi["dt"], LB) == LB).all())
        assert_close(*ours(lo), *reference(hi), 1e-5 if dtype == torch.float32 else 2e-3)


@cpu_only
def test_decode_pool_in_place(variant, nan_empty):
    """State pool: slots read and written in place (int64 and int32 indices), a negative slot starts from zero
    and writes nothing, every other slot stays bitwise unchanged."""
    lo, hi = cast(make(3, 1, seed=5), torch.float32)
    ro, rs = reference(hi)
    ro0, _ = reference(hi, h0=False)
    for idx_dtype in (torch.int64, torch.int32):
        pool = torch.randn(6, H, K, V)
        pool[4], pool[1] = lo["s0"][0], lo["s0"][2]
        before = pool.clone()
        args = (lo["q"], lo["k"], lo["v"], lo["g"], lo["beta"], K ** -0.5, pool, False, True, True, True, LB, None,
                lo["A"], lo["dt"])
        o, p = fused_recurrent_kda_triton(*args, ssm_state_indices=torch.tensor([4, -1, 1], dtype=idx_dtype))
        assert p is pool
        assert rel(pool[4], rs[0]) <= 1e-5 and rel(pool[1], rs[2]) <= 1e-5
        assert torch.equal(pool[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
        assert rel(o[[0, 2]], ro[[0, 2]]) <= 1e-5 and rel(o[1], ro0[1]) <= 1e-5
    # the public spelling (fla/vLLM style) returns the pool itself as the final state
    pool = torch.zeros(5, H, K, V)
    idx = torch.tensor([3, 0, 2])
    pool[idx] = lo["s0"]
    o, p = ours(dict(lo, s0=pool), ssm_state_indices=idx)
    assert p is pool
    assert_close(o, pool[idx], ro, rs, 1e-5)
    assert torch.count_nonzero(pool[[1, 4]]) == 0
    # a strided pool (every other slot of a larger buffer) is updated in place through a dense copy
    big = torch.randn(10, H, K, V)
    pool = big[::2]
    pool[idx] = lo["s0"]
    before = big.clone()
    o, p = ours(dict(lo, s0=pool), ssm_state_indices=idx)
    assert p is pool and not pool.is_contiguous()
    assert_close(o, pool[idx], ro, rs, 1e-5)
    assert torch.equal(big[1::2], before[1::2]) and torch.equal(pool[[1, 4]], before[::2][[1, 4]])


# ------------------------------------------------------------------------------------------------ host side


def _args(**over) -> dict:
    """A valid K3 decode call (B = 3, T = 1) as check_kda_call's arguments, with overrides."""
    x = make(3, 1)
    a = dict(q=x["q"].float(), k=x["k"].float(), v=x["v"].float(), g=x["g"].float(), beta=x["beta"].float(),
             scale=None, initial_state=x["s0"].float(), use_gate_in_kernel=True, safe_gate=True, lower_bound=LB,
             A_log=x["A"].float(), dt_bias=x["dt"].float())
    a.update(over)
    return a


def test_checks_accept_or_raise_value_error():
    """Every mutation of a valid decode call is either accepted with the right (scale, lower_bound) or rejected
    with ValueError — never another exception (the messages are built lazily, only when a check fails)."""
    a = _args()
    assert check_kda_call(**a, cu_seqlens=None) == (K ** -0.5, LB)
    meta = {n: t.to("meta") for n, t in a.items() if isinstance(t, torch.Tensor)}
    mutations = [
        dict(q=a["q"].double()), dict(k=a["k"][..., :-1]), dict(v=a["v"][:, :, :1]), dict(g=a["g"][:1]),
        dict(beta=a["beta"][..., None]), dict(q=a["q"][0]), dict(v=a["v"].half()), dict(k=a["k"].bfloat16()),
        dict(beta=a["beta"].to(torch.int32)), dict(initial_state=a["initial_state"].double()),
        dict(initial_state=a["initial_state"][:2]), dict(initial_state=None), dict(initial_state=meta["initial_state"]),
        dict(k=meta["k"]), dict(A_log=meta["A_log"]), dict(scale=0.0), dict(scale=-1.0), dict(scale=float("inf")),
        dict(scale=float("nan")), dict(scale=2), dict(scale=0.5), dict(scale="x"), dict(lower_bound=-6.0),
        dict(lower_bound=0.0), dict(lower_bound=-5), dict(lower_bound=-0.5), dict(lower_bound=True),
        dict(lower_bound=None), dict(lower_bound=None, safe_gate=False), dict(lower_bound=None, A_log=None),
        dict(A_log=a["A_log"][:1]), dict(dt_bias=a["dt_bias"][:-1]), dict(A_log=a["A_log"].to(torch.int64)),
        dict(A_log=None), dict(dt_bias=None), dict(use_gate_in_kernel=False, A_log=a["A_log"][:1]),
        dict(dt_bias=a["dt_bias"].view(H, K)), dict(q=torch.nn.Parameter(a["q"])), dict(A_log=[0.0, 0.0]),
    ]
    accepted = 0
    for m in mutations:
        b = dict(a, **m)
        # the one-expression check of plainly valid calls never accepts what the detailed checks reject
        fast = _common_call_dims(b["q"], b["k"], b["v"], b["g"], b["beta"], b["initial_state"])
        if fast is not None:
            assert fast == _checked_dims(b["q"], b["k"], b["v"], b["g"], b["beta"], b["initial_state"], None), m
        try:
            scale, lb = check_kda_call(**b, cu_seqlens=None)
        except ValueError as e:
            assert str(e), f"{list(m)}: empty message"
            continue
        accepted += 1
        want_scale = K ** -0.5 if b["scale"] is None else float(b["scale"])
        want_lb = None if b["lower_bound"] is None else float(b["lower_bound"])
        assert (scale, lb) == (want_scale, want_lb), f"{list(m)}: {(scale, lb)}"
    assert 8 <= accepted < len(mutations)  # both outcomes occur


def test_public_errors_name_the_argument(monkeypatch):
    """Bad decode calls still raise ValueError naming the argument (through the fast path's fallback)."""
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    a = _args()
    x = dict(q=a["q"], k=a["k"], v=a["v"], g=a["g"], beta=a["beta"], s0=a["initial_state"], A=a["A_log"],
             dt=a["dt_bias"])
    for over, name in ((dict(k=a["k"][..., :-1]), "k"), (dict(beta=a["beta"][0]), "beta"),
                       (dict(s0=a["initial_state"].double()), "initial_state"), (dict(dt=a["dt_bias"][:3]), "dt_bias"),
                       (dict(v=a["v"].to("meta")), "v")):
        with pytest.raises(ValueError, match=name):
            ours(dict(x, **over))
    with pytest.raises(ValueError, match="lower_bound"):
        fused_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], lower_bound=-7.0)
    with pytest.raises(ValueError, match="scale"):
        fused_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=-1.0)


class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("persist", [0, 2])
def test_host_ops_per_decode_call(monkeypatch, persist):
    """One decode call (kernel launch stubbed) runs no torch op beside allocating its outputs: no casts, copies,
    zero-fills or host syncs (each would be a launch or a sync per step). Before v4 it also built ~20 error
    messages per call; that is timed in the report, not here."""
    launches = []  # both kernels' launches, in order
    monkeypatch.setattr(fr, "_kda_recurrent", KernelSpy(launches=launches))
    monkeypatch.setattr(fr, "_kda_decode_persistent", KernelSpy(launches=launches))
    monkeypatch.setattr(fr.DecodeConfig, "persist", persist)
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    a = _args(q=make(3, 1)["q"].half(), k=make(3, 1)["k"].half())
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=LB, A_log=a["A_log"], dt_bias=a["dt_bias"])
    with _Count() as c:
        fused_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
                            output_final_state=True, **kw)
    assert dict(c.ops) == {"aten.empty.memory_format": 2}  # o and the final state
    pool, idx = torch.zeros(5, H, K, V), torch.tensor([3, 0, 2])
    with _Count() as c:  # the Triton function itself (CPU indices get value checks in the public wrapper)
        fused_recurrent_kda_triton(a["q"], a["k"], a["v"], a["g"], a["beta"], 0.25, pool, False, True, True, True,
                                   LB, None, a["A_log"], a["dt_bias"], ssm_state_indices=idx)
    assert dict(c.ops) == {"aten.empty.memory_format": 1}  # o only: the pool is updated in place
    assert len(launches) == 2 and all(len(g) == (1 if persist else 2) for g, _, _ in launches)


def test_decode_programs_must_be_positive(monkeypatch):
    """``DecodeConfig.programs`` (the persistent grid size, for A/B runs) refuses 0 and negatives by name."""
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    a = {n: t.float() for n, t in make(2, 1).items()}
    for bad in (0, -3):
        monkeypatch.setattr(fr.DecodeConfig, "programs", bad)
        with pytest.raises(ValueError, match="DecodeConfig.programs"):
            fused_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["s0"],
                                output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, A_log=a["A"],
                                dt_bias=a["dt"])


def test_persistent_grid_fits_in_one_wave():
    """Every persistent program is resident at once: registers (at the derived cap) and pipeline buffers of
    per_sm programs fit one SM, so no program waits for a slot and then runs its whole share of tiles late."""
    for persist in (1, 2, 3, 4, 5, 6, 8, 16):
        for warps in (1, 2, 4, 8):
            for stages in (2, 3, 4):
                for BV in (16, 32, 64, 128):
                    per_sm, cap = fr._persistent_fit(persist, warps, stages, 128, BV, None)
                    assert 1 <= per_sm <= persist and cap >= 8
                    assert per_sm * warps * 32 * cap <= fr._REGS_PER_SM or per_sm == 1
                    assert per_sm == 1 or per_sm * ((stages - 1) * 128 * BV * 4 + 1024) <= fr._SMEM_PER_SM
    assert fr._persistent_fit(4, 4, 3, 128, 32, None) == (4, 128)  # the proposed default: no spills on sm_90
    assert fr._persistent_fit(4, 4, 3, 128, 32, 96) == (4, 96)


@gpu
def test_gpu_decode_variants_bf16(variant):
    """Every variant on the GPU at the benchmark's head size (K = V = 128), bf16 inputs: decode step against the
    fp64 recurrence (2e-2), and the pool in place."""
    B, Hg, D = 64, 8, 128
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(B, 1, Hg, D), k=r(B, 1, Hg, D), v=r(B, 1, Hg, D), g=r(B, 1, Hg, D), beta=r(B, 1, Hg),
             A=0.5 * r(Hg), dt=0.5 * r(Hg * D), s0=r(B, Hg, D, D))
    lo = {n: t.to("cuda", torch.float32 if n in ("A", "dt", "s0") else torch.bfloat16) for n, t in x.items()}
    hi = {n: t.double().cpu() for n, t in lo.items()}
    ro, rs = reference(hi)
    o, s = ours(lo)
    assert rel(o.cpu(), ro) <= 2e-2 and rel(s.cpu(), rs) <= 2e-2
    pool = torch.zeros(2 * B, Hg, D, D, device="cuda")
    idx = torch.arange(B, device="cuda") * 2
    pool[idx] = lo["s0"]
    o2, p = ours(dict(lo, s0=pool), ssm_state_indices=idx)
    assert p is pool and rel(o2.cpu(), ro) <= 2e-2 and rel(pool[idx].cpu(), rs) <= 2e-2
    assert torch.count_nonzero(pool[1::2]) == 0
    # negative slots (first, middle and last sequence) start from zero and write nothing
    ro0, _ = reference(hi, h0=False)
    idx[[0, B // 2, B - 1]] = -1
    before = pool.clone()
    o3, _ = ours(dict(lo, s0=pool), ssm_state_indices=idx)
    neg = idx < 0
    assert rel(o3[neg].cpu(), ro0[neg.cpu()]) <= 2e-2
    assert torch.equal(pool[1::2], before[1::2]) and torch.equal(pool[[0, B, 2 * B - 2]], before[[0, B, 2 * B - 2]])


@gpu
@pytest.mark.parametrize("Kd,Vd", [(16, 128), (128, 16), (100, 72), (64, 64), (128, 128)])
def test_gpu_decode_head_dims_bf16(monkeypatch, Kd, Vd):
    """The default dispatch (the Gluon kernel at K = V = 128, the Triton kernels otherwise) at other head dims, bf16:
    one step (B = 5) and a varlen prefix of 7 tokens, outputs and states against the fp64 recurrence."""
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    for B, T, cu in ((5, 1, None), (1, 7, [0, 3, 3, 7])):
        x = make(B, T, N=None if cu is None else len(cu) - 1, seed=11, K=Kd, V=Vd)
        lo = {n: t.to("cuda", torch.float32 if n in ("A", "dt", "s0") else torch.bfloat16) for n, t in x.items()}
        hi = {n: t.double().cpu() for n, t in lo.items()}
        ro, rs = reference(hi, cu=cu)
        o, s = ours(lo, cu=cu)
        assert rel(o.cpu(), ro) <= 2e-2 and rel(s.cpu(), rs) <= 2e-2, (B, T)
