"""The 16-token flow's state pass in Gluon: both 64-column V-blocks of a head as two chains in one warpgroup.

Why: the Triton state pass (``chunk16._c16_state``, mode 2) holds one V-block per program and issues each step's
products one after another, waiting on each: its step is a serial chain (Sᵀ → bf16 → wgmma → V' → bf16 → wgmma →
Sᵀ), latency-bound at ~0.4 instructions per cycle per scheduler, and beside the prep's programs it slows from 28 to
~40 ms per 1M tokens at H = 32. Here one program holds the two V-blocks of a head (two independent chains, the
K-side tiles −W, qw, kg, γ copied once for both) and runs them half a step apart: one chain's update of Sᵀ is in
flight while the other chain converts its state and runs its products.

The step, for each chain c (its V-block's columns of U and A_qk U), as in mode 2:
    [V'ᵀ | Oᵀ] = [Uᵀ | (A_qk U)ᵀ] + Sᵀ [−W; qw]ᵀ,  Sᵀ ← Sᵀ Diag(γ) + V'ᵀ kg
with [U; A_qk U]ᵀ entering the accumulator by an exact product with the identity (the tile is row-major in shared
memory; the tensor cores transpose it), every other operand of the chain in registers. The wait counts matter
beyond correctness: where a non-wgmma instruction might read an accumulator still in flight, ptxas serialises
every product of the kernel (its message C7514), which the CPU test checks for.

Gluon does not run in Triton's interpreter: CPU tests compile it to sm_90 code, GPU tests compare it with the
Triton state pass and the fp64 recurrence.
"""

from __future__ import annotations

import torch

from k3.ops.kda.triton.decode_gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )


class GluonStateConfig:
    """Knobs of the Gluon state pass (``k3.ops.kda.triton.state_gluon``).

    - ``enabled``: run the 16-token flow's state pass (mode 2, K = V = 128) with this kernel on CUDA.
    - ``stages``: depth of the shared-memory ring of step tiles (20.5 KiB each).
    - ``chains``: V-blocks per warpgroup (2: both of a head, interleaved in one warpgroup; 1: one).
    - ``warps``: 4 (one warpgroup per program, 64 value columns per chain) or 8 (two warpgroups, each the chain of
      one 64-column half: one program per head whose warpgroups' steps interleave on the schedulers; chains = 1).
    """

    enabled = False
    stages = 8
    chains = 2
    warps = 4


if HAVE_GLUON:

    @gluon.jit
    def _copy_tile(smem, base, R: gl.constexpr, C: gl.constexpr, stride, layout: gl.constexpr):
        """cp.async of the [R, C] tile at ``base`` (row stride ``stride`` elements) into ``smem``."""
        o_r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
        o_c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
        async_copy.async_copy_global_to_shared(smem, base + o_r[:, None] * stride + o_c[None, :])

    @gluon.jit
    def _issue_step(X, KG, GAM, U, b, slot, s_wq, s_kg, s_gam, s_u0, s_u1, v0,
                    BC: gl.constexpr, BK: gl.constexpr, BVP: gl.constexpr, BVC: gl.constexpr, LD: gl.constexpr,
                    LDU: gl.constexpr, LG: gl.constexpr, CHAINS: gl.constexpr):
        """Copies of block b's tiles into ring slot ``slot``: [−W; qw] [32, BK], kg [16, BK], γ [BK] (fp32), and
        the program's columns of [U; A_qk U] ([32, BVC] per chain, from value column v0)."""
        _copy_tile(s_wq.index(slot), X + b * (2 * BC * BK), 2 * BC, BK, BK, LD)
        _copy_tile(s_kg.index(slot), KG + b * (BC * BK), BC, BK, BK, LD)
        o_k = gl.arange(0, BK, layout=LG)
        async_copy.async_copy_global_to_shared(s_gam.index(slot), GAM + b * BK + o_k)
        pu = U + b * (2 * BC * BVP) + v0
        _copy_tile(s_u0.index(slot), pu, 2 * BC, BVC, BVP, LDU)
        if CHAINS == 2:
            _copy_tile(s_u1.index(slot), pu + BVC, 2 * BC, BVC, BVP, LDU)

    @gluon.jit
    def _chain_products(S, u, wq_t, gam, kg, s_eye, zero16, p_o, m_o, BC: gl.constexpr, A16: gl.constexpr,
                        AS: gl.constexpr, LS: gl.constexpr, LO: gl.constexpr, DT: gl.constexpr, CHAINS: gl.constexpr):
        """One chain's step. On entry at most this chain's update of the previous step is still in flight (plus the
        other chain's, issued after it); returns the accumulator of this step's update, in flight."""
        g = gam.load(gl.SliceLayout(0, LS))  # issued first: its latency under the conversion and the products
        S = warpgroup_mma_wait(CHAINS - 1, deps=[S])  # this chain's previous update (the other chain's may run on)
        a = gl.convert_layout(S.to(DT), A16)
        # [V'ᵀ | Oᵀ] = [Uᵀ | (A_qk U)ᵀ] + Sᵀ [−W; qw]ᵀ: [U; A_qk U]ᵀ enters the accumulator by the identity product
        acc = warpgroup_mma(u.permute((1, 0)), s_eye, zero16, use_acc=False, is_async=True)
        acc = warpgroup_mma(a, wq_t, acc, is_async=True)
        S = S * g[None, :]  # the decay, under the products
        acc = warpgroup_mma_wait(0, deps=[acc])  # (also the other chain's update)
        vn, ot = gl.split(gl.permute(gl.reshape(acc, [acc.shape[0], 2, BC]), (0, 2, 1)))
        S = warpgroup_mma(gl.convert_layout(vn.to(DT), AS), kg, S, is_async=True)
        gl.store(p_o, gl.convert_layout(ot, LO).to(p_o.dtype.element_ty), mask=m_o)
        return S

    @gluon.jit
    def _c16_state_gluon(
        X, KG, GAM, U, o, ht, cu, chunk_off, c0, c1, NCw, T, NT, H,
        K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BC: gl.constexpr, BK: gl.constexpr,
        BVP: gl.constexpr, IS_VARLEN: gl.constexpr, STAGES: gl.constexpr, CHAINS: gl.constexpr = 2,
        W: gl.constexpr = 4,
    ):
        """Grid (N·H,): sequence i_n, head i_h; the window of chunks [c0, c1). Same buffers and contract as
        ``_c16_state`` in mode 2 with [U; A_qk U] row-major (``u_rowmajor``) and the pointer loop."""
        BV: gl.constexpr = 16 * W  # value columns per chain: 64 rows of Sᵀ per warpgroup
        NPH: gl.constexpr = BVP // (BV * CHAINS)  # programs per head
        NB: gl.constexpr = BT // BC
        # layouts: Sᵀ [BV, BK] and the step's [BV, 16] products on wgmma (one warpgroup); their bf16 left operands
        # in registers; the step tiles in 128-byte-swizzled shared memory
        LS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BK, 16])
        L16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, 2 * BC, 16])
        A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L16, k_width=2)
        LO: gl.constexpr = gl.BlockedLayout([2, 2], [8, 4], [W, 1], [1, 0])  # Oᵀ [BV, 16] for its stores
        AS: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LS, k_width=2)
        # copies of 16-byte pieces: K-side tiles [·, 128] (16 threads per row), U tiles [32, BV]
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
        LDU: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BV // 8), BV // 8], [W, 1], [1, 0])
        LG: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        DT: gl.constexpr = KG.dtype.element_ty
        SH_K: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BC, BK], DT)
        SH_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BC, BV], DT)
        SH_I: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BC, 2 * BC], DT)
        SH_G: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

        # CHAINS = 1 (a measurement of the interleave): one V-block per program, two programs per head
        i_nh = gl.program_id(0) // NPH
        v0 = (gl.program_id(0) % NPH) * (BV * CHAINS)  # the program's first value column
        i_n = i_nh // H
        i_h = i_nh % H
        if IS_VARLEN:
            cs = gl.load(chunk_off + i_n)
            ce = gl.load(chunk_off + i_n + 1)
            bos = gl.load(cu + i_n).to(gl.int64)
            eos = gl.load(cu + i_n + 1).to(gl.int64)
        else:
            cs = i_n * NT
            ce = cs + NT
            bos = i_n.to(gl.int64) * T
            eos = bos + T
        lo = gl.maximum(cs, c0)
        hi = gl.minimum(ce, c1)
        if lo < hi:
            s_wq = gl.allocate_shared_memory(DT, [STAGES, 2 * BC, BK], SH_K)
            s_kg = gl.allocate_shared_memory(DT, [STAGES, BC, BK], SH_K)
            s_gam = gl.allocate_shared_memory(gl.float32, [STAGES, BK], SH_G)
            s_u0 = gl.allocate_shared_memory(DT, [STAGES, 2 * BC, BV], SH_V)
            s_u1 = gl.allocate_shared_memory(DT, [STAGES if CHAINS == 2 else 1, 2 * BC, BV], SH_V)
            # the identity that transposes Uᵀ and (A_qk U)ᵀ into the accumulators
            o_i = gl.arange(0, 2 * BC, layout=gl.SliceLayout(1, LD))
            o_j = gl.arange(0, 2 * BC, layout=gl.SliceLayout(0, LD))
            s_eye = gl.allocate_shared_memory(DT, [2 * BC, 2 * BC], SH_I,
                                              gl.where(o_i[:, None] == o_j[None, :], 1.0, 0.0).to(DT))

            b0 = (i_h * NCw - c0).to(gl.int64) * NB + lo * NB  # first block of the window buffers
            n_steps = (hi - lo) * NB
            for i in gl.static_range(STAGES - 1):
                if i < n_steps:
                    _issue_step(X, KG, GAM, U, b0 + i, i, s_wq, s_kg, s_gam, s_u0, s_u1, v0, BC, BK, BVP, BV, LD,
                                LDU, LG, CHAINS)
                async_copy.commit_group()

            # Sᵀ of both chains: row = value column, column = key dimension
            o_vs = gl.arange(0, BV, layout=gl.SliceLayout(1, LS))
            o_ks = gl.arange(0, BK, layout=gl.SliceLayout(0, LS))
            p_s = ht + ((i_n * H + i_h).to(gl.int64) * K + o_ks[None, :]) * V + v0 + o_vs[:, None]
            S0 = warpgroup_mma_init(gl.load(p_s))  # as accumulators: the loop carries them in flight
            S1 = warpgroup_mma_init(gl.load(p_s + BV, mask=CHAINS == 2, other=0.))
            # output addresses: Oᵀ [BV, 16] — row = value column, column = token
            o_vo = gl.arange(0, BV, layout=gl.SliceLayout(1, LO))
            o_t = gl.arange(0, BC, layout=gl.SliceLayout(0, LO))
            t0 = bos - cs.to(gl.int64) * BT + lo.to(gl.int64) * BT
            zero16 = gl.zeros([BV, 2 * BC], gl.float32, L16)
            for j in range(n_steps):
                slot = j % STAGES
                async_copy.wait_group(STAGES - 2)
                fence_async_shared()
                gl.thread_barrier()

                wq = s_wq.index(slot)
                wq_t = wq.permute((1, 0))  # [−W; qw]ᵀ [BK, 32]
                kg = s_kg.index(slot)
                gam = s_gam.index(slot)
                t = t0 + j * BC + o_t
                p_o = o + (t[None, :] * H + i_h) * V + v0 + o_vo[:, None]
                m_o = (t < eos)[None, :]
                # the chains run half a step apart: chain 0's products while chain 1's update is in flight (issued
                # at the end of the previous step), then chain 1's products while chain 0's update is in flight
                S0 = _chain_products(S0, s_u0.index(slot), wq_t, gam, kg, s_eye, zero16, p_o, m_o,
                                     BC, A16, AS, LS, LO, DT, CHAINS)
                # the ring slot of step j − 1 is free only now: chain 1's update of that step (reading its kg) was
                # still in flight until chain 0's wait above (wgmma completes for the whole warpgroup at once)
                nxt = j + STAGES - 1
                if nxt < n_steps:
                    _issue_step(X, KG, GAM, U, b0 + nxt, nxt % STAGES, s_wq, s_kg, s_gam, s_u0, s_u1, v0,
                                BC, BK, BVP, BV, LD, LDU, LG, CHAINS)
                async_copy.commit_group()
                if CHAINS == 2:
                    S1 = _chain_products(S1, s_u1.index(slot), wq_t, gam, kg, s_eye, zero16, p_o + BV, m_o,
                                         BC, A16, AS, LS, LO, DT, CHAINS)
            S0, S1 = warpgroup_mma_wait(0, deps=[S0, S1])
            async_copy.wait_group(0)
            gl.store(p_s, S0)
            if CHAINS == 2:
                gl.store(p_s + BV, S1)


def usable(bufs: dict, v, H: int, K: int, V: int, mode: int, ptr_inc: bool, u_rowmajor: bool, ring: int) -> bool:
    """Whether this kernel takes the state pass: the knob on, CUDA, mode 2's pointer loop with [U; A_qk U]
    row-major, 16-bit buffers, K = V = 128 (the tiles unmasked: two 64-column V-blocks), no probe ring."""
    X = bufs["X"]
    return (HAVE_GLUON and bool(GluonStateConfig.enabled) and X.is_cuda and mode == 2 and ptr_inc and u_rowmajor
            and ring == 0 and X.dtype in (torch.bfloat16, torch.float16) and X.shape[-1] == 128 and K == 128
            and V == 128 and bufs["U"].shape[-1] == 128)


def launch(bufs: dict, o, ht, tab, c0: int, c1: int, H: int, K: int, V: int, BT: int, BC: int) -> None:
    """The state pass over the window [c0, c1) of the 16-token flow's mode-2 buffers (``chunk16.launch_c16_state``'s
    contract), one program per (sequence, head)."""
    stages = GluonStateConfig.stages
    if not isinstance(stages, int) or not 2 <= stages <= 10:
        raise ValueError(f"GluonStateConfig.stages: expected an int in [2, 10], got {stages!r}")
    chains = GluonStateConfig.chains
    if chains not in (1, 2):
        raise ValueError(f"GluonStateConfig.chains: expected 1 or 2, got {chains!r}")
    warps = GluonStateConfig.warps
    if warps not in (4, 8) or (warps == 8 and chains != 1):
        raise ValueError(f"GluonStateConfig.warps: expected 4, or 8 with chains = 1, got {warps!r}")
    per_head = 128 // (16 * warps * chains)
    _c16_state_gluon[(tab.N * H * per_head,)](
        bufs["X"], bufs["KG"], bufs["GAM"], bufs["U"], o, ht, tab.cu, tab.chunk_off, c0, c1, bufs["X"].shape[1],
        tab.T, tab.NT, H, K=K, V=V, BT=BT, BC=BC, BK=128, BVP=128, IS_VARLEN=tab.varlen, STAGES=stages,
        CHAINS=chains, W=warps, num_warps=warps,
    )
