"""The fused small-row expert FFN (``k3.ops.moe.experts_small_triton``) against its references.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) in fp32 on tiny
shapes: odd row counts, empty experts, one expert holding every row (more rows than one BM chunk), widths that are
not multiples of the tiles, rows past ``offs[-1]``, saturating SiTU inputs. Kernel outputs (h and y) are poisoned
with NaN first (K3_MOE_POISON=1), so a row the first kernel forgets to write shows up in the second. The GPU tests
(bf16 at decode widths, and the layer captured in a CUDA graph and replayed with new routing) skip without CUDA.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3.config import K3Config
from k3.layers.moe import LatentMoE
from k3.ops.moe import grouped
from k3.ops.moe.experts_small import SMALL_ROWS, grouped_ffn_reference
from k3.ops.moe.grouped import expert_rows, grouped_ffn, grouped_mm
from k3.ops.moe.situ import situ_glu_reference

pytest.importorskip("triton")
from k3.ops.moe import experts_small_triton  # noqa: E402
from k3.ops.moe.experts_small_triton import grouped_ffn_small  # noqa: E402
from tests.ops.moe_ref import DEV, gpu, poison_outputs, rel  # noqa: E402, F401 — poison_outputs: autouse


def weights(E: int, F: int, L: int, scale: float = 0.3, dtype=torch.float32, device=DEV, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)
                 for s in ((E, F, L), (E, F, L), (E, L, F)))


def per_row_fp64(x, counts, w1, w3, w2, beta1=4.0, beta2=25.0):
    """Ground truth in fp64 (SiTU-GLU written out: ``situ_glu_reference`` computes in fp32), one row at a time from
    the group sizes (independent of any offs arithmetic)."""
    ex = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    w1, w3, w2 = w1.double().cpu(), w3.double().cpu(), w2.double().cpu()

    def situ(g, u):
        return beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * beta2 * torch.tanh(u / beta2)

    rows = [w2[e] @ situ(w1[e] @ x[r].double().cpu(), w3[e] @ x[r].double().cpu()) for r, e in enumerate(ex.tolist())]
    tail = x.shape[0] - len(rows)
    return torch.cat([torch.stack(rows) if rows else torch.zeros(0, w2.shape[1], dtype=torch.float64),
                      torch.zeros(tail, w2.shape[1], dtype=torch.float64)])


# (group sizes per expert, rows past offs[-1], ℓ, F): odd R, empty experts, one expert with all rows (17 > BM = 16:
# two chunks), E = 7 and widths not multiples of the 16-wide tiles, a tail of rows that belong to no expert.
CASES = [
    ([0, 0, 1, 0, 0], 0, 32, 64),
    ([1, 0, 2, 0, 0], 0, 32, 64),
    ([3, 0, 7, 6, 0], 1, 32, 64),
    ([0, 0, 0, 17, 0], 0, 32, 64),
    ([2, 0, 5, 1, 0, 4, 3], 2, 40, 24),
    ([0] * 100 + [2] + [0] * 28 + [1], 0, 32, 64),  # E = 130: offs read in two 128-wide chunks
]


@pytest.mark.parametrize("counts,tail,L,F", CASES[1:5])
def test_small_ffn_reads_token_rows_in_place(counts, tail, L, F):
    """``rows`` (the token of each sorted row, as ``expert_rows`` gives it): the same result as the sorted copy."""
    torch.manual_seed(7 + tail)
    E, R = len(counts), sum(counts) + tail
    m = max(1, R // 2 + 1)
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    tokens = torch.randn(m, L, device=DEV)
    rows = torch.randint(0, m, (R,), device=DEV)
    w1, w3, w2 = weights(E, F, L, seed=R + 1)
    want = per_row_fp64(tokens[rows], counts, w1, w3, w2)
    assert rel(grouped_ffn_small(tokens, offs, w1, w3, w2, rows=rows), want) < 1e-5
    with torch.no_grad():  # the public dispatch: the small-row kernels, or a gather before the grouped GEMMs
        assert rel(grouped_ffn(tokens, offs, w1, w3, w2, rows=rows), want) < 1e-5


def test_small_ffn_rows_are_checked():
    offs = torch.tensor([2, 3], dtype=torch.int32, device=DEV)
    w1, w3, w2 = weights(2, 8, 4)
    x = torch.randn(2, 4, device=DEV)
    with pytest.raises(ValueError, match="rows"):
        grouped_ffn_small(x, offs, w1, w3, w2, rows=torch.tensor([0, 1, 1], dtype=torch.int32, device=DEV))
    if DEV == "cpu":  # values are checked where that costs no device sync
        with pytest.raises(ValueError, match="rows"):
            grouped_ffn_small(x, offs, w1, w3, w2, rows=torch.tensor([0, 1, 2]))
        with pytest.raises(ValueError, match="offs"):
            grouped_ffn_small(x, offs, w1, w3, w2, rows=torch.tensor([0, 1]))  # R = 2 < offs[-1] = 3


@pytest.mark.parametrize("counts,tail,L,F", CASES)
def test_small_ffn_matches_references(counts, tail, L, F):
    torch.manual_seed(len(counts) * 100 + tail)
    E, R = len(counts), sum(counts) + tail
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    x = torch.randn(R, L, device=DEV)
    w1, w3, w2 = weights(E, F, L, seed=R)
    y = grouped_ffn_small(x, offs, w1, w3, w2)
    assert y.shape == (R, L) and y.dtype == x.dtype
    truth = per_row_fp64(x, counts, w1, w3, w2)
    assert rel(y, truth) < 1e-5
    assert rel(grouped_ffn_reference(x, offs, w1, w3, w2), truth) < 1e-5
    with torch.no_grad():  # the grouped_mm path, as training runs it
        g = grouped_mm(x, w1.transpose(1, 2), offs)
        u = grouped_mm(x, w3.transpose(1, 2), offs)
        ref = grouped_mm(situ_glu_reference(g, u), w2.transpose(1, 2), offs)
    assert rel(y[: R - tail], ref[: R - tail]) < 1e-5
    assert torch.equal(y[R - tail:], torch.zeros(tail, L, device=DEV))  # rows of no expert: written, as zeros


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(-g) → inf, as intended
def test_small_ffn_saturating_situ_is_bounded():
    """Inputs large enough that both tanh factors round to 1: h stays strictly inside ±β1·β2 (the reference's clamp),
    no inf/NaN from exp overflow in σ or tanh."""
    torch.manual_seed(3)
    counts, L, F = [4, 0, 5], 32, 48
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    x = torch.randn(9, L, device=DEV) * 1e3
    w1, w3, w2 = weights(3, F, L, scale=1.0, seed=7)
    y = grouped_ffn_small(x, offs, w1, w3, w2)
    ref = grouped_ffn_reference(x, offs, w1, w3, w2)
    assert rel(y, ref) < 1e-5
    h = situ_glu_reference(x[:4] @ w1[0].t(), x[:4] @ w3[0].t())
    assert (h.abs() == torch.nextafter(torch.tensor(100.0), torch.tensor(0.0))).any()  # the bound is reached


def test_grouped_ffn_dispatch(monkeypatch):
    """Inference calls with ≤ SMALL_ROWS rows on the Triton backend take the fused kernels; calls that record a
    gradient, larger calls and the torch backend keep grouped_mm + SiTU-GLU; all give the same values."""
    calls = []
    real = experts_small_triton.grouped_ffn_small
    monkeypatch.setattr(experts_small_triton, "grouped_ffn_small", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("K3_MOE_BACKEND", "triton")
    counts, L, F = [2, 0, 3], 32, 32
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    x = torch.randn(5, L, device=DEV)
    w1, w3, w2 = (w.requires_grad_(True) for w in weights(3, F, L))
    with torch.no_grad():
        y_small = grouped_ffn(x, offs, w1, w3, w2)
    assert len(calls) == 1
    y_grad = grouped_ffn(x, offs, w1, w3, w2)  # a training call: autograd through grouped_mm
    y_grad.sum().backward()
    assert len(calls) == 1 and w1.grad is not None
    monkeypatch.setattr(grouped, "SMALL_ROWS", 4)
    with torch.no_grad():
        y_big = grouped_ffn(x, offs, w1, w3, w2)
    monkeypatch.setenv("K3_MOE_BACKEND", "torch")
    monkeypatch.setattr(grouped, "SMALL_ROWS", SMALL_ROWS)
    with torch.no_grad():
        y_torch = grouped_ffn(x, offs, w1, w3, w2)
    assert len(calls) == 1
    assert rel(y_small, y_grad.detach()) < 1e-5 and rel(y_big, y_grad.detach()) < 1e-5
    assert rel(y_torch, y_grad.detach()) < 1e-5


def test_small_ffn_input_checks():
    L, F = 16, 16
    offs = torch.tensor([1, 3], dtype=torch.int32, device=DEV)
    x = torch.randn(3, L, device=DEV)
    w1, w3, w2 = weights(2, F, L)
    with pytest.raises(ValueError, match="forward-only"):
        grouped_ffn_small(x.requires_grad_(True), offs, w1, w3, w2)
    x = x.detach()
    with pytest.raises(ValueError, match="offs"):
        grouped_ffn_small(x, offs.long(), w1, w3, w2)
    with pytest.raises(ValueError, match="non-decreasing"):  # checked where offs is on the host (no device sync)
        grouped_ffn_small(x.cpu(), torch.tensor([2, 1], dtype=torch.int32), *(w.cpu() for w in (w1, w3, w2)))
    with pytest.raises(ValueError, match="w2"):
        grouped_ffn_small(x, offs, w1, w3, w2.transpose(1, 2)[:, :, :8])
    with pytest.raises(ValueError, match="dtype"):
        grouped_ffn_small(x, offs, w1, w3, w2.double())
    with pytest.raises(ValueError, match="beta1"):
        grouped_ffn_small(x, offs, w1, w3, w2, beta1=0.0)
    assert grouped_ffn_small(x[:0], torch.zeros(2, dtype=torch.int32, device=DEV), w1, w3, w2).shape == (0, L)


def test_latent_moe_inference_through_the_small_path(monkeypatch):
    """The whole layer in inference (no grad) on the Triton backend, its experts through the fused kernels, against
    the same layer with the experts on grouped_mm (SMALL_ROWS = 0: same routing kernels, only the experts differ)."""
    calls = []
    real = experts_small_triton.grouped_ffn_small
    monkeypatch.setattr(experts_small_triton, "grouped_ffn_small", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("K3_MOE_BACKEND", "triton")
    torch.manual_seed(5)
    cfg = K3Config.from_preset("tiny")
    layer = LatentMoE(cfg, 1).to(DEV).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(3, cfg.hidden_size, device=DEV)
    with torch.no_grad():
        y = layer(x)
        monkeypatch.setattr(grouped, "SMALL_ROWS", 0)
        ref = layer(x)
    assert len(calls) == 1
    assert rel(y, ref) < 1e-5


# ---------------------------------------------------------------------------------------------- GPU, bf16
def _routing(m: int, k: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(m, E, device="cuda", generator=g).topk(k, dim=-1).indices


@gpu
@pytest.mark.parametrize("m,k,E,L,F", [(1, 8, 128, 512, 512), (64, 8, 128, 512, 512), (3, 16, 896, 256, 128),
                                       (128, 8, 128, 512, 512)])
def test_gpu_bf16_small_ffn(m, k, E, L, F):
    torch.manual_seed(0)
    idx = _routing(m, k, E, seed=m)
    idx[-1] = idx[0]  # an expert with several rows
    _, _, offs = expert_rows(idx, E)
    x = torch.randn(m * k, L, device="cuda").to(torch.bfloat16)
    w1, w3, w2 = weights(E, F, L, scale=L ** -0.5 * 2, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        y = grouped_ffn_small(x, offs, w1, w3, w2)
        ref = grouped_ffn_reference(x, offs, w1, w3, w2)
        g = grouped_mm(x, w1.transpose(1, 2), offs)
        u = grouped_mm(x, w3.transpose(1, 2), offs)
        gmm = grouped_mm(situ_glu_reference(g, u), w2.transpose(1, 2), offs)
    assert rel(y, ref) < 1e-2 and rel(y, gmm) < 2e-2


@gpu
def test_gpu_layer_cuda_graph_replays_new_routing(monkeypatch):
    """The layer's inference forward captured in a CUDA graph (as the decode runner does) and replayed on new inputs,
    hence new routing: equal to the eager forward bitwise, close to the same layer with its experts on grouped_mm."""
    calls = []
    real = experts_small_triton.grouped_ffn_small
    monkeypatch.setattr(experts_small_triton, "grouped_ffn_small", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    cfg = K3Config.from_preset("small")
    torch.set_default_dtype(torch.bfloat16)  # bf16 parameters; the fp32 buffers (QB bias) keep their dtype
    try:
        with torch.device("cuda"):
            layer = LatentMoE(cfg, 1).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
        layer.gate.e_score_correction_bias.normal_(0.0, 0.01)
    b = 4
    x_static = torch.randn(b, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # compiles and autotunes outside the capture
                layer(x_static)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = layer(x_static)
        assert calls, "the captured forward did not take the small-row expert path"
        seen = set()
        for seed in range(3):
            x = torch.randn(b, cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            x = x.to(torch.bfloat16)
            seen.add(tuple(layer.gate(x)[0].flatten().tolist()))
            x_static.copy_(x)
            graph.replay()
            eager = layer(x)
            assert torch.equal(y_static, eager), f"graph vs eager rel {rel(y_static, eager):.2e}"
            monkeypatch.setattr(grouped, "SMALL_ROWS", 0)  # the experts on grouped_mm, same routing
            ref = layer(x)
            monkeypatch.setattr(grouped, "SMALL_ROWS", SMALL_ROWS)
            assert rel(y_static, ref) < 2e-2
        assert len(seen) == 3  # each replay routed differently


def test_op_registration_passes_opcheck():
    """``k3::grouped_ffn_small`` as torch.compile sees it: schema, fake tensor and the real kernel agree."""
    L, F = 16, 32
    offs = torch.tensor([2, 2, 5], dtype=torch.int32, device=DEV)
    x = torch.randn(6, L, device=DEV)
    w1, w3, w2 = weights(3, F, L)
    torch.library.opcheck(torch.ops.k3.grouped_ffn_small.default, (x, offs, w1, w3, w2, 4.0, 25.0, 99.0),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
