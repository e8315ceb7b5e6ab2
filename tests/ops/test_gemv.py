"""Decode-sized linear kernels (``k3.ops.gemv``): the Triton kernel against the unfused ops for every prologue
(interpreter on CPU in fp32/fp16, CUDA with a GPU), odd sizes, strided inputs, extreme values, NaN-poisoned outputs;
the public functions' dispatch and argument checks; on a GPU, the bf16 kernel inside a model's decode step."""

import pytest
import torch
import torch.nn.functional as F

from k3.ops import gemv as G
from k3.ops.gemv.gemv_triton import gemv
from k3.ops.moe.situ import situ_glu_reference
from k3.ops.norm_gate import rms_norm_gate_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LOW = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("K3_MOE_POISON", "1")  # every output starts as NaN: an unwritten element fails


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def _randn(*shape, scale=1.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize("M,K,N", [(1, 300, 70), (2, 1024, 33), (1, 7, 5), (3, 520, 9), (1, 64, 1)])
@pytest.mark.parametrize("dtype", LOW)
def test_plain_kernel_equals_matmul(M, K, N, dtype):
    x, w = _randn(M, K, dtype=dtype, seed=M), _randn(N, K, scale=K ** -0.5, dtype=dtype, seed=K)
    add = _randn(M, N, dtype=dtype, seed=N)
    want = x.double() @ w.double().t()
    y = gemv(x, w)
    assert y.dtype == dtype and not y.isnan().any()
    assert rel_rms(y, want) < _tol(dtype)
    assert rel_rms(gemv(x, w, add=add), want + add.double()) < _tol(dtype)
    y32 = gemv(x, w, out_dtype=torch.float32)  # the router's fp32 logits from bf16 operands
    assert y32.dtype == torch.float32 and rel_rms(y32, want) < max(1e-5, _tol(dtype) / 4)


def test_strided_rows_are_read_in_place():
    """A column slice of a wider projection (``FusedProjections``) as the input rows."""
    wide = _randn(3, 200, seed=1)
    x = wide[:, 50:150]
    w = _randn(17, 100, seed=2)
    assert x.stride(0) == 200
    assert rel_rms(gemv(x, w), x.double() @ w.double().t()) < 1e-5


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("M,Fw,N", [(1, 512, 33), (2, 96, 7)])
def test_situ_prologue_equals_situ_then_matmul(M, Fw, N, dtype):
    g, u = _randn(M, Fw, scale=6, dtype=dtype, seed=3), _randn(M, Fw, scale=40, dtype=dtype, seed=4)
    g[0, :3] = torch.tensor([1e4, -1e4, 0.0], dtype=dtype)  # both tanh saturated: the output bound holds
    w = _randn(N, Fw, scale=Fw ** -0.5, dtype=dtype, seed=5)
    add = _randn(M, N, dtype=dtype, seed=6)
    h = situ_glu_reference(g, u, 4.0, 25.0)  # rounded to dtype, as the kernel rounds its prologue
    want = h.double() @ w.double().t() + add.double()
    got = gemv(g, w, b=u, situ=(4.0, 25.0), add=add)
    assert rel_rms(got, want) < _tol(dtype)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("M,H,D,N", [(1, 8, 32, 40), (2, 3, 16, 7), (1, 8, 128, 9), (1, 6, 64, 130)])
def test_norm_gate_prologue_equals_norm_gate_then_matmul(M, H, D, N, dtype):
    o, gl = _randn(M, H, D, scale=3, dtype=dtype, seed=7), _randn(M, H, D, scale=4, dtype=dtype, seed=8)
    o[0, 0] = 0.0  # a head of zeros: rsqrt(eps) times zero stays zero
    nw = (torch.rand(D, generator=torch.Generator().manual_seed(9)) + 0.5).to(DEV)  # fp32 gain, as in KDA
    w = _randn(N, H * D, scale=(H * D) ** -0.5, dtype=dtype, seed=10)
    want = rms_norm_gate_reference(o, gl, nw, 1e-5, dtype).reshape(M, H * D).double() @ w.double().t()
    got = gemv(o.reshape(M, H * D), w, b=gl.reshape(M, H * D), norm=(nw, 1e-5, D))
    assert rel_rms(got, want) < _tol(dtype)


@pytest.mark.parametrize("dtype", LOW)
def test_gate_prologue_equals_gate_then_matmul(dtype):
    o, gl = _randn(2, 96, scale=2, dtype=dtype, seed=11), _randn(2, 96, scale=30, dtype=dtype, seed=12)
    w = _randn(19, 96, scale=0.1, dtype=dtype, seed=13)
    want = (o * torch.sigmoid(gl)).double() @ w.double().t()
    assert rel_rms(gemv(o, w, b=gl, gate=True), want) < _tol(dtype)


def test_public_functions_equal_the_unfused_ops():
    """On any device (CPU: the unfused ops themselves) the four functions equal their definitions."""
    x, w, add = _randn(3, 2, 48, seed=14), _randn(10, 48, seed=15), _randn(3, 2, 10, seed=16)
    assert rel_rms(G.linear(x, w, add=add), F.linear(x, w) + add) < 1e-5
    assert rel_rms(G.linear(x[0, :1], w, out_dtype=torch.float32), F.linear(x[0, :1], w)) < 1e-5
    g, u = _randn(1, 48, scale=5, seed=17), _randn(1, 48, scale=30, seed=18)
    a2 = _randn(1, 10, seed=19)
    want = F.linear(situ_glu_reference(g, u, 4.0, 25.0), w) + a2
    assert rel_rms(G.situ_linear(g, u, w, 4.0, 25.0, add=a2), want) < 1e-5
    o, gl = _randn(1, 1, 3, 16, seed=20), _randn(1, 1, 3, 16, seed=21)
    nw = torch.ones(16, device=DEV)
    want = F.linear(rms_norm_gate_reference(o, gl, nw, 1e-6, torch.float32).reshape(1, 1, 48), w)
    got = G.norm_gate_linear(o, gl, nw, 1e-6, w)
    assert got.shape == (1, 1, 10) and rel_rms(got, want) < 1e-5
    assert rel_rms(G.gate_linear(x, g.expand(3, 2, 48), w), F.linear(x * torch.sigmoid(g), w)) < 1e-5


def test_bad_arguments_name_themselves():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        G.linear(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="add"):
        G.linear(x, w, add=torch.randn(1, 5))
    with pytest.raises(ValueError, match="gate and up"):
        G.situ_linear(x, torch.randn(1, 9), w, 4.0, 25.0)
    with pytest.raises(ValueError, match="o and g"):
        G.norm_gate_linear(torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.ones(3), 1e-6, w)
    with pytest.raises(ValueError, match="o and g"):
        G.gate_linear(x, torch.randn(1, 7), w)


def test_dispatch_takes_the_kernel_only_for_decode_rows_without_autograd():
    cpu = torch.randn(1, 8)
    assert not G.use_gemv(1, cpu)  # CPU tensors run the unfused ops
    if DEV == "cuda":
        x = torch.randn(1, 8, device=DEV)
        w = torch.randn(4, 8, device=DEV, requires_grad=True)
        assert G.use_gemv(1, x) and G.use_gemv(G.MAX_ROWS, x) and not G.use_gemv(G.MAX_ROWS + 1, x)
        assert not G.use_gemv(1, x, w)  # a gradient to record: cuBLAS (autograd knows it)
        with torch.no_grad():
            assert G.use_gemv(1, x, w)


@pytest.mark.skipif(DEV != "cuda", reason="the decode step's bf16 kernels need a GPU")
def test_decode_step_with_the_kernels_matches_cublas(monkeypatch):
    """A small bf16 model's one-token step: the kernels (MAX_ROWS as shipped) against cuBLAS and the unfused
    elementwise kernels (MAX_ROWS = 0) on the same weights and state."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM

    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny", dtype="bfloat16", hidden_size=128, kda_head_dim=64, v_head_dim=64)
    with torch.device(DEV):
        model = K3ForCausalLM(cfg).eval()
    model.fuse_projections()
    ids = torch.randint(0, 256, (1, 37), device=DEV)
    out = {}
    for rows in (0, G.MAX_ROWS):
        monkeypatch.setattr("k3.ops.gemv.gemv.MAX_ROWS", rows)
        with torch.no_grad():
            state = model.init_state(1, device=DEV, capacity=64)
            model(ids, state=state)
            out[rows] = model(ids[:, -1:], state=state).logits.float()
    assert not out[G.MAX_ROWS].isnan().any()
    assert rel_rms(out[G.MAX_ROWS], out[0]) < 2e-2


def test_op_is_registered():
    """``k3::gemv``: schema, fake tensor and tracing checks of torch.library, for each prologue."""
    from k3.ops.gemv.gemv_triton import _gemv_op

    a, b, w, add = _randn(2, 64, seed=22), _randn(2, 64, seed=23), _randn(9, 64, seed=24), _randn(2, 9, seed=25)
    nw = torch.ones(32, device=DEV)
    for args in [(None, None, add, 0, 0.0, 0.0, 0.0, 1), (b, None, None, 1, 4.0, 25.0, 0.0, 1),
                 (b, nw, None, 2, 0.0, 0.0, 1e-5, 32), (b, None, None, 3, 0.0, 0.0, 0.0, 1)]:
        torch.library.opcheck(_gemv_op, (a, w, *args, torch.float32))
