"""Block Attention Residuals: the depth mix (fused Triton kernels beside the fp32 reference), fla-compatible entries
and the exact two-phase form for inference.

``attn_res``                    K3's entry (Triton on CUDA, the reference elsewhere); ``out_norm_weight`` fuses the
                                RMSNorm that follows the mix.
``attn_res_reference``          the plain fp32 reference.
``fused_attnres``, ``naive_attnres``  fla's ``fla.ops.attnres`` names, signatures and meaning.
``attn_res_sinked``, ``GradSink``   the fused mix summing each source's gradient over every mix that reads it in
                                one buffer, inside the backward kernel (training).
``attn_res_phase1``, ``attn_res_merge``  two-phase inference: a block's pseudo-queries against its closed blocks in
                                one pass, then an online-softmax merge with each layer's partial sum.
"""

from k3.ops.attnres.naive import attn_res_reference, naive_attnres
from k3.ops.attnres.op import attn_res, attn_res_fused, fused_attnres, uses_fused
from k3.ops.attnres.sink import GradSink, attn_res_sinked
from k3.ops.attnres.two_phase import attn_res_merge, attn_res_phase1

__all__ = ["GradSink", "attn_res", "attn_res_fused", "attn_res_merge", "attn_res_phase1", "attn_res_reference",
           "attn_res_sinked", "fused_attnres", "naive_attnres", "uses_fused"]
