"""Gated MLA (NoPE) against a naive per-head attention loop; latent cache decode; cache growth."""

import pytest
import torch

from k3.config import K3Config
from k3.layers.mla import GatedMLA


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def make_layer(seed: int = 0) -> GatedMLA:
    torch.manual_seed(seed)
    c = K3Config.from_preset("tiny", hidden_size=24, mla_num_heads=3, q_lora_rank=12, kv_lora_rank=10,
                             qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
    layer = GatedMLA(c)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0.0, 0.4) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return layer


def naive_mla(P: dict, x: torch.Tensor, H: int, n: int, r: int, vd: int, lora: int, eps: float) -> torch.Tensor:
    """Per head, per query: explicit scores over the visible keys, fp64 softmax; the 'rope' dims unrotated."""
    def rms(t, w):
        return t / (t.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w

    B, T, _ = x.shape
    q = rms(x @ P["q_a_proj.weight"].t(), P["q_a_layernorm.weight"]) @ P["q_b_proj.weight"].t()
    q = q.view(B, T, H, n + r)
    ckv_kpe = x @ P["kv_a_proj_with_mqa.weight"].t()
    c_kv, k_pe = ckv_kpe[..., :lora], ckv_kpe[..., lora:]
    kv = (rms(c_kv, P["kv_a_layernorm.weight"]) @ P["kv_b_proj.weight"].t()).view(B, T, H, n + vd)
    gate = torch.sigmoid(x @ P["g_proj.weight"].t()).view(B, T, H, vd)
    out = torch.zeros(B, T, H, vd, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys = torch.cat([kv[b, : i + 1, h, :n], k_pe[b, : i + 1]], -1)  # [i+1, n+r]
                s = keys @ q[b, i, h] / (n + r) ** 0.5
                out[b, i, h] = torch.softmax(s, 0) @ kv[b, : i + 1, h, n:]
    return (out * gate).reshape(B, T, H * vd) @ P["o_proj.weight"].t()


def run_naive(layer: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    P = {k: v.double() for k, v in layer.named_parameters()}
    return naive_mla(P, x.double(), layer.num_heads, layer.nope, layer.rope, layer.v_dim, layer.kv_lora_rank,
                     layer.q_a_layernorm.eps)


@pytest.mark.parametrize("T", [1, 2, 17, 64])
def test_mla_matches_naive_attention(T: int) -> None:
    layer = make_layer(T)
    x = torch.randn(2, T, 24)
    assert rel(layer(x), run_naive(layer, x)) < 1e-5


def test_mla_gradients_match_naive() -> None:
    layer = make_layer(1)
    x = torch.randn(2, 13, 24, requires_grad=True)
    y = layer(x)
    gy = torch.randn_like(y)
    names = [n for n, _ in layer.named_parameters()]
    got = torch.autograd.grad(y, [x, *layer.parameters()], gy)
    P = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    xd = x.detach().double().requires_grad_()
    ref = naive_mla(P, xd, layer.num_heads, layer.nope, layer.rope, layer.v_dim, layer.kv_lora_rank,
                    layer.q_a_layernorm.eps)
    want = torch.autograd.grad(ref, [xd, *P.values()], gy.double())
    for name, a, b in zip(["x", *names], got, want):
        assert rel(a, b) < 1e-5, name


def test_mla_rope_dims_are_not_rotated_and_take_part() -> None:
    """Zeroing k_pe's projection rows changes the output (the dims are used) and the result is position-free:
    a sequence of identical tokens gives identical outputs at every position (no positional encoding)."""
    layer = make_layer(2)
    x = torch.randn(1, 1, 24).expand(1, 9, 24).contiguous()
    y = layer(x)
    assert rel(y, y[:, :1].expand_as(y)) < 1e-6
    x2 = torch.randn(1, 9, 24)
    y2 = layer(x2)
    with torch.no_grad():
        layer.kv_a_proj_with_mqa.weight[layer.kv_lora_rank:] = 0
    assert rel(layer(x2), y2) > 1e-3


@pytest.mark.parametrize("absorb_max_t", [16, 0])
def test_mla_cache_piecewise_and_token_by_token(absorb_max_t: int) -> None:
    """Pieces of ≤ 16 tokens against a cache run the absorbed path (kv_b_proj folded into q and o), longer ones the
    chunked-prefill path; absorb_max_t = 0 forces the latter everywhere. The caller advances ``start``."""
    layer = make_layer(3)
    layer.absorb_max_t = absorb_max_t
    x = torch.randn(2, 40, 24)
    with torch.no_grad():
        full = layer(x)
        cache = layer.init_state(2, dtype=x.dtype, capacity=40)
        pieces = []
        for a, b in [(0, 1), (1, 6), (6, 7), (7, 23), (23, 40)]:
            pieces.append(layer(x[:, a:b], cache))
            cache.advance(b - a)
        assert rel(torch.cat(pieces, 1), full) < 1e-5
        assert cache.length == 40 and cache.buf.shape == (2, 40, 10 + 4)
        c2 = layer.init_state(2, dtype=x.dtype, capacity=41)
        toks = []
        for t in range(40):
            toks.append(layer(x[:, t:t + 1], c2))
            c2.advance(1)
        assert rel(torch.cat(toks, 1), full) < 1e-5
        assert rel(c2.buf[:, :40], layer.latent(x)) < 1e-6 and (c2.buf[:, 40] == 0).all()


@pytest.mark.parametrize("T", [1, 3, 20])
def test_mla_cache_pool_slots_and_ragged_starts(T: int) -> None:
    """A batch of two sequences at different lengths in rows 3 and 1 of a 4-row pool: each continues exactly as
    its own one-call forward (absorbed for T ≤ 16, chunked prefill above); the other pool rows are untouched."""
    layer = make_layer(4)
    xs = [torch.randn(1, 5 + T, 24), torch.randn(1, 12 + T, 24)]
    with torch.no_grad():
        want = [layer(x)[:, -T:] for x in xs]
        cache = layer.init_state(4, dtype=torch.float32, capacity=40)
        for row, x in zip([3, 1], xs):  # prefill each sequence alone into its pool row
            cache.slots, cache.start = torch.tensor([row]), torch.zeros(1, dtype=torch.int32)
            layer(x[:, :-T], cache)
        before = cache.buf[[0, 2]].clone()
        cache.slots, cache.start = torch.tensor([3, 1]), torch.tensor([5, 12], dtype=torch.int32)
        got = layer(torch.cat([xs[0][:, -T:], xs[1][:, -T:]], 0), cache)
    assert rel(got[:1], want[0]) < 1e-5 and rel(got[1:], want[1]) < 1e-5
    assert torch.equal(cache.buf[[0, 2]], before)
    assert rel(cache.buf[3, : 5 + T], layer.latent(xs[0])[0]) < 1e-6
    assert rel(cache.buf[1, : 12 + T], layer.latent(xs[1])[0]) < 1e-6


def test_mla_cache_gradients_through_prefill_path() -> None:
    """With grad enabled a piece against the cache takes the differentiable chunked-prefill path: gradients
    equal the one-call forward's."""
    layer = make_layer(5)
    x = torch.randn(1, 11, 24, requires_grad=True)
    gy = torch.randn(1, 5, 24)
    want = torch.autograd.grad(layer(x)[:, 6:], [x, layer.kv_b_proj.weight], gy)
    cache = layer.init_state(1, dtype=torch.float32, capacity=16)
    with torch.no_grad():
        layer(x[:, :6], cache)
    cache.advance(6)
    y = layer(x[:, 6:], cache)
    got = torch.autograd.grad(y, [x, layer.kv_b_proj.weight], gy)
    assert rel(got[0][:, 6:], want[0][:, 6:]) < 1e-5  # the cached prefix was written without grad
    assert rel(got[1], want[1]) < 1e-5


def test_mla_cache_bad_input() -> None:
    layer = make_layer(6)
    with pytest.raises(ValueError, match="capacity"):
        layer.init_state(1, dtype=torch.float32, capacity=0)
    cache = layer.init_state(2, dtype=torch.float32, capacity=8)
    with torch.no_grad(), pytest.raises(ValueError, match="capacity"):
        layer(torch.randn(2, 9, 24), cache)
    cache.slots = torch.tensor([0, 5])
    with torch.no_grad(), pytest.raises(ValueError, match="slots"):
        layer(torch.randn(2, 1, 24), cache)
    cache.slots = torch.tensor([0])
    with torch.no_grad(), pytest.raises(ValueError, match="slots"):
        layer(torch.randn(2, 1, 24), cache)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def small_layer(seed: int = 0) -> GatedMLA:
    torch.manual_seed(seed)
    return GatedMLA(K3Config.from_preset("small")).to("cuda", torch.bfloat16)


@gpu
def test_mla_small_bf16_one_call_pieces_tokens_agree() -> None:
    """`small`'s dims on the GPU kernels: one call (flash), pieces (chunked prefill for the long ones, absorbed
    decode for the short ones) and one token at a time (absorbed) agree within bf16."""
    layer = small_layer()
    x = torch.randn(2, 300, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        full = layer(x)
        cache = layer.init_state(2, dtype=torch.bfloat16, device="cuda", capacity=300)
        out = []
        for a, b in [(0, 1), (1, 130), (130, 131), (131, 280)]:
            out.append(layer(x[:, a:b], cache))
            cache.advance(b - a)
        for t in range(280, 300):
            out.append(layer(x[:, t:t + 1], cache))
            cache.advance(1)
    assert rel(torch.cat(out, 1), full) < 2e-2


@gpu
def test_mla_training_forward_backward_compiles() -> None:
    """The training path (no state) under ``torch.compile(fullgraph=True)``: no graph breaks, same loss and grads.
    AOTAutograd traces forward and backward through the ops' fake and autograd registrations (what inductor
    consumes too) without inductor's code generation, which other tests pay for."""
    layer = small_layer(1)
    x = torch.randn(1, 300, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def loss(x):
        return layer(x).float().square().mean()

    want = torch.autograd.grad(loss(x), [x, layer.kv_b_proj.weight])
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(x),
                              [x, layer.kv_b_proj.weight])
    assert rel(got[0], want[0]) < 2e-2 and rel(got[1], want[1]) < 2e-2


def test_mla_decode_step_traces_without_graph_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step (cache write + absorbed attention as the ``k3::mla_decode`` op) under
    ``torch.compile(fullgraph=True)``: no graph break, no host sync; equal to eager."""
    monkeypatch.setenv("K3_MLA_BACKEND", "triton")  # the op path (Triton's interpreter on CPU)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = make_layer(7).to(dev)
    x, cached = torch.randn(2, 1, 24, device=dev), torch.randn(2, 8, 14, device=dev)
    outs = []
    for fn in (layer, torch.compile(layer, fullgraph=True, backend="eager")):
        cache = layer.init_state(2, dtype=torch.float32, device=dev, capacity=8)
        cache.buf.copy_(cached)
        cache.start = torch.tensor([3, 0], dtype=torch.int32, device=dev)
        with torch.no_grad():
            outs.append(fn(x, cache))
    assert rel(outs[1], outs[0]) < 1e-6
