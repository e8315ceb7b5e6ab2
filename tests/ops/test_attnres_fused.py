"""The fused AttnRes Triton kernels (interpreter, fp32, on CPU; the same tests run on CUDA when present) against the
fp32 reference: outputs and every gradient, with and without the fused output norm, 1 and 16 sources, odd token
counts, NaN-poisoned outputs; fla's entries; the two-phase form; torch.library registration."""

import pytest
import torch
import torch.nn.functional as F

from k3.ops import attn_res, fused_attnres, naive_attnres
from k3.ops.attnres import attn_res_fused, attn_res_merge, attn_res_phase1, attn_res_reference
from k3.ops.attnres.two_phase import attn_res_merge_fused

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, params=["held", "streamed"])
def backward_kernel(request, monkeypatch) -> str:
    """Every test runs with both backward kernels: rows held in registers wherever they fit (every shape here), and
    the streamed one (by default each mix takes the one measured faster for its shape)."""
    monkeypatch.setenv("K3_ATTNRES_BACKWARD", request.param)
    return request.param


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS of a against b, compared on the CPU in fp64 (the fp64 references run on the CPU, the kernels on
    DEV)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _inputs(n: int, shape: tuple[int, ...], onorm: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    srcs = [(torch.randn(*shape, generator=g) * (1 + i)).to(DEV).requires_grad_() for i in range(n)]
    q = (torch.randn(D, generator=g) * 3 / D ** 0.5).to(DEV).requires_grad_()  # scores of a few units
    w = (torch.rand(D, generator=g) + 0.5).to(DEV).requires_grad_()
    ow = (torch.rand(D, generator=g) + 0.5).to(DEV).requires_grad_() if onorm else None
    return srcs, q, w, ow


@pytest.mark.parametrize("n,shape,onorm,save_pre", [
    (1, (5, 24), False, False), (1, (5, 24), True, True), (3, (7, 40), True, False), (4, (3, 3, 100), True, True),
    (16, (3, 33), False, True), (2, (1, 64), True, False),
])
def test_fused_matches_reference(n, shape, onorm, save_pre, nan_empty) -> None:
    """Against the reference in fp64 on the same inputs. The score gradients (query, gain) sum over tokens with
    cancellation, so fp32 itself — the fp32 reference included — is only good to ~1e-5 there."""
    srcs, q, w, ow = _inputs(n, shape, onorm, n * 7 + len(shape))
    leaves = [q, w, *srcs] + ([ow] if onorm else [])
    y = attn_res_fused(q, srcs, w, 1e-5, ow, 0.7, save_pre)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(n)).to(DEV)
    got = torch.autograd.grad(y, leaves, dy)
    ref = [t.detach().cpu().double().requires_grad_() for t in leaves]
    want_y = attn_res_reference(ref[0], ref[2:2 + n], ref[1], 1e-5, ref[-1] if onorm else None, 0.7)
    want = torch.autograd.grad(want_y, ref, dy.cpu().double())
    assert y.shape == want_y.shape and y.dtype == torch.float32
    assert rel(y, want_y) < 1e-6
    for i, (a, b) in enumerate(zip(got, want)):
        if n == 1 and i < 2:  # one source: the scores get no gradient at all
            assert torch.count_nonzero(a) == 0 and torch.count_nonzero(b) == 0
        else:
            assert rel(a, b) < (1e-4 if i < 2 else 1e-5), i


def _check_grads(n: int, shape: tuple[int, ...], onorm: bool, seed: int, scale: float = 0.7, tol: float = 1e-5) -> None:
    srcs, q, w, ow = _inputs(n, shape, onorm, seed)
    leaves = [q, w, *srcs] + ([ow] if onorm else [])
    y = attn_res_fused(q, srcs, w, 1e-5, ow, scale)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(DEV)
    got = torch.autograd.grad(y, leaves, dy)
    ref = [t.detach().cpu().double().requires_grad_() for t in leaves]
    want_y = attn_res_reference(ref[0], ref[2:2 + n], ref[1], 1e-5, ref[-1] if onorm else None, scale)
    want = torch.autograd.grad(want_y, ref, dy.cpu().double())
    assert torch.isfinite(y).all() and rel(y, want_y) < 1e-6
    errs = [rel(a, b) for a, b in zip(got, want)]
    assert all(torch.isfinite(a).all() for a in got) and max(errs) < tol, errs


def test_output_norm_backward_on_wide_rows(nan_empty) -> None:
    """The output-norm backward on rows wider than a warp's reach with a masked tail (896 of 1024 lanes, K3's 7168
    of 8192 in proportion), outputs and gradient buffers NaN-poisoned: every lane and partial row is written."""
    _check_grads(3, (2, 896), True, 21, 1.0, 1e-4)


@pytest.mark.parametrize("bt,bt_bwd,n,T,onorm", [(1, 1, 2, 17, False), (2, 4, 2, 33, True)])
def test_several_rows_per_program(bt: int, bt_bwd: int, n: int, T: int, onorm: bool, nan_empty, monkeypatch) -> None:
    """Long inputs: 4 rows per forward program, BT = 1 or 2 of them per step (the GPU's autotuner may pick either),
    16 rows per backward program (T = 33), BT = 1 or 4 of them per backward step, the last rows past T."""
    import triton

    from k3.ops.attnres import fused

    for kernel, b in ((fused.attn_res_fwd_kernel, bt), (fused.attn_res_bwd_kernel, bt_bwd),
                      (fused.attn_res_bwd_held_kernel, bt_bwd)):
        monkeypatch.setattr(kernel, "configs", [triton.Config({"BT": b, "STAGES": 1}, num_warps=4)])
        monkeypatch.setattr(kernel, "cache", {})
    # the GPU gives several rows per program only to inputs long enough to fill it: force them here
    monkeypatch.setattr(fused, "_fwd_rows", lambda T, device: 4)
    monkeypatch.setattr(fused, "_bwd_rows", lambda T, device: 16)
    _check_grads(n, (T, 24), onorm, 22)
    # the two-phase merge (the forward kernel started from a prior state) at the same step width
    closed = [torch.randn(T, 24, device=DEV) * (i + 1) for i in range(2)]
    q, g, p = torch.randn(24, device=DEV), torch.rand(24, device=DEV) + 0.5, torch.randn(T, 24, device=DEV)
    ow = torch.rand(24, device=DEV) + 0.5 if onorm else None
    o1, lse = attn_res_phase1((q * g)[None], closed, 1e-5)
    got = attn_res_merge_fused(o1[0], lse[0], p, q * g, 1e-5, ow)
    assert rel(got, attn_res_reference(q, [*closed, p], g, 1e-5, ow)) < 1e-6


def test_peaked_weights_stay_accurate() -> None:
    """Scores tens of units apart (depth weights ~1e-4 / 0.9998): the score gradients are then tiny differences;
    the kernel forms δ = ⟨g, o⟩ from the fp32 mix, so their relative error grows like 1e-7 / (1 − p_max)."""
    srcs, q, w, ow = _inputs(2, (4, 64), True, 16)
    q = (q.detach() * 8).requires_grad_()
    leaves = [q, w, *srcs, ow]
    y = attn_res_fused(q, srcs, w, 1e-5, ow, 0.7)
    do = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, do)
    ref = [t.detach().cpu().double().requires_grad_() for t in leaves]
    y64 = attn_res_reference(ref[0], ref[2:4], ref[1], 1e-5, ref[4], 0.7)
    want = torch.autograd.grad(y64, ref, do.cpu().double())
    assert rel(y, y64) < 1e-6
    errs = [rel(a, b) for a, b in zip(got, want)]
    assert [e < tol for e, tol in zip(errs, [2e-3, 2e-3, 1e-5, 1e-5, 1e-5])] == [True] * 5, errs


def test_zero_query_gives_the_plain_mean() -> None:
    torch.manual_seed(0)
    srcs = [torch.randn(5, 24, device=DEV) * (i + 1) for i in range(3)]
    mean = torch.stack(srcs).mean(0)
    for y in (attn_res(torch.zeros(24, device=DEV), srcs, torch.rand(24, device=DEV)),
              attn_res_fused(torch.zeros(24, device=DEV), srcs, None, 1e-5),
              attn_res_reference(torch.zeros(24), [s.cpu() for s in srcs])):
        assert rel(y, mean) < 1e-6


def test_bad_input_names_the_argument() -> None:
    s = torch.zeros(2, 4)
    cases = [
        (lambda: attn_res(torch.zeros(4), []), "sources"),
        (lambda: attn_res(torch.zeros(4), [s, torch.zeros(3, 4)]), r"sources\[1\] has shape"),
        (lambda: attn_res(torch.zeros(4), [s, s.double()]), r"sources\[1\] has dtype"),
        (lambda: attn_res(torch.zeros(4), [s, torch.zeros(2, 4, device="meta")]), r"sources\[1\] lives on"),
        (lambda: attn_res(torch.zeros(4), [s.long()]), r"sources\[0\]"),
        (lambda: attn_res(torch.zeros(5), [s]), "query"),
        (lambda: attn_res(torch.zeros(4), [s], torch.ones(3)), "norm_weight"),
        (lambda: attn_res(torch.zeros(4), [s], None, 1e-5, torch.ones(5)), "out_norm_weight"),
        (lambda: attn_res(torch.zeros(4), [s], None, 0.0), "eps"),
        (lambda: fused_attnres(torch.zeros(4), [], torch.ones(4)), "residuals"),
        (lambda: fused_attnres(torch.zeros(4), [s], torch.ones(4), checkpoint_level=2), "checkpoint_level"),
        (lambda: naive_attnres(torch.zeros(4), [s], torch.ones(3)), "rms_weight"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def _fla_naive(query, residuals, rms_weight, output_rms_weight=None, rms_eps=1e-6, scale=1.0):
    """fla's reference formula: keys rms_norm(v) · rms_weight scored against query · scale, depth softmax."""
    D = residuals[0].shape[-1]
    v = torch.stack([r.reshape(-1, D).float() for r in residuals])
    k = F.rms_norm(v, (D,), rms_weight.flatten().float(), rms_eps)
    p = torch.einsum("lnd,d->ln", k, query.flatten().float() * scale).softmax(0)
    o = torch.einsum("ln,lnd->nd", p, v).view(residuals[0].shape)
    if output_rms_weight is not None:
        o = F.rms_norm(o, (D,), output_rms_weight.float(), rms_eps)
    return o.to(residuals[0].dtype), p.view(len(residuals), *residuals[0].shape[:-1])


@pytest.mark.parametrize("onorm", [False, True])
def test_fla_entries_match_fla_semantics(onorm: bool) -> None:
    srcs, q, w, ow = _inputs(3, (2, 5, 48), onorm, 11)
    want_o, want_p = _fla_naive(q[:, None], srcs, w, ow, 1e-6, 48 ** -0.5)
    o, p = naive_attnres(q[:, None], srcs, w, ow, scale=48 ** -0.5, return_weights=True)
    assert rel(o, want_o) < 1e-6 and rel(p, want_p) < 1e-6 and p.shape == (3, 2, 5)
    for level in (0, 1):
        o, p = fused_attnres(q[:, None], srcs, w, ow, scale=48 ** -0.5, return_weights=True, checkpoint_level=level)
        assert rel(o, want_o) < 1e-5 and rel(p, want_p) < 1e-5
    o, p = attn_res_fused(q, srcs, w, 1e-6, ow, 48 ** -0.5, return_weights=True)  # the Triton path on any device
    assert rel(o, want_o) < 1e-5 and rel(p, want_p) < 1e-5 and p.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_phase_equals_the_per_layer_mix(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    closed = [torch.randn(2, 7, 32, dtype=dtype) * (i + 1) for i in range(4)]
    queries = [(torch.randn(32, dtype=dtype), torch.rand(32, dtype=dtype) + 0.5) for _ in range(5)]
    partials = [torch.randn(2, 7, 32, dtype=dtype) * 3 for _ in queries]
    ow = torch.rand(32, dtype=dtype) + 0.5
    o1, lse = attn_res_phase1(torch.stack([q * g for q, g in queries]), closed, 1e-5)
    assert o1.shape == (5, 2, 7, 32) and lse.shape == (5, 2, 7)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for i, ((q, g), p) in enumerate(zip(queries, partials)):
        for out_w in (None, ow):
            got = attn_res_merge(o1[i], lse[i], p, q * g, 1e-5, out_w)
            assert rel(got, attn_res_reference(q, [*closed, p], g, 1e-5, out_w)) <= tol


def test_registered_ops_pass_opcheck() -> None:
    srcs, q, w, ow = _inputs(2, (3, 16), True, 5)
    qw = (q * w).detach()
    flat = [s.detach().requires_grad_() for s in srcs]
    for save_pre in (False, True):
        torch.library.opcheck(torch.ops.k3.attn_res_fwd.default, (flat, qw.requires_grad_(), ow, 1e-5, 1.0, save_pre),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_fla_signatures() -> None:
    """fla 0.6.0's ``fla.ops.attnres`` signatures: names, order and defaults."""
    import inspect

    fla_fused = [("query", None), ("residuals", None), ("rms_weight", None), ("output_rms_weight", None),
                 ("rms_eps", 1e-6), ("scale", 1.0), ("return_weights", False), ("checkpoint_level", 1)]
    for fn, want in ((fused_attnres, fla_fused), (naive_attnres, fla_fused[:-1])):
        got = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
               for p in inspect.signature(fn).parameters.values()]
        assert got == want


@pytest.mark.parametrize("onorm", [False, True])
def test_merge_kernel_matches_the_reference(onorm: bool, nan_empty) -> None:
    """The Triton merge (forward kernel started from phase 1's state) equals the per-layer mix."""
    torch.manual_seed(4)
    closed = [torch.randn(3, 5, 40, device=DEV) * (i + 1) for i in range(3)]
    q, g = torch.randn(40, device=DEV) * 0.5, torch.rand(40, device=DEV) + 0.5
    p = torch.randn(3, 5, 40, device=DEV) * 2
    ow = torch.rand(40, device=DEV) + 0.5 if onorm else None
    o1, lse = attn_res_phase1((q * g)[None], closed, 1e-5)
    got = attn_res_merge_fused(o1[0], lse[0], p, q * g, 1e-5, ow)
    assert got.shape == p.shape and rel(got, attn_res_reference(q, [*closed, p], g, 1e-5, ow)) < 1e-6


def _stream(mix, leaves, pairs, sinks: bool):
    """A residual stream shaped like the model's: mixes over the closed blocks and a partial sum, each mix's output
    feeding a 'sublayer' whose output joins the stream, a block closing midway; returns the loss."""
    from k3.ops.attnres import GradSink

    a, b = leaves
    blocks, partial, outs = [a], b, []
    # each source's sink, by the tensor's id; the entry keeps the tensor alive so that a later tensor cannot reuse
    # the id (a partial sum replaced in the stream is otherwise freed under checkpointing, which saves nothing)
    table: dict[int, tuple[torch.Tensor, GradSink]] = {}

    def sink(s: torch.Tensor) -> GradSink:
        return table.setdefault(id(s), (s, GradSink()))[1]

    def call(i, sources):
        q, w, ow = pairs[i]
        if sinks:
            return mix(q, sources, [sink(s) for s in sources], w, 1e-5, ow)
        return mix(q, sources, w, 1e-5, ow)

    for i in range(len(pairs) - 1):
        h = call(i, [*blocks, partial])
        out = torch.tanh(h) * (0.5 + 0.1 * i)
        if i == 1:  # the partial sum closes as a block; the sublayer's output opens the next one
            blocks, partial = [*blocks, partial], out
        else:
            partial = partial + out
        outs.append(h)
    y = call(len(pairs) - 1, [*blocks, partial])
    g = torch.Generator().manual_seed(5)
    return sum(((o * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in [*outs, y]))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_sinked_mixes_sum_each_sources_gradient_in_the_kernel(checkpointed: bool, nan_empty, monkeypatch) -> None:
    """``attn_res_sinked`` over a stream of mixes gives every gradient that the reference's autograd sums give; the
    later mixes add into the first's buffer (seen through the backward's ``into``), only the owner hands it on, and
    non-reentrant checkpointing around part of the stream changes nothing."""
    import k3.ops.attnres.sink as sink_mod
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(3)
    D, shape = 40, (3, 7, 40)
    leaves = [(torch.randn(*shape, generator=g) * s).to(DEV).requires_grad_() for s in (1.0, 2.0)]
    pairs = [((torch.randn(D, generator=g) / D ** 0.5).to(DEV).requires_grad_(),
              (torch.rand(D, generator=g) + 0.5).to(DEV).requires_grad_(),
              (torch.rand(D, generator=g) + 0.5).to(DEV).requires_grad_() if i % 2 else None) for i in range(5)]
    params = [*leaves, *(t for p in pairs for t in p if t is not None)]
    ref = [t.detach().cpu().double().requires_grad_() for t in params]  # the fp64 reference on the CPU
    it = iter(ref[2:])
    ref_pairs = [tuple(None if t is None else next(it) for t in p) for p in pairs]
    ref_loss = _stream(attn_res_reference, ref[:2], ref_pairs, sinks=False)
    want = torch.autograd.grad(ref_loss, ref)

    seen = []
    real_bwd = sink_mod.attn_res_bwd

    def spy(*args, into=None, **kw):
        seen.append([b is not None for b in into])
        return real_bwd(*args, into=into, **kw)

    monkeypatch.setattr(sink_mod, "attn_res_bwd", spy)
    run = lambda: _stream(sink_mod.attn_res_sinked, leaves, pairs, sinks=True)  # noqa: E731
    loss = checkpoint(run, use_reentrant=False) if checkpointed else run()
    got = torch.autograd.grad(loss, params)
    assert rel(loss, ref_loss) < 1e-5
    for i, (x, w) in enumerate(zip(got, want)):  # the score gradients (query, gain) sum with cancellation: fp32's ~1e-5
        assert x is not None and rel(x, w) < (1e-5 if i < 2 else 1e-4), (i, rel(x, w))
    # the backwards run last mix first: the first (the output mix) writes fresh buffers, the closed block a is
    # summed into by every mix after it
    assert len(seen) == len(pairs) and not any(seen[0]) and all(s[0] for s in seen[1:]), seen


def test_sinked_mix_rejects_bad_sinks() -> None:
    from k3.ops.attnres import GradSink, attn_res_sinked

    srcs, q, w, _ = _inputs(2, (3, 8), False, 0)
    with pytest.raises(ValueError, match="sinks"):
        attn_res_sinked(q, srcs, [GradSink()], w, 1e-5)
    with pytest.raises(ValueError, match="sources"):
        attn_res_sinked(q, [srcs[0], srcs[0]], [GradSink(), GradSink()], w, 1e-5)
    with pytest.raises(ValueError, match="sources"):
        attn_res_sinked(q, [], [], w, 1e-5)


_HELD_SM90 = r"""
import os, subprocess, tempfile
import triton
import k3.ops.attnres.fused as fu
from tests.ops.sm90 import compile_sm90

fn = fu.attn_res_bwd_held_kernel.fn
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for ns, D, onorm in ((1, 24, False), (2, 1024, False), (7, 1024, True), (8, 1000, True), (4, 2048, True)):
    assert fu.fits_registers(ns, D)
    nsp, bd = triton.next_power_of_2(ns), triton.next_power_of_2(D)
    for c in fu._prune_held(fu._HELD_CONFIGS, {}, NSP=nsp, BD=bd, ROWS=16):
        const = dict(D=D, NS=ns, NSP=nsp, ROWS=16, BT=c.kwargs["BT"], BD=bd, HAS_ONORM=onorm,
                     STAGES=c.kwargs["STAGES"])
        types = {n: "fp32" if n in ("eps", "scale") else "i32" if n in ("T", "ACC") else
                 "*fp32" if n in ("qw", "lse", "logit", "rstd", "dqw", "dow") else "*bf16"
                 for n in fn.arg_names if n not in const}
        types["src"] = types["dsrc"] = tuple(["*bf16"] * ns)
        k = compile_sm90(fn, types, const, c.num_warps)
        assert "st.global" in k.asm["ptx"], (ns, D, c)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"]), f.flush()
            use = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        assert " STACK:0 " in use and " LOCAL:0 " in use, (ns, D, c, use)  # no spills
assert not fu.fits_registers(16, 1024) and not fu.fits_registers(1, 7168)
print("compiled", flush=True)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only check (on a GPU the kernels themselves run)")
def test_held_backward_compiles_for_sm90_in_bf16(backward_kernel) -> None:
    """The held-rows backward compiles to sm_90 code for bf16 sources at the configs its pruning keeps, without
    spills (stack or local memory in ptxas' resource use), for every width and source count it takes: what the fp32
    interpreter cannot check. In a subprocess: the interpreter is on in this process."""
    if backward_kernel == "streamed":
        pytest.skip("one compile check is enough")
    from tests.ops.sm90 import run_script

    r = run_script(_HELD_SM90, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def test_backward_kernel_choice(backward_kernel, monkeypatch) -> None:
    from k3.ops.attnres import fused

    assert fused.holds_rows(3, 40) == (backward_kernel == "held")
    assert fused.holds_rows(8, 1024) == (backward_kernel == "held")  # fits, but measured slower than streamed
    assert not fused.holds_rows(16, 1024) and not fused.holds_rows(1, 7168)  # rows that would spill: streamed
    monkeypatch.delenv("K3_ATTNRES_BACKWARD")  # the default: held where it measured faster
    assert fused.holds_rows(4, 1024) and fused.holds_rows(1, 2048) and fused.holds_rows(16, 256)
    assert not fused.holds_rows(5, 1024) and not fused.holds_rows(3, 2048) and not fused.holds_rows(2, 7168)
    monkeypatch.setenv("K3_ATTNRES_BACKWARD", "fast")
    with pytest.raises(ValueError, match="K3_ATTNRES_BACKWARD"):
        fused.holds_rows(3, 40)
