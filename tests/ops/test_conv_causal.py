"""The short causal convolution of a whole piece: the Triton kernels (interpreter on CPU in fp32 / fp16, bf16 on a
GPU) against the fp64 ``F.conv1d`` reference — output, new tail and every gradient (x, weight, tail) by relative
RMS, outputs NaN-poisoned; odd lengths, T < W−1, with and without a tail, SiLU on and off, extreme inputs; the
``k3::short_conv_fwd`` op under ``torch.library.opcheck`` and inside a ``fullgraph`` compiled region."""

import pytest
import torch

import k3.ops.conv.causal_triton as causal_triton
from k3.layers.conv import ShortConv
from k3.ops.conv import short_conv, short_conv_fused, short_conv_reference

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
C, W = 24, 4  # 24 channels: two channel blocks of the interpreter's 16, the second one partly masked


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _inputs(B: int, T: int, with_tail: bool, dtype: torch.dtype, seed: int, scale: float = 1.0, device: str = DEV,
            channels: int = C):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, T, channels, generator=g) * scale).to(dtype).to(device).requires_grad_()
    w = (torch.randn(channels, 1, W, generator=g) * 0.6).to(device).requires_grad_()
    tail = None
    if with_tail:
        tail = (torch.randn(B, W - 1, channels, generator=g) * scale).to(dtype).to(device).requires_grad_()
    return x, w, tail


def _compare(fn, x, w, tail, activation: bool, seed: int) -> dict[str, float]:
    """Relative RMS errors of ``fn`` against the fp64 reference: y, the new tail, and the gradients of
    ⟨y, dy⟩ + ⟨new_tail, dt⟩ with respect to every input."""
    leaves = [x, w] + ([tail] if tail is not None else [])
    y, new_tail = fn(x, w, tail, activation)
    assert y.dtype == x.dtype and new_tail.dtype == x.dtype and y.shape == x.shape
    g = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(y.shape, generator=g).to(y.device)
    dt = torch.randn(new_tail.shape, generator=g).to(y.device)
    got = torch.autograd.grad((y.float() * dy).sum() + (new_tail.float() * dt).sum(), leaves)
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    yr, tr = short_conv_reference(ref_leaves[0], ref_leaves[1], ref_leaves[2] if tail is not None else None,
                                  activation)
    want = torch.autograd.grad((yr * dy.cpu().double()).sum() + (tr * dt.cpu().double()).sum(), ref_leaves)
    errs = {"y": rel(y.cpu(), yr), "tail": rel(new_tail.cpu(), tr), "dx": rel(got[0].cpu(), want[0]),
            "dw": rel(got[1].cpu(), want[1])}
    if tail is not None:
        errs["dtail"] = rel(got[2].cpu(), want[2])
    for name, t in zip(("dx", "dw", "dtail"), got):
        assert torch.isfinite(t).all(), name
    return errs


CASES = [  # (B, T, with tail, SiLU)
    (2, 1, True, True),     # one token after a tail (a prefill of one)
    (2, 2, False, True),    # T < W − 1, no tail
    (2, 2, True, False),    # T < W − 1: the new tail is part old tail, part x
    (2, 3, True, True),     # T = W − 1
    (1, 63, False, True),
    (1, 130, True, True),   # several row groups in the backward
    (1, 37, False, False),
]


@pytest.mark.skipif(CUDA, reason="interpreter-sized cases (CPU)")
@pytest.mark.parametrize("B,T,with_tail,activation", CASES)
def test_fused_matches_fp64_reference(B, T, with_tail, activation, nan_empty) -> None:
    x, w, tail = _inputs(B, T, with_tail, torch.float32, seed=T)
    errs = _compare(short_conv_fused, x, w, tail, activation, seed=T)
    assert max(errs.values()) < 1e-6, errs


@pytest.mark.skipif(CUDA, reason="interpreter-sized cases (CPU)")
def test_fused_fp16_matches_reference(nan_empty) -> None:
    """fp16 in and out (fp32 accumulation): one rounding of each output and gradient."""
    x, w, tail = _inputs(2, 19, True, torch.float16, seed=5)
    errs = _compare(short_conv_fused, x, w, tail, True, seed=5)
    assert max(errs.values()) < 2e-3, errs


@pytest.mark.skipif(CUDA, reason="interpreter-sized cases (CPU)")
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter: exp(−large) = inf, σ = 0
@pytest.mark.parametrize("scale", [1e4, 1e-20])
def test_extreme_inputs_stay_finite_and_accurate(scale, nan_empty) -> None:
    """Large pre-activations saturate SiLU (σ → 0 or 1; its derivative must not give inf · 0); tiny ones stay
    linear."""
    x, w, tail = _inputs(1, 9, True, torch.float32, seed=11, scale=scale)
    errs = _compare(short_conv_fused, x, w, tail, True, seed=11)
    assert max(errs.values()) < 1e-5, errs


def test_piecewise_calls_equal_one_shot() -> None:
    """The returned tail carries the stream: pieces of 1, 2 and 5 tokens give the one-shot output."""
    x, w, _ = _inputs(2, 8, False, torch.float32, seed=3)
    x, w = x.detach(), w.detach()
    full, _ = short_conv_fused(x, w)
    outs, tail = [], None
    for a, b in [(0, 1), (1, 3), (3, 8)]:
        y, tail = short_conv_fused(x[:, a:b], w, tail)
        outs.append(y)
    assert rel(torch.cat(outs, 1), full) < 1e-6


def test_reads_column_slices_in_place() -> None:
    """q, k, v as column slices of one fused projection output (a row stride ≠ C): the same numbers, no copy."""
    x, w, tail = _inputs(2, 7, True, torch.float32, seed=9)
    packed = torch.cat([x.detach(), torch.randn(2, 7, 5, device=DEV)], 2)
    sliced = packed[..., :C]
    assert sliced.stride(1) == C + 5
    y, t = short_conv_fused(sliced, w.detach(), tail.detach())
    y_ref, t_ref = short_conv_reference(x.detach(), w.detach(), tail.detach())
    assert rel(y, y_ref) < 1e-6 and torch.equal(t, t_ref)


def test_op_passes_opcheck() -> None:
    """``k3::short_conv_fwd``: schema, fake tensors, autograd registration (with and without a tail)."""
    for with_tail in (False, True):
        x, w, tail = _inputs(1, 5, with_tail, torch.float32, seed=13)
        torch.library.opcheck(torch.ops.k3.short_conv_fwd.default, (x, w, tail, True),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_op_outputs_have_the_fakes_strides() -> None:
    """Both ops' real outputs are laid out as their fake impls say (inductor asserts the fake's strides on the real
    tensors), with a strided input slice and a tail."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, tail = _inputs(2, 7, True, torch.float32, seed=19, channels=2 * C)
    x, tail = x.detach()[..., ::2], tail.detach()[..., ::2]  # column slices: strides of a wider projection
    w = w.detach()[:C]
    dy = torch.randn(2, 7, C).to(DEV)
    real = (torch.ops.k3.short_conv_fwd(x, w, tail, True),
            *torch.ops.k3.short_conv_bwd(dy, x, w, tail, True, True))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx, fw, ft, fdy = (mode.from_tensor(t) for t in (x, w, tail, dy))
        fake = (torch.ops.k3.short_conv_fwd(fx, fw, ft, True), *torch.ops.k3.short_conv_bwd(fdy, fx, fw, ft, True, True))
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def test_compiled_region_keeps_the_op_whole() -> None:
    """A ``fullgraph`` compiled ShortConv (aot_eager on CPU, inductor on a GPU) traces through the op's fake and
    autograd formula without a graph break, and gives the eager numbers."""
    conv = ShortConv(C, W).to(DEV)
    x, _, _ = _inputs(1, 6, False, torch.float32, seed=17)

    def f(x):
        return short_conv_fused(x, conv.weight)[0]

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    y = compiled(x)
    gx, gw = torch.autograd.grad(y.sum(), [x, conv.weight])
    y_e = f(x)
    ex, ew = torch.autograd.grad(y_e.sum(), [x, conv.weight])
    assert rel(y, y_e) < 1e-6 and rel(gx, ex) < 1e-6 and rel(gw, ew) < 1e-6


def test_dispatch_and_bad_input(monkeypatch) -> None:
    """ShortConv runs the op on CUDA tensors and the reference on CPU ones unless ``K3_KDA_BACKEND`` says otherwise;
    bad shapes name the argument."""
    calls = []
    real = causal_triton.short_conv_op
    monkeypatch.setattr(causal_triton, "short_conv_op", lambda *a: calls.append(1) or real(*a))
    conv = ShortConv(C, W).to(DEV)
    x = torch.randn(1, 5, C, device=DEV)
    conv(x)
    assert len(calls) == int(CUDA)
    for forced, runs in (("triton", True), ("torch", False)):  # K3_KDA_BACKEND forces either (the interpreter on CPU)
        monkeypatch.setenv("K3_KDA_BACKEND", forced)
        calls.clear()
        conv(x)
        assert len(calls) == int(runs), forced
    monkeypatch.setenv("K3_KDA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="K3_KDA_BACKEND"):
        conv(x)
    monkeypatch.delenv("K3_KDA_BACKEND")
    with pytest.raises(ValueError, match="tail"):
        short_conv(torch.randn(1, 5, C), conv.weight.cpu(), torch.zeros(1, 2, C))
    with pytest.raises(ValueError, match="weight"):
        short_conv(torch.randn(1, 5, C), torch.zeros(C, W))
    with pytest.raises(ValueError, match="x"):
        short_conv(torch.randn(5, C), conv.weight.cpu())


@pytest.mark.skipif(not CUDA, reason="bf16 kernels need a GPU")
@pytest.mark.parametrize("B,T,Ch,with_tail,activation", [(2, 1023, 1024, False, True), (3, 77, 1000, True, True),
                                                          (2, 2, 1024, True, False)])
def test_bf16_on_gpu(B, T, Ch, with_tail, activation, nan_empty) -> None:
    """bf16 in and out at a KDA width (1024 = small's 8 heads × 128; 1000: a channel count no tile divides)."""
    x, w, tail = _inputs(B, T, with_tail, torch.bfloat16, seed=T, device="cuda", channels=Ch)
    errs = _compare(short_conv, x, w, tail, activation, seed=T)
    assert max(errs.values()) < 1e-2, errs


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_compiled_kda_convs_on_gpu() -> None:
    """Three convs of one KDA layer in an inductor ``fullgraph`` region, bf16, training: eager numbers."""
    convs = [ShortConv(1024, W).cuda() for _ in range(3)]
    xs = [torch.randn(2, 515, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]

    def f(*xs):
        return sum(c(x)[0].float().square().sum() for c, x in zip(convs, xs))

    leaves = [*xs, *(c.weight for c in convs)]
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(*xs), leaves)
    want = torch.autograd.grad(f(*xs), leaves)
    assert all(rel(a, b) < 1e-3 for a, b in zip(got, want))


_SM90 = r"""
import k3.ops.conv.causal_triton as ct
from tests.ops.sm90 import compile_sm90

ptrs = dict(x="*bf16", w="*fp32", tail="*bf16", dy="*bf16", dx="*bf16", dtail="*bf16", dw="*fp32", y="*bf16")
for kernel, extra in ((ct.short_conv_fwd_kernel, {}), (ct.short_conv_bwd_kernel, {"ROWS": 128})):
    fn = kernel.fn
    for cfg in kernel.configs:
        for tail in (False, True):
            const = {"W": 4, "ACT": True, "HAS_TAIL": tail, "DTAIL": tail, **extra, **cfg.kwargs}
            const = {n: v for n, v in const.items() if n in fn.arg_names}
            types = {n: ptrs.get(n, "i32") for n in fn.arg_names if n not in const}
            ptx = compile_sm90(fn, types, const, cfg.num_warps).asm["ptx"]
            assert "st.global" in ptx, (fn.__name__, cfg)
print("compiled", flush=True)
"""


@pytest.mark.skipif(CUDA, reason="a CPU-only check (on a GPU the kernels themselves run)")
def test_kernels_compile_for_sm90_in_bf16():
    """Every tuned config of the forward and backward kernels, with and without a tail, compiles to sm_90 code for
    bf16 tensors without a GPU: the interpreter runs fp32 Python and cannot see what only the compiler checks (a
    loop-carried value whose dtype changes in the loop). In a subprocess: the interpreter is on in this process."""
    from tests.ops.sm90 import run_script

    r = run_script(_SM90, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
