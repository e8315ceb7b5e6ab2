import pytest
import torch

from k3.ops import attn_res


def _loop_reference(query, sources, gain, eps):
    """Per-token, per-source scalar loop in fp64."""
    D = query.shape[0]
    flat = [s.double().reshape(-1, D) for s in sources]
    w = query.double() * (gain.double() if gain is not None else 1.0)
    out = torch.empty_like(flat[0])
    for t in range(flat[0].shape[0]):
        logits = []
        for v in flat:
            rms = (v[t].pow(2).mean() + eps).sqrt()
            logits.append(float((w * v[t] / rms).sum()))
        m = max(logits)
        e = [pow(2.718281828459045, lg - m) for lg in logits]
        z = sum(e)
        out[t] = sum(ei / z * v[t] for ei, v in zip(e, flat))
    return out.reshape(sources[0].shape)


@pytest.mark.parametrize("n_src", [1, 2, 9])
def test_attn_res_matches_loop(n_src: int) -> None:
    torch.manual_seed(n_src)
    D = 24
    sources = [torch.randn(3, 5, D) * (i + 1) for i in range(n_src)]
    q, g = torch.randn(D), torch.rand(D) + 0.5
    out = attn_res(q, sources, g, eps=1e-5)
    ref = _loop_reference(q, sources, g, 1e-5)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-6
    stacked = attn_res(q, torch.stack(sources), g, eps=1e-5)
    assert torch.equal(stacked, out)


def test_zero_query_is_uniform_average_and_dtype_kept() -> None:
    sources = [torch.randn(4, 16, dtype=torch.bfloat16) for _ in range(3)]
    out = attn_res(torch.zeros(16), sources)
    assert out.dtype == torch.bfloat16
    ref = torch.stack([s.float() for s in sources]).mean(0)
    assert torch.allclose(out.float(), ref, atol=1e-2)


def test_attn_res_gradients_match_float64() -> None:
    torch.manual_seed(0)
    D = 8
    srcs = [torch.randn(6, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    q = torch.randn(D, dtype=torch.float64, requires_grad=True)
    g = torch.rand(D, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda q, g, *s: attn_res(q, list(s), g), (q, g, *srcs))


def test_attn_res_bad_input() -> None:
    with pytest.raises(ValueError, match="sources"):
        attn_res(torch.zeros(4), [])
    with pytest.raises(ValueError, match="sources\\[1\\]"):
        attn_res(torch.zeros(4), [torch.zeros(2, 4), torch.zeros(3, 4)])
    with pytest.raises(ValueError, match="query"):
        attn_res(torch.zeros(5), [torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="norm_weight"):
        attn_res(torch.zeros(4), [torch.zeros(2, 4)], norm_weight=torch.ones(3))
