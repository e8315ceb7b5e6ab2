"""Device sampling: Philox known answers, the Triton Gumbel-argmax kernel against its torch reference (interpreter),
the sampled distribution, top-k/top-p per row, per-request reproducibility whatever the batch, parameter checks."""

import pytest
import torch

from k3.infer.sampling import SamplingParams, sample_tokens, sampling_mode
from k3.ops.sampling.gumbel import gumbel_argmax_reference, philox4x32, philox_uniform


def _rows(*cols):
    return tuple(torch.tensor([c]) for c in cols)


@pytest.mark.parametrize("ctr,key,want", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(ctr, key, want):
    """Random123's Philox4x32-10 test vectors."""
    assert tuple(int(w) for w in philox4x32(_rows(*ctr), _rows(*key))) == want


def test_uniforms_open_interval_and_independent_streams():
    u = philox_uniform(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1]), 4096)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])  # seed and step both change the stream


@pytest.mark.parametrize("V", [7, 1024, 2500])
def test_triton_kernel_matches_reference(V):
    """On CUDA tensors with a GPU, else in the interpreter."""
    from k3.ops.sampling.gumbel_triton import gumbel_argmax_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(V)
    x = (torch.randn(6, V, generator=g) * 3).to(dev)
    x[1, : V // 2] = float("-inf")  # excluded columns
    x[2, 1:] = float("-inf")  # one candidate
    seeds = torch.tensor([0, 1, 2**62 + 5, 7, 7, 123456789], device=dev)
    steps = torch.tensor([0, 3, 9, 0, 1, 2**31 - 1], device=dev)
    got = gumbel_argmax_triton(x, seeds, steps)
    assert got.tolist() == gumbel_argmax_reference(x, seeds, steps).tolist()
    assert int(got[2]) == 0 and int(got[1]) >= V // 2


def _batch(n, **kw):
    one = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    return (one(kw.get("t", 1.0), torch.float32), one(kw.get("k", 0), torch.int64),
            one(kw.get("p", 1.0), torch.float32),
            one(kw.get("seed", 0), torch.int64), torch.arange(n))


def test_sampled_distribution_is_the_softmax():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    n = 6000
    t, k, p, seed, steps = _batch(n, seed=11)
    draws = sample_tokens(logits.expand(n, 5), t, k, p, seed, steps, "sample")
    freq = torch.bincount(draws, minlength=5).float() / n
    assert torch.allclose(freq, torch.softmax(logits, -1), atol=0.025)
    t2 = torch.full((n,), 2.0)
    freq2 = torch.bincount(sample_tokens(logits.expand(n, 5), t2, k, p, seed, steps, "sample"), minlength=5) / n
    assert torch.allclose(freq2.float(), torch.softmax(logits / 2, -1), atol=0.025)


def test_filters_and_greedy_rows():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).expand(400, 5)
    t, k, p, seed, steps = _batch(400)
    assert sample_tokens(logits, t, k, p, seed, steps, "greedy").eq(1).all()
    assert sample_tokens(logits, torch.zeros(400), k, p, seed, steps, "filtered").eq(1).all()  # temperature 0
    assert sample_tokens(logits, t, torch.ones_like(k), p, seed, steps, "filtered").eq(1).all()  # top-k 1
    assert sample_tokens(logits, t, k, torch.full((400,), 0.01), seed, steps, "filtered").eq(1).all()  # tiny top-p
    assert set(sample_tokens(logits, t, torch.full_like(k, 2), p, seed, steps, "filtered").tolist()) == {1, 2}
    # top-p 0.6: softmax mass of token 1 is ~0.45, tokens 1+2 ~0.86 → {1, 2} only
    assert set(sample_tokens(logits, t, k, torch.full((400,), 0.6), seed, steps, "filtered").tolist()) == {1, 2}
    # one batch, every row its own rule
    mixed = sample_tokens(logits[:3], torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 1, 0]),
                          torch.tensor([1.0, 1.0, 0.01]), seed[:3], steps[:3], "filtered")
    assert mixed.tolist() == [1, 1, 1]


def test_same_seed_same_tokens_whatever_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 300, generator=g)
    t, k, p = torch.full((8,), 0.9), torch.tensor([0, 5, 0, 40, 0, 0, 3, 0]), torch.full((8,), 0.95)
    seed, steps = torch.arange(100, 108), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    batch = sample_tokens(logits, t, k, p, seed, steps, "filtered")
    alone = [int(sample_tokens(logits[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1], seed[i:i + 1], steps[i:i + 1],
                               "filtered")) for i in range(8)]
    assert batch.tolist() == alone
    perm = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    shuffled = sample_tokens(logits[perm], t[perm], k[perm], p[perm], seed[perm], steps[perm], "filtered")
    assert shuffled.tolist() == batch[perm].tolist()


def test_sampling_params_checks_and_modes():
    for kw, name in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                     ({"temperature": float("nan")}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0}, "top_p"),
                     ({"top_p": 1.5}, "top_p"), ({"seed": "x"}, "seed"), ({"stop": "ab"}, "stop"),
                     ({"stop": ("",)}, "stop"), ({"stop_token_ids": (-1,)}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)
    greedy, hot, topk = SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=5)
    assert sampling_mode([greedy]) == "greedy" and sampling_mode([greedy, hot]) == "sample"
    assert sampling_mode([hot, topk]) == "filtered"
    assert sampling_mode([SamplingParams(temperature=0, top_k=3)]) == "greedy"
    with pytest.raises(ValueError, match="mode"):
        sample_tokens(torch.zeros(1, 3), *_batch(1), "nucleus")


def test_gumbel_op_is_registered():
    """``k3::gumbel_argmax``: schema, fake tensor and tracing checks of torch.library (interpreter on CPU)."""
    from k3.ops.sampling.gumbel_triton import gumbel_argmax_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 50, device=dev)
    seeds, steps = torch.tensor([1, 2, 3], device=dev), torch.tensor([0, 5, 9], device=dev)
    torch.library.opcheck(gumbel_argmax_triton, (x, seeds, steps))
