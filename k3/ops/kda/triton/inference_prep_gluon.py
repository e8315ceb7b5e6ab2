"""The 16-token inference prep (``inference_prep._c16_prep``) in Gluon, for the K3 setting on CUDA.

Why a second prep: the Triton prep spends about half its SM cycles on shared-memory traffic in layouts the compiler
picks: its [16, 128] tiles spread a column's 16 rows over lanes and warps, so the gate's cumsum and the column sum
for γ cross warps through shared memory. Here each thread holds all 16 rows of two columns (``LR``): the cumsum and
γ stay in registers; the small products run on mma.sync (``mma_v2``) with their operands staged in shared memory
explicitly, once per tile (x feeds both A_kk and W = Tβ·X from the same buffer). H200, per 1M tokens at H = 32:
22.6 ms against the Triton prep's 24.8.

Same outputs as ``_c16_prep`` up to bf16 rounding order: [−W; qw] stacked per block in X, U row-major per block,
[I | A_qkᵀ] in AQ, kg in KG, γ in GAM (and the decay bound in DEC when asked). Taken only where that path's flags are
the K3 ones (bf16, K = V = 128, bounded in-kernel gate, in-kernel L2 norm and β sigmoid, the inverse at fp16x3, an
sm_80+ device); anything else stays on the Triton prep.

Gluon does not run in Triton's interpreter: the GPU tests check this kernel against the fp64 recurrence and
against the Triton prep's buffers; on CPU it compiles for sm_90.
"""

from __future__ import annotations

import torch

from k3.ops.kda.triton._common import HAVE_GLUON, gluon_enabled, gluon_unavailable

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2


if HAVE_GLUON:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _split(a, L: gl.constexpr):
        """fp32 → (hi, lo) fp16 operands in dot-operand layout L (22 significant bits together)."""
        hi = a.to(gl.float16)
        lo = (a - hi.to(gl.float32)).to(gl.float16)
        return gl.convert_layout(hi, L), gl.convert_layout(lo, L)

    @gluon.jit
    def _mm16(a_hi, a_lo, b_hi, b_lo, MMA: gl.constexpr):
        """[16, 16] · [16, 16] at ~fp32 accuracy from split operands: hi·lo + lo·hi + hi·hi on fp16 tensor cores
        (``_mm_acc``'s 'fp16x3'; the inverse's partial products stay inside fp16's range for the K3 flags)."""
        acc = mma_v2(a_hi, b_lo, gl.zeros([16, 16], gl.float32, layout=MMA))
        acc = mma_v2(a_lo, b_hi, acc)
        return mma_v2(a_hi, b_hi, acc)

    @gluon.jit
    def _inv_pow16(L, o_i, o_j, MMA: gl.constexpr):
        """``inference_prep._inv_pow`` at fp16x3: (I + L)^{-1} of a strictly lower-triangular [16, 16] block as
        (I − L)(I + L²)(I + L⁴)(I + L⁸), ordered so the chain is four products deep (N⁴ beside D·N², N⁸ beside
        D·N⁴) and each factor is split and converted into its operand layouts once."""
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        N = -L
        na_h, na_l = _split(N, DA)
        nb_h, nb_l = _split(N, DB)
        N2 = _mm16(na_h, na_l, nb_h, nb_l, MMA)
        D = gl.where(o_i[:, None] == o_j[None, :], 1.0, 0.0) + N
        n2a_h, n2a_l = _split(N2, DA)
        n2b_h, n2b_l = _split(N2, DB)
        N4 = _mm16(n2a_h, n2a_l, n2b_h, n2b_l, MMA)
        da_h, da_l = _split(D, DA)
        D = D + _mm16(da_h, da_l, n2b_h, n2b_l, MMA)
        n4a_h, n4a_l = _split(N4, DA)
        n4b_h, n4b_l = _split(N4, DB)
        N8 = _mm16(n4a_h, n4a_l, n4b_h, n4b_l, MMA)
        da_h, da_l = _split(D, DA)
        D = D + _mm16(da_h, da_l, n4b_h, n4b_l, MMA)
        n8b_h, n8b_l = _split(N8, DB)
        da_h, da_l = _split(D, DA)
        return D + _mm16(da_h, da_l, n8b_h, n8b_l, MMA)

    @gluon.jit
    def _rnorm(r, o_i, o_j, BC: gl.constexpr, K: gl.constexpr, SH: gl.constexpr, MMA: gl.constexpr,
               LRr: gl.constexpr):
        """1 / sqrt(Σ_d r_d² + 1e-6) per row of a bf16 [BC, K] tile, in the rows' slice of LR."""
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        s = gl.allocate_shared_memory(gl.bfloat16, [BC, K], SH, r.to(gl.bfloat16))
        P = mma_v2(s.load(DA), s.permute((1, 0)).load(DB), gl.zeros([BC, BC], gl.float32, layout=MMA))
        ss = gl.sum(gl.where(o_i[:, None] == o_j[None, :], P, 0.), axis=1)
        return gl.convert_layout(gl.rsqrt(ss + 1e-6), LRr)

    @gluon.jit
    def _c16_prep_gluon(
        q, k, v, g, beta, A_log, dt_bias, X, KG, GAM, U,
        cu, chunk_seq, chunk_off, c0, NCw, T, NT, H, scale, lb,
        K: gl.constexpr, BT: gl.constexpr, BC: gl.constexpr, HAS_A: gl.constexpr, HAS_DT: gl.constexpr,
        IS_VARLEN: gl.constexpr, AQ, DEC=None, DEC_OUT: gl.constexpr = False,
    ):
        """Grid (blocks of the window, H): one 16-token block of one head per program, 2 warps. ``DEC_OUT``: also the
        block's decay bound (``inference_prep.decay_bound``) into ``DEC``."""
        # a thread holds all 16 rows of 2 adjacent columns: the gate's cumsum and γ never leave it
        LR: gl.constexpr = gl.BlockedLayout([BC, 2], [1, 32], [1, 2], [1, 0])
        LRr: gl.constexpr = gl.SliceLayout(1, LR)
        LRc: gl.constexpr = gl.SliceLayout(0, LR)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 2], instr_shape=[16, 8])
        Mr: gl.constexpr = gl.SliceLayout(1, MMA)
        Mc: gl.constexpr = gl.SliceLayout(0, MMA)
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        # coalesced 16-byte rows for the outputs that leave through shared memory
        LS: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [2, 1], [1, 0])
        SH: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        NB: gl.constexpr = BT // BC

        i_b = gl.program_id(0)
        i_h = gl.program_id(1)
        i_c = i_b // NB
        blk = i_b % NB
        c = c0 + i_c
        if IS_VARLEN:
            i_n = gl.load(chunk_seq + c)
            bos = gl.load(cu + i_n).to(gl.int64) + (c - gl.load(chunk_off + i_n)).to(gl.int64) * BT
            eos = gl.load(cu + i_n + 1).to(gl.int64)
        else:
            bos = (c // NT).to(gl.int64) * T + (c % NT).to(gl.int64) * BT
            eos = (c // NT + 1).to(gl.int64) * T
        t0 = bos + blk * BC
        base = (i_h * NCw + i_c).to(gl.int64)
        bidx = base * NB + blk

        # ---- loads: g, k, q, v rows of this block and head (zeros past the sequence's end), β in both MMA slices
        o_s = gl.arange(0, BC, layout=LRr)
        o_k = gl.arange(0, K, layout=LRc)
        m_t = (t0 + o_s) < eos
        # one int64 scalar base and int32 in-tile offsets shared by the four tensors (same [T, H, K] strides)
        row0 = t0 * (H * K) + i_h * K
        p_in = (o_s * (H * K))[:, None] + o_k[None, :]
        m_in = m_t[:, None] & (o_k < K)[None, :]
        r_g = gl.load(g + row0 + p_in, mask=m_in, other=0.)
        r_k = gl.load(k + row0 + p_in, mask=m_in, other=0.)
        r_q = gl.load(q + row0 + p_in, mask=m_in, other=0.)
        r_v = gl.load(v + row0 + p_in, mask=m_in, other=0.)
        o_i = gl.arange(0, BC, layout=Mr)
        o_j = gl.arange(0, BC, layout=Mc)
        t_i = t0 + o_i
        t_j = t0 + o_j
        b_bi = gl.load(beta + t_i * H + i_h, mask=t_i < eos, other=0.).to(gl.float32)
        b_bj = gl.load(beta + t_j * H + i_h, mask=t_j < eos, other=0.).to(gl.float32)
        b_bi = gl.where(t_i < eos, 1.0 / (1.0 + gl.exp(-b_bi)), 0.)  # 16 values: the plain σ
        b_bj = gl.where(t_j < eos, 1.0 / (1.0 + gl.exp(-b_bj)), 0.)

        # ---- gate (log2 decay, the bounded form with σ as rsqrt², as ``_gate_of`` FAST), cumsum, γ
        b_f = r_g.to(gl.float32)
        if HAS_DT:
            b_f = b_f + gl.load(dt_bias + i_h * K + o_k).to(gl.float32)[None, :]
        cg = -1.4426950408889634
        if HAS_A:
            cg = cg * gl.exp(gl.load(A_log + i_h).to(gl.float32))
        rr = gl.rsqrt(1.0 + gl.exp2(b_f * cg))
        b_g = gl.where(m_in, rr * rr * (lb * 1.4426950408889634), 0.)
        G = gl.associative_scan(b_g, 0, _add)
        gam = gl.exp2(gl.sum(b_g, axis=0))
        gl.store(GAM + bidx * K + o_k, gam)
        if DEC_OUT:  # BC · the block's largest log2 decay (rows past the end are 0: no decay claimed)
            gl.store(DEC + bidx, gl.max(gl.max(b_g, axis=0), axis=0) * BC)

        # ---- L2 norms: Σ_d k_d² as the diagonal of k kᵀ on the tensor cores (bf16 products are exact in the fp32
        # accumulator), not as 16 row sums across all 64 threads (80 shuffles per tile)
        b_k = r_k.to(gl.float32) * _rnorm(r_k, o_i, o_j, BC, K, SH, MMA, LRr)[:, None]
        b_q = r_q.to(gl.float32) * _rnorm(r_q, o_i, o_j, BC, K, SH, MMA, LRr)[:, None]
        kd = b_k * gl.exp2(-G)
        p_kg = (o_s * K)[:, None] + o_k[None, :]
        gl.store(KG + (base * BT + blk * BC) * K + p_kg, (kd * gam[None, :]).to(gl.bfloat16))
        e = gl.exp2(G)
        s_x = gl.allocate_shared_memory(gl.bfloat16, [BC, K], SH, (b_k * e).to(gl.bfloat16))
        s_kd = gl.allocate_shared_memory(gl.bfloat16, [BC, K], SH, kd.to(gl.bfloat16))
        s_q = gl.allocate_shared_memory(gl.bfloat16, [BC, K], SH, (b_q * e).to(gl.bfloat16))
        s_v = gl.allocate_shared_memory(gl.bfloat16, [BC, K], SH, r_v.to(gl.bfloat16))

        # ---- A_kk, A_qk (scale·, causal), T = (I + β A_kk)^{-1}, Tβ
        kdt = s_kd.permute((1, 0)).load(DB)
        z16 = gl.zeros([BC, BC], gl.float32, layout=MMA)
        ak = mma_v2(s_x.load(DA), kdt, z16)
        aq = mma_v2(s_q.load(DA), kdt, z16)
        aq = gl.where(o_i[:, None] >= o_j[None, :], aq, 0.) * scale
        lk = gl.where(o_i[:, None] > o_j[None, :], ak * b_bi[:, None], 0.)
        tb = _inv_pow16(lk, o_i, o_j, MMA) * b_bj[None, :]
        tba = gl.convert_layout(tb.to(gl.bfloat16), DA)

        # ---- W = Tβ X, U = Tβ v; qw = qg − A_qk W, A_qk U
        zk = gl.zeros([BC, K], gl.float32, layout=MMA)
        w = mma_v2(tba, s_x.load(DB), zk)
        u = mma_v2(tba, s_v.load(DB), zk).to(gl.bfloat16)
        s_w = gl.allocate_shared_memory(gl.bfloat16, [BC, K], SH, (-(w.to(gl.bfloat16))))
        s_u = gl.allocate_shared_memory(gl.bfloat16, [BC, K], SH, u)
        aqa = gl.convert_layout(aq.to(gl.bfloat16), DA)
        qw = mma_v2(aqa, s_w.load(DB), s_q.load(MMA).to(gl.float32) * scale)

        # ---- stores: rows [32 b, 32 b + 16) −W, rows [32 b + 16, 32 b + 32) qw; U [16, K] and [I | A_qkᵀ] [16, 32]
        # per block (A_qkᵀ[s, j] = A_qk[j, s], scale included)
        r_o = gl.arange(0, BC, layout=gl.SliceLayout(1, LS))
        c_o = gl.arange(0, K, layout=gl.SliceLayout(0, LS))
        p_o = (r_o * K)[:, None] + c_o[None, :]
        o0 = bidx * (2 * BC * K)
        gl.store(X + o0 + p_o, s_w.load(LS))
        gl.store(X + o0 + BC * K + p_o, gl.convert_layout(qw.to(gl.bfloat16), LS))
        gl.store(U + bidx * (BC * K) + p_o, s_u.load(LS))
        p_ia = AQ + bidx * (BC * 2 * BC)
        gl.store(p_ia + (o_i * (2 * BC))[:, None] + o_j[None, :],
                 gl.where(o_i[:, None] == o_j[None, :], 1.0, 0.).to(gl.bfloat16))
        gl.store(p_ia + (o_j * (2 * BC))[None, :] + BC + o_i[:, None], aq.to(gl.bfloat16))

def usable(q: torch.Tensor, K: int, V: int, flags: dict, lower_bound, inv_prec: str) -> bool:
    """Whether the Gluon prep takes this window: CUDA bf16 on an sm_80+ device (mma.sync with bf16), K = V = 128,
    the K3 flags (bounded in-kernel gate, L2 norm, β sigmoid), the inverse at fp16x3, Gluon on and available."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and K == 128 and V == 128 and inv_prec == "fp16x3"
            and lower_bound is not None and flags["use_gate"] and flags["l2norm"] and flags["beta_sigmoid"]
            and torch.cuda.get_device_capability(q.device)[0] >= 8 and gluon_enabled()
            and not gluon_unavailable("prefill prep"))


def launch(q, k, v, g, beta, A_log, dt_bias, bufs: dict, tab, c0: int, n: int, scale: float, lower_bound: float,
           BT: int, BC: int) -> None:
    H, K = q.shape[2], q.shape[3]
    dummy = bufs["GAM"]
    _c16_prep_gluon[(n * (BT // BC), H)](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        bufs["X"], bufs["KG"], bufs["GAM"], bufs["U"], tab.cu, tab.chunk_seq, tab.chunk_off, c0,
        bufs["X"].shape[1], tab.T, tab.NT, H, scale, float(lower_bound),
        K=K, BT=BT, BC=BC, HAS_A=A_log is not None, HAS_DT=dt_bias is not None, IS_VARLEN=tab.varlen,
        AQ=bufs["AQ"], DEC=bufs.get("DEC"), DEC_OUT="DEC" in bufs, num_warps=2,
    )
