"""Context-parallel KDA with real gloo process groups (3 ranks) against one process: outputs and every
gradient, varlen streams whose sequences cross rank boundaries, the conv halo, and the ValueError cases."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

H, K, V, KS = 2, 8, 6, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape and torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def _inputs(T: int, seed: int, fused: bool, H: int = H) -> list[torch.Tensor]:
    """Global inputs; mild gates and small β so states carry across ranks."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(1, T, H, K), r(1, T, H, K), r(1, T, H, V)
    if fused:  # raw gate pre-activations, β logits, A_log, dt_bias
        return [q, k, v, r(1, T, H, K), r(1, T, H) - 2.0, torch.full((H,), -3.0) + 0.1 * r(H), -5.0 + r(H * K)]
    k = F.normalize(k, dim=-1)
    return [q, k, v, -0.03 * torch.rand(1, T, H, K, generator=gen), 0.3 * torch.rand(1, T, H, generator=gen)]


def _run(xs, cu, fused, cp_context=None):
    from k3.ops.kda import chunk_kda

    kw = dict(cu_seqlens=cu, cp_context=cp_context, safe_gate=True)  # precomputed g ≥ −0.03: within the bound −5
    if fused:
        kw.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  safe_gate=True, lower_bound=-5.0, A_log=xs[5], dt_bias=xs[6])
    return chunk_kda(*xs[:5], **kw)[0]


def _check_fla_metadata(ctx, cu: torch.Tensor, W: int) -> None:
    """fla's FLACPContext fields under their names, by fla's formulas (searchsorted over the global lengths)."""
    L = int(cu[-1]) // W
    start, end = ctx.rank * L, (ctx.rank + 1) * L
    first = int(cu[torch.searchsorted(cu[1:], start, right=True)])  # start of the sequence holding token `start`
    last = int(cu[torch.searchsorted(cu[:-1], end)])  # end of the sequence holding token end − 1
    assert ctx.pre_num_conv_tokens == start - first
    assert ctx.pre_num_ranks == ctx.rank - first // L and ctx.is_first_rank == (first // L == ctx.rank)
    assert ctx.post_num_ranks == (last - 1) // L - ctx.rank and ctx.is_last_rank == ((last - 1) // L == ctx.rank)
    assert ctx.is_first_rank != ctx.first_continues and ctx.is_last_rank != ctx.last_continues


def _check_scenario(ctx_rank, W, T, cu_list, fused, seed, halves_min_chunks=None, H=H):
    """This rank's CP slice against one process (the torch backend in fp64): output and all gradients
    (``halves_min_chunks``: the context's threshold for the Triton training step's halves; ``H`` heads)."""
    from k3.ops.kda import build_cp_context, chunk_kda

    backend = os.environ["K3_KDA_BACKEND"]
    tol = 1e-5 if backend == "torch" else 1e-4  # the Triton path's fp32 sums: dA_log, ddt_bias cancel over T·H·K
    cu = torch.tensor(cu_list)
    xs = _inputs(T, seed, fused, H)
    x64 = [x.double().requires_grad_() for x in xs]
    os.environ["K3_KDA_BACKEND"] = "torch"
    o_ref = _run(x64, cu, fused)
    os.environ["K3_KDA_BACKEND"] = backend
    do = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    ref_grads = torch.autograd.grad((o_ref * do).sum(), x64)

    ctx = build_cp_context(cu, group=None)
    if halves_min_chunks is not None:
        ctx.halves_min_chunks = halves_min_chunks
    _check_fla_metadata(ctx, cu, W)
    loc = [ctx.shard(x).requires_grad_() if x.dim() >= 3 else x.clone().requires_grad_() for x in xs]
    o = _run(loc, None, fused, cp_context=ctx)
    assert ctx.last_bytes_sent == H * K * (K + V) * 4 + 16
    assert rel(o, ctx.shard(o_ref)) <= tol, f"rank {ctx_rank} output"
    grads = torch.autograd.grad((o * ctx.shard(do).float()).sum(), loc)
    if backend == "triton":  # the Triton training backward gathers the entry-state gradients
        assert ctx.last_bwd_bytes_sent == H * K * V * 4
    for i, (g, gr) in enumerate(zip(grads, ref_grads)):
        if gr.dim() < 3:  # parameters: the sum over ranks is the full gradient
            g = g.clone()
            dist.all_reduce(g)
        else:
            gr = ctx.shard(gr)
        assert rel(g, gr) <= tol, f"rank {ctx_rank} grad #{i}: {rel(g, gr)}"
    if ctx.first_continues and not fused and backend == "torch":  # the test can fail: no entry state, wrong output
        o0 = chunk_kda(*[x.detach() for x in loc[:5]], cu_seqlens=ctx.local_cu_seqlens)[0]
        assert rel(o0, ctx.shard(o_ref)) > 1e-3
    return ctx


def _check_halo(W, T, cu_list):
    from k3.ops.kda import build_cp_context, cp_conv_halo

    cu = torch.tensor(cu_list)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, T, 3, generator=gen).requires_grad_()
    w = torch.randn(KS, 3, generator=gen)
    seq_start = torch.zeros(T, dtype=torch.long)
    for a, b in zip(cu_list[:-1], cu_list[1:]):
        seq_start[a:b] = a

    def conv(xx, p0, off, cut):
        """Causal depthwise conv for global positions p0 … from rows xx[p - off], resetting at sequence starts;
        rows below ``cut`` (a halo) are used as given for the sequence that crosses ``cut`` (their zeros stand for
        other sequences); the local pieces after it reset as usual."""
        ys = []
        for p in range(p0, off + xx.shape[1]):
            terms = [w[i] * xx[0, p - i - off] for i in range(KS)
                     if p - i >= seq_start[p] or (off <= p - i < cut and seq_start[p] < cut)]
            ys.append(sum(terms) if terms else torch.zeros(3))
        return torch.stack(ys)[None]

    ref = conv(x, 0, 0, 0)  # the plain varlen causal conv over the whole stream
    ctx = build_cp_context(cu, conv1d_kernel_size=KS)
    xl = ctx.shard(x.detach()).requires_grad_()
    halo = cp_conv_halo(xl, ctx)
    assert halo.shape == (1, KS - 1, 3) and ctx.last_halo_bytes == (KS - 1) * 3 * 4
    want = torch.stack([x[0, p] if p >= max(0, ctx.first_seq_start) else torch.zeros(3)
                        for p in range(ctx.start - KS + 1, ctx.start)])
    assert torch.equal(halo[0].detach(), want.detach())
    y = conv(torch.cat([halo, xl], 1), ctx.start, ctx.start - KS + 1, ctx.start)
    assert rel(y, ctx.shard(ref)) < 1e-6
    r = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6))
    (gx_ref,) = torch.autograd.grad((ref * r).sum(), x)
    (gx,) = torch.autograd.grad((y * ctx.shard(r)).sum(), xl)
    assert rel(gx, ctx.shard(gx_ref)) < 1e-6


def _check_errors(rank, W):
    from k3.ops.kda import build_cp_context, chunk_kda

    T = 12 * W
    xs = _inputs(T, 0, False)
    cu = torch.tensor([0, 5, T])
    with pytest.raises(ValueError, match="multiple of the group size"):
        build_cp_context(torch.tensor([0, 5, T + 1]))
    ctx = build_cp_context(cu)
    loc = [ctx.shard(x) for x in xs]
    with pytest.raises(ValueError, match="cu_seqlens"):  # a context built for other cu_seqlens than the call's
        chunk_kda(*loc, cu_seqlens=torch.tensor([0, 6, T]), cp_context=ctx)
    o_glob, _ = chunk_kda(*loc, cu_seqlens=cu, cp_context=ctx)  # the global cu_seqlens themselves are accepted
    # ... and so are this rank's local ones (what fla's context holds as its cu_seqlens); the result is the same
    o_loc, _ = chunk_kda(*loc, cu_seqlens=ctx.local_cu_seqlens.int(), cp_context=ctx)
    assert torch.equal(o_loc, o_glob)
    # fla's other arguments: the host copy of cu_seqlens, the legacy precision flag, the layout
    ctx_cpu = build_cp_context(cu, cu_seqlens_cpu=cu.clone(), use_tf32x3_affine_chain=True, layout="contiguous")
    assert torch.equal(chunk_kda(*loc, cp_context=ctx_cpu)[0], o_glob)
    with pytest.raises(ValueError, match="layout"):
        build_cp_context(cu, layout="zigzag")
    with pytest.raises(ValueError, match="use_tf32x3_affine_chain"):
        build_cp_context(cu, use_tf32x3_affine_chain=False)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        build_cp_context(cu, cu_seqlens_cpu=cu[:-1])
    bad = [x[:, :-1] for x in loc] if rank == 0 else loc  # one rank with a wrong slice: every rank raises
    with pytest.raises(ValueError, match="slice|reported bad input"):
        chunk_kda(*bad, cp_context=ctx)
    other = build_cp_context(torch.tensor([0, 7, T]) if rank == 1 else cu)  # ranks built for different streams
    with pytest.raises(ValueError, match="different cu_seqlens"):
        chunk_kda(*loc, cp_context=other)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(*loc, cp_context=ctx, output_final_state=True)
    solo = dist.new_group([0])  # a group of the wrong size for these slices
    if rank == 0:
        with pytest.raises(ValueError, match="slice"):
            chunk_kda(*loc, cp_context=build_cp_context(cu, group=solo))
    else:
        with pytest.raises(ValueError, match="member"):
            build_cp_context(cu, group=solo)
    # an error on ONE rank only: every rank raises instead of waiting in the all_gather
    h0 = torch.zeros(len(ctx.local_cu_seqlens) - 1, H, K, V)
    with pytest.raises(ValueError, match="initial_state" if rank == 0 else "rank\\(s\\) \\[0\\] reported bad input"):
        chunk_kda(*loc, cp_context=ctx, initial_state=h0 if rank == 0 else None)
    beta = loc[4][..., None] if rank == 1 else loc[4]  # fails chunk_kda's argument checks on rank 1 only
    with pytest.raises(ValueError, match="beta" if rank == 1 else "rank\\(s\\) \\[1\\] reported bad input"):
        chunk_kda(*loc[:4], beta, cp_context=ctx)
    grad = [x.clone().requires_grad_(rank == 0) for x in loc]  # rank 1 would never join the backward
    with pytest.raises(ValueError, match="need grad on rank\\(s\\) \\[0\\]"):
        chunk_kda(*grad, cp_context=ctx)
    o, _ = chunk_kda(*loc, cp_context=ctx)  # the group is still usable after all of that
    assert o.shape == (1, 12, H, V)


def _check_halves(rank: int, W: int) -> None:
    """Slices of 2 chunks run their serial passes as two halves (Triton training path): same checks, and the
    halves must really be taken (the first rank: its piece goes on; the middle: both; the last: it came in)."""
    L = 80  # two chunks per rank: the smallest slice with halves
    ctx = _check_scenario(rank, W, W * L, [0, W * L], True, seed=30, halves_min_chunks=2, H=1)
    assert ctx.last_halves, f"rank {rank}: no halves"


def _worker(rank: int, W: int, port: int, backends: tuple[str, ...]) -> None:
    # "triton" runs the Triton kernels in the CPU interpreter (TRITON_INTERPRET=1 from the conftest is inherited):
    # its training path is a different algorithm (parallel backward from gathered entry-state gradients)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=60))
    try:
        L = 40
        T = W * L
        scenarios = [
            ([0, 5, T - 5, T], False),             # a sequence covering whole middle ranks (needs M)
            ([0, 3, L + 20, L + 20, T], True),     # an empty sequence, a crossing one; in-kernel norm, gate, β
            ([0, T], False),                       # one sequence across every rank
            ([0, T], True),
            ([0, L - 1, L, L + 1, T], False),      # boundaries at and next to a rank edge, a length-1 sequence
        ]
        for backend in backends:
            os.environ["K3_KDA_BACKEND"] = backend
            # the interpreter is slow: the cases whose kernel paths differ (one-piece slices: in _check_halves), one
            # head (the GPU test has two)
            for i, (cu, fused) in enumerate(scenarios[:2] if backend == "triton" else scenarios):
                _check_scenario(rank, W, T, cu, fused, seed=10 + i, H=1 if backend == "triton" else H)
            if backend == "triton":
                _check_halves(rank, W)
        os.environ["K3_KDA_BACKEND"] = "torch"
        _check_halo(W, W * 6, [0, 4, 13, W * 6])
        _check_halo(W, W * 2, [0, W * 2])  # slices shorter than the halo: rows come from several ranks
        _check_errors(rank, W)
    finally:
        dist.destroy_process_group()


def test_cp_matches_single_process():
    """3 ranks (a first, a middle and a last): the torch path, and the Triton training path (its parallel backward,
    the halves of a one-piece slice) in the interpreter when there is no GPU (on a GPU: ``test_cp_gpu_head_dims``);
    the conv halo; the bad-input errors raised on every rank."""
    backends = ("torch", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("torch",)
    mp.spawn(_worker, args=(3, _free_port(), backends), nprocs=3, join=True)


# ---- GPU: the CP kernels (span summaries, fold, entry-state pass, the training path's gathered backward) on CUDA
# tensors at head dims other than K = V = 128, 2 ranks sharing one GPU over gloo (NCCL refuses two ranks on one
# device; the 2-GPU NCCL runs are in bench/kda_cp_multi_gpu.py)

GPU_DIMS = [(16, 128), (32, 128), (128, 16), (100, 72), (64, 64), (128, 128)]


def _gpu_case(T: int, K_: int, V_: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """The K3 call's inputs (raw gate, β logits, A_log, dt_bias) on the GPU; mild gates so states cross ranks."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    xs = [r(1, T, H, K_), r(1, T, H, K_), r(1, T, H, V_), r(1, T, H, K_), r(1, T, H) - 1.0]
    return [x.to("cuda", dtype) for x in xs] + [torch.zeros(H, device="cuda"), torch.full((H * K_,), -5.0,
                                                                                            device="cuda")]


def _gpu_worker(rank: int, W: int, port: int) -> None:
    from k3.ops.kda import build_cp_context

    os.environ.pop("K3_KDA_BACKEND", None)  # CUDA tensors: the Triton kernels
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=300))
    try:
        L = 200  # odd chunk counts per rank; a sequence crossing the rank edge and one inside rank 1
        T = W * L
        cu = torch.tensor([0, 37, L + 50, T])
        for i, (K_, V_) in enumerate(GPU_DIMS):
            for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
                xs = [x.requires_grad_() for x in _gpu_case(T, K_, V_, dtype, seed=40 + i)]
                o_ref = _run(xs, cu.cuda(), True)
                do = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(i)).to(o_ref)
                ref_grads = torch.autograd.grad((o_ref.float() * do.float()).sum(), xs)
                ctx = build_cp_context(cu.cuda(), group=None)
                loc = [ctx.shard(x.detach()).requires_grad_() if x.dim() >= 3 else x.detach().clone().requires_grad_()
                       for x in xs]
                o = _run(loc, None, True, cp_context=ctx)
                where = f"rank {rank} K={K_} V={V_} {dtype}"
                assert ctx.last_bytes_sent == H * K_ * (K_ + V_) * 4 + 16, where
                assert torch.isfinite(o).all() and rel(o.float(), ctx.shard(o_ref).float()) <= tol, where
                grads = torch.autograd.grad((o.float() * ctx.shard(do).float()).sum(), loc)
                for j, (g, gr) in enumerate(zip(grads, ref_grads)):
                    if gr.dim() >= 3:
                        assert rel(g.float(), ctx.shard(gr).float()) <= tol, f"{where} grad #{j}"
                    else:  # parameters: the sum over ranks is the full gradient
                        g = g.clone()
                        dist.all_reduce(g)
                        assert rel(g, gr) <= max(tol, 1e-3), f"{where} param grad #{j}: {rel(g, gr)}"
                with torch.no_grad():  # the inference path (no backward state kept)
                    o_inf = _run([x.detach() for x in loc], None, True, cp_context=ctx)
                assert rel(o_inf.float(), o.detach().float()) <= tol, where
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cp_gpu_head_dims():
    """GPU, 2 ranks on one device over gloo: context parallel at K×V = 16×128, 32×128, 128×16, 100×72, 64×64 and
    128×128, fp32 and bf16, the K3 activations in the kernels, a varlen stream crossing the rank edge: output and
    every gradient against one process (fp32 1e-4, bf16 2e-2), the inference path equal to the training one, the
    bytes per layer (the Triton compiles of the 12 shape × dtype cases take most of its minutes)."""
    mp.spawn(_gpu_worker, args=(2, _free_port()), nprocs=2, join=True)
