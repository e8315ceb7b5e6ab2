"""GPU checks of the AttnRes / RMSNorm / loss kernels in bf16 (and fp16) against fp32 references — outputs and every
gradient by relative RMS (≤ 2e-2), odd token counts, 1 / 9 / 16 sources, K3's width 7168, NaN-poisoned outputs —
plus ``torch.compile(fullgraph=True)`` over the registered ops and the model's fused loss. Skipped without CUDA."""

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.ops import attn_res
from k3.ops.attnres import attn_res_fused, attn_res_reference
from k3.ops.loss import linear_cross_entropy, linear_cross_entropy_reference
from k3.ops.norm import rms_norm, rms_norm_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = 2e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _fp32_leaves(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().float().requires_grad_() for t in leaves]


@pytest.mark.parametrize("n,T,D,onorm,save_pre,dtype", [
    pytest.param(9, 4225, 7168, False, False, torch.bfloat16, id="k3-width"),
    pytest.param(9, 4225, 7168, True, False, torch.bfloat16, id="k3-width-out-norm"),
    pytest.param(9, 257, 7168, True, True, torch.bfloat16, id="k3-width-out-norm-saved-mix"),
    pytest.param(1, 333, 1024, False, False, torch.bfloat16, id="one-source"),
    pytest.param(1, 333, 1024, True, True, torch.bfloat16, id="one-source-out-norm"),
    pytest.param(16, 101, 1000, True, False, torch.bfloat16, id="16-sources"),
    pytest.param(16, 101, 1000, False, True, torch.float16, id="16-sources-fp16"),
    pytest.param(3, 77, 1000, True, False, torch.float32, id="fp32"),
])  # "k3-width*": ≥ 32 rows per SM, the benchmark's kernel variants (compiled once per run, token counts are not
#   specialised)
def test_attn_res_fused(n, T, D, onorm, save_pre, dtype, nan_empty) -> None:
    torch.manual_seed(n * T)
    srcs = [(torch.randn(T, D, device="cuda") * (i + 1)).to(dtype).requires_grad_() for i in range(n)]
    q = (torch.randn(D, device="cuda") * 3 / D ** 0.5).to(dtype).requires_grad_()
    w = (torch.rand(D, device="cuda") + 0.5).to(dtype).requires_grad_()
    ow = (torch.rand(D, device="cuda") + 0.5).to(dtype).requires_grad_() if onorm else None
    leaves = [q, w, *srcs] + ([ow] if onorm else [])
    y = attn_res_fused(q, srcs, w, 1e-5, ow, 1.0, save_pre)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, dy)
    ref = _fp32_leaves(leaves)
    y_ref = attn_res_reference(ref[0], ref[2:2 + n], ref[1], 1e-5, ref[-1] if onorm else None)
    want = torch.autograd.grad(y_ref, ref, dy.float())
    assert y.dtype == dtype and torch.isfinite(y).all() and rel(y, y_ref) < TOL
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == leaves[i].dtype and torch.isfinite(a).all()
        if n == 1 and i < 2:
            assert torch.count_nonzero(a) == 0
        else:
            assert rel(a, b) < TOL, i


def test_attn_res_dispatches_to_the_kernels_on_cuda(monkeypatch) -> None:
    import k3.ops.attnres.op as op

    called = []
    real = op.attn_res_fused
    monkeypatch.setattr(op, "attn_res_fused", lambda *a, **k: called.append(1) or real(*a, **k))
    srcs = [torch.randn(3, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    y = attn_res(torch.zeros(64, device="cuda"), srcs)
    assert called and rel(y, torch.stack([s.float() for s in srcs]).mean(0)) < 1e-2


@pytest.mark.parametrize("T,D", [pytest.param(17001, 7168, id="k3-width"), (333, 1024), (1001, 128)])
def test_rms_norm_fused(T, D, nan_empty) -> None:
    torch.manual_seed(T)
    x = (torch.randn(T, D, device="cuda") * 4).to(torch.bfloat16).requires_grad_()
    w = (torch.rand(D, device="cuda") + 0.5).to(torch.bfloat16).requires_grad_()
    y = rms_norm(x, w, 1e-5)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w], dy)
    xr, wr = _fp32_leaves([x, w])
    y_ref = rms_norm_reference(xr, wr, 1e-5)
    want = torch.autograd.grad(y_ref, [xr, wr], dy.float())
    assert y.dtype == torch.bfloat16 and rel(y, y_ref) < TOL
    assert rel(got[0], want[0]) < TOL and rel(got[1], want[1]) < TOL


@pytest.mark.parametrize("N,d,V", [pytest.param(1001, 1024, 32768, id="small"), (77, 256, 50000)])
def test_linear_cross_entropy_fused(N, d, V, nan_empty) -> None:
    torch.manual_seed(N)
    h = torch.randn(N, d, device="cuda").to(torch.bfloat16).requires_grad_()
    W = (torch.randn(V, d, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    t[::5] = -100
    loss = linear_cross_entropy(h, W, t)
    got = torch.autograd.grad(loss, [h, W])
    hr, Wr = _fp32_leaves([h, W])
    ref = linear_cross_entropy_reference(hr, Wr, t)
    want = torch.autograd.grad(ref, [hr, Wr])
    assert abs(loss.item() - ref.item()) < TOL * abs(ref.item())
    assert got[0].dtype == torch.bfloat16 and rel(got[0], want[0]) < TOL and rel(got[1], want[1]) < TOL


def test_compiled_region_keeps_the_ops() -> None:
    """fullgraph=True: the registered ops must not break the graph; compiled and eager agree."""
    torch.manual_seed(0)
    D = 256
    srcs = [torch.randn(2, 33, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    q, g, ow, nw = (torch.rand(D, device="cuda", requires_grad=True) for _ in range(4))
    W = (torch.randn(1000, D, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 1000, (2, 33), device="cuda")

    def f(srcs, q, g, ow, nw, W, t):
        x = attn_res(q, srcs, g, 1e-5, ow)
        return linear_cross_entropy(rms_norm(x, nw, 1e-5), W, t)

    eager = f(srcs, q, g, ow, nw, W, t)
    ge = torch.autograd.grad(eager, [*srcs, q, W])
    compiled = torch.compile(f, fullgraph=True)(srcs, q, g, ow, nw, W, t)
    gc = torch.autograd.grad(compiled, [*srcs, q, W])
    assert abs(compiled.item() - eager.item()) < 1e-3 * abs(eager.item())
    assert all(rel(a, b) < 1e-2 for a, b in zip(gc, ge))


def test_model_fused_loss_and_two_phase_on_cuda() -> None:
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("tiny", dtype="bfloat16")).cuda()
    ids = torch.randint(0, 256, (2, 37), device="cuda")
    out = model(ids, labels=ids)
    assert out._logits is None  # the fused loss did not materialise the logits
    ref = K3ForCausalLM.loss(out.logits, ids)  # read lazily now
    assert abs(out.loss.item() - ref.item()) < TOL * ref.item()
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        full = model(ids).logits.float()
        st = model.init_state(2)
        pieces = torch.cat([model(ids[:, a:b], state=st).logits for a, b in [(0, 1), (1, 20), (20, 37)]], 1)
    # bf16 end to end, and other kernels on each side (chunked vs recurrent KDA, two-phase vs per-layer mixes)
    assert rel(pieces.float(), full) < 5e-2


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_model_sums_each_blocks_gradient_in_the_attnres_kernel(ac: str, monkeypatch) -> None:
    """The model's mixes sum a stream tensor's gradients in one buffer (``GradSink``s): every parameter gradient
    equals the one autograd's own sums give (the mixes without sinks), also under activation checkpointing."""
    import k3.layers.attnres as layer_mod

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("tiny")).cuda()  # fp32: only the summation order differs
    ids = torch.randint(0, 256, (2, 45), device="cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    calls = []
    real = layer_mod.attn_res_sinked

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(layer_mod, "attn_res_sinked", spy)
    model.gradient_checkpointing_enable(ac)
    got = torch.autograd.grad(model(ids, labels=ids).loss, params, allow_unused=True)
    assert calls, "the model did not take the sinked mixes"
    monkeypatch.setattr(layer_mod, "attn_res_sinked", lambda q, s, sinks, w, eps, ow=None: attn_res(q, s, w, eps, ow))
    model.gradient_checkpointing_enable("none")
    want = torch.autograd.grad(model(ids, labels=ids).loss, params, allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert rel(a, b) < 1e-4, (name, rel(a, b))
