"""MLA attention ops against their fp32 references: the flash kernels (outputs, LSE, every gradient), the absorbed
split-K decode kernel over a cache pool, and the segment-merged chunked prefill.

CPU: the Triton kernels run in the interpreter (fp32, tiny shapes). GPU: bf16 at K3's and ``small``'s head dims,
long caches, CUDA-graph capture and ``torch.compile``. Outputs are allocated inside the calls; ``torch.empty`` is
NaN-poisoned (``nan_empty``) so an element a kernel forgets to write shows up.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from k3.ops.mla import attention, attention_ref, expand_latent, mla_decode, mla_decode_ref, mla_prefill  # noqa: E402
from k3.ops.mla.flash import head_blocks  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-sized fp32 cases (the GPU runs bf16)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch, nan_empty: None) -> None:
    monkeypatch.setenv("K3_MLA_BACKEND", "triton")


def _grads(fn, q, k, v, go, gl):
    """o, lse and (dq, dk, dv) of ``fn`` for output gradients ``go`` and LSE gradients ``gl`` (0 where lse = −inf)."""
    o, lse = fn(q, k, v)
    fin = torch.isfinite(lse)
    loss = (o.float() * go).sum() + (torch.where(fin, lse, 0.0) * gl).sum()
    return o, lse, torch.autograd.grad(loss, [q, k, v])


def _check_attention(B, T, L, H, D, Dv, shift, dtype, tol, scale=0.3):
    torch.manual_seed(B * 1000 + T + L + D)
    q, k = torch.randn(B, T, H, D, device=DEV, dtype=dtype), torch.randn(B, L, H, D, device=DEV, dtype=dtype)
    v = torch.randn(B, L, H, Dv, device=DEV, dtype=dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sh = None if shift is None else torch.tensor(shift, dtype=torch.int32, device=DEV)
    go = torch.randn(B, T, H, Dv, device=DEV)
    gl = torch.randn(B, H, T, device=DEV)
    o, lse, g = _grads(lambda *a: attention(*a, scale, sh), q, k, v, go, gl)
    o2, lse2, g2 = _grads(lambda *a: attention_ref(*(t.float() for t in a), scale, 0 if sh is None else sh),
                          q, k, v, go, gl)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(lse2))  # rows that see no key: lse = −inf, o = 0
    fin = torch.isfinite(lse2)
    assert rel(o, o2) < tol and rel(lse[fin], lse2[fin]) < tol
    for name, a, b in zip("qkv", g, g2):
        assert torch.isfinite(a).all() and rel(a, b) < tol, name


# ------------------------------------------------------------------------------------------------- CPU (interpreter)
def test_head_blocks() -> None:
    assert head_blocks(192) == (128, 64) and head_blocks(96) == (64, 32) and head_blocks(128) == (128, 0)
    assert head_blocks(10) == (16, 0) and head_blocks(24) == (16, 16) and head_blocks(100) == (64, 64)


@cpu_only
@pytest.mark.parametrize("B,T,L,H,D,Dv,shift", [
    (2, 37, 37, 2, 24, 5, None),  # causal, odd length, two column blocks (16 + 8 of 16), v padded
    (1, 20, 45, 2, 48, 32, [25]),  # the last T of L keys (32 + 16 exact)
    (2, 17, 30, 1, 10, 16, [-5, 20]),  # per-row shifts; row 0's first 5 queries see no key
])
def test_flash_attention_interpreter(triton_backend, B, T, L, H, D, Dv, shift) -> None:
    _check_attention(B, T, L, H, D, Dv, shift, torch.float32, 1e-5)


@cpu_only
@pytest.mark.parametrize("B,T,H,c,r,lens,slots,splits", [
    (2, 1, 3, 10, 4, [1, 17], [2, 0], None),  # one query, lengths 1 and 17, a pool of 3
    (3, 4, 5, 24, 8, [4, 17, 33], [1, 3, 0], 4),  # T = 4 (causal among them), 20 rows = 2 groups, split-K
    (1, 1, 2, 16, 0, [30], None, 3),  # no rope dims, rows 0..B−1
    (1, 2, 2, 16, 8, [600], [2], 40),  # 38 live splits: the merge takes them in two steps of 32
])
def test_mla_decode_interpreter(triton_backend, B, T, H, c, r, lens, slots, splits) -> None:
    torch.manual_seed(len(lens) + T)
    q, qp = torch.randn(B, T, H, c, device=DEV), torch.randn(B, T, H, r, device=DEV)
    buf = torch.randn(4, max(40, *lens), c + r, device=DEV)
    lengths = torch.tensor(lens, dtype=torch.int32, device=DEV)
    sl = None if slots is None else torch.tensor(slots, device=DEV)
    got = mla_decode(q, qp, buf, sl, lengths, 0.3, num_splits=splits, min_split=16)
    assert rel(got, mla_decode_ref(q, qp, buf, sl, lengths, 0.3)) < 1e-5


def test_mla_decode_bad_rows_read_nothing(triton_backend) -> None:
    """Lengths and slots live on the device, unchecked: a row with a slot outside the pool or a length outside
    [0, capacity] must return NaN without reading past ``buf`` (an out-of-bounds read faults the whole CUDA
    context). ``buf`` is a window of a larger tensor of finite values, so a read past it would give a finite
    output; the valid rows still equal the reference."""
    from k3.ops.mla.decode import _mla_decode_op

    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    torch.manual_seed(0)
    P, cap, c, r, T = 3, 40, 16, 8, 1
    big = torch.randn(P + 1, cap + 24, c + r, device=DEV, dtype=dt)
    buf = big[:P, :cap]  # big[P] and big[:, cap:] are what an unchecked kernel would read
    lens = [17, cap + 20, 9, -5, 2**31 - 1, cap]
    slots = [1, 0, P, 2, 0, -1]
    B = len(lens)
    q = torch.randn(B, T, 2, c, device=DEV, dtype=dt)
    qp = torch.randn(B, T, 2, r, device=DEV, dtype=dt)
    lengths = torch.tensor(lens, dtype=torch.int32, device=DEV)
    sl = torch.tensor(slots, device=DEV)
    got = _mla_decode_op(q, qp, buf, sl, lengths, 0.3, 3, 16)
    want = mla_decode_ref(q[:1], qp[:1], buf, sl[:1], lengths[:1], 0.3)
    assert rel(got[:1], want) < (2e-2 if dt == torch.bfloat16 else 1e-5)
    assert torch.isnan(got[1:]).all()


def _prefill_case(dtype, device, H=2, n=8, r=8, v=16, c=12, P=3, cap=48, T=13, starts=(0, 20), slots=(2, 0)):
    torch.manual_seed(7)
    buf = torch.randn(P, cap, c + r, device=device, dtype=dtype)
    w = (torch.randn(H * (n + v), c, device=device) / c**0.5).to(dtype)
    q = torch.randn(len(starts), T, H, n + r, device=device, dtype=dtype)
    return q, buf, w, torch.tensor(starts, dtype=torch.int32, device=device), torch.tensor(slots, device=device)


def _prefill_ref(q, buf, slots, start, w, n, v, scale):
    T = q.shape[1]
    L = int((start + T).max())
    k, vv = expand_latent(buf[slots.long(), :L].float(), w.float(), q.shape[2], n, v)
    return attention_ref(q.float(), k, vv, scale, start.long())[0]


@cpu_only
@pytest.mark.parametrize("segment", [8, None])
def test_mla_prefill_segments_interpreter(triton_backend, segment) -> None:
    """Segments of 8 keys (several merges, one segment past row 0's length) equal one attention over the cache;
    the merge's LSE path carries gradients."""
    q, buf, w, start, slots = _prefill_case(torch.float32, DEV)
    q.requires_grad_()
    w.requires_grad_()
    got = mla_prefill(q, buf, slots, start, w, 8, 16, 0.25, segment=segment)
    want = _prefill_ref(q, buf, slots, start, w, 8, 16, 0.25)
    assert rel(got, want) < 1e-5
    go = torch.randn_like(want)
    g1 = torch.autograd.grad((got * go).sum(), [q, w])
    g2 = torch.autograd.grad((want * go).sum(), [q, w])
    assert rel(g1[0], g2[0]) < 1e-5 and rel(g1[1], g2[1]) < 1e-5


def test_bad_input() -> None:
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="k must be"):
        attention(q, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8), 0.3)
    with pytest.raises(ValueError, match="shift"):
        attention(q, torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 4), 0.3, shift=torch.zeros(2, dtype=torch.int32))
    buf = torch.randn(2, 8, 12)
    with pytest.raises(ValueError, match="lengths"):
        mla_decode(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 4), buf, None, torch.tensor([3]), 0.3)
    with pytest.raises(ValueError, match="lengths"):
        mla_decode(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 4), buf, None, torch.tensor([9], dtype=torch.int32),
                   0.3)
    with pytest.raises(ValueError, match="buf"):
        mla_decode(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 5), buf, None, torch.tensor([3], dtype=torch.int32),
                   0.3)
    three = torch.tensor([3, 3, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="buf"):  # 3 batch rows, 2 pool rows, no slots
        mla_decode(torch.randn(3, 1, 2, 8), torch.randn(3, 1, 2, 4), buf, None, three, 0.3)
    with pytest.raises(ValueError, match="slots"):
        mla_decode(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 4), buf, torch.tensor([2]), three[:1], 0.3)


# --------------------------------------------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.parametrize("D,T,L,shift", [
    (192, 1000, 1000, None),  # K3: 128 nope + 64 rope; causal training, odd length
    (192, 257, 300, [-3, 43]),  # per-row shifts, some queries see no key
    (96, 100, 700, [600, 350]),  # small: 64 + 32; a chunk at the end of a longer cache (prefill segments)
])
def test_flash_attention_bf16(nan_empty, D, T, L, shift) -> None:
    B = 1 if shift is None else len(shift)
    _check_attention(B, T, L, 4, D, 128, shift, torch.bfloat16, 2e-2, scale=D**-0.5)


def _decode_case(B, T, H, c, r, lens, capacity, slots=None, pool=None):
    torch.manual_seed(B + T + capacity)
    buf = torch.randn(pool or B, capacity, c + r, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, T, H, c, device="cuda", dtype=torch.bfloat16) / c**0.25
    qp = torch.randn(B, T, H, r, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sl = None if slots is None else torch.tensor(slots, device="cuda")
    return q, qp, buf, sl, lengths, (128 + r) ** -0.5


@gpu
@pytest.mark.parametrize("T,dims", [(1, (96, 512, 64)), (4, (96, 512, 64)), (1, (8, 256, 32))])  # (H, c, r): K3, small
def test_mla_decode_bf16(nan_empty, T, dims) -> None:
    """Cache lengths 1 (or T), 17, 4 K and 128 K in one ragged batch over a pool (rows in shuffled slots)."""
    args = _decode_case(4, T, *dims, [T, 17, 4096, 131072], 131072 + 5, slots=[3, 0, 4, 1], pool=5)
    assert rel(mla_decode(*args), mla_decode_ref(*args)) < 2e-2


@gpu
@pytest.mark.parametrize("B,L,dims", [
    (64, 32768, (8, 256, 32)),  # the first benchmark row that faulted (its lengths were read before written)
    (64, 131072, (8, 256, 32)),  # a 4.5 GiB cache: offsets past 2^31 elements
    (8, 32768, (96, 512, 64)),
])
def test_mla_decode_bf16_benchmark_shapes(nan_empty, B, L, dims) -> None:
    """The benchmark's decode shapes against the reference, then as the benchmark times them: captured in a CUDA
    graph on a side stream and replayed (equal to the eager call bitwise)."""
    q, qp, buf, _, lengths, scale = _decode_case(B, 1, *dims, [L] * B, L)
    lengths[B // 2:] = L - 1000  # ragged
    got = mla_decode(q, qp, buf, None, lengths, scale)
    assert rel(got, mla_decode_ref(q, qp, buf, None, lengths, scale)) < 2e-2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = mla_decode(q, qp, buf, None, lengths, scale)
        g.replay()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@gpu
def test_mla_decode_cuda_graph_replays_any_length() -> None:
    """One graph captured at a short length serves longer ones: split sizes come from ``lengths`` on the device."""
    H, c, r, B = 8, 256, 32, 2
    buf = torch.randn(B, 8192, c + r, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, 1, H, c, device="cuda", dtype=torch.bfloat16) / c**0.25
    qp = torch.randn(B, 1, H, r, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([5, 9], dtype=torch.int32, device="cuda")
    mla_decode(q, qp, buf, None, lengths, 0.1)  # autotune + compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mla_decode(q, qp, buf, None, lengths, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mla_decode(q, qp, buf, None, lengths, 0.1)
    for lens in ([5, 9], [4000, 8192], [1, 777]):
        lengths.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        assert torch.equal(out, mla_decode(q, qp, buf, None, lengths, 0.1)), lens


@gpu
def test_mla_prefill_bf16_segments() -> None:
    q, buf, w, start, slots = _prefill_case(torch.bfloat16, "cuda", H=8, n=64, r=32, v=128, c=256, cap=3000,
                                            T=700, starts=(2000, 300))
    got = mla_prefill(q, buf, slots, start, w, 64, 128, 96**-0.5, segment=1024)
    assert rel(got, _prefill_ref(q, buf, slots, start, w, 64, 128, 96**-0.5)) < 2e-2
