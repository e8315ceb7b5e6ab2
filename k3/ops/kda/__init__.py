"""Kimi Delta Attention ops (fla-compatible API). The math and the kernels: ``docs/kda-kernels.md``.

``chunk_kda``            chunked KDA, autograd; torch reference on CPU, Triton on CUDA (``K3_KDA_BACKEND`` forces).
``fused_recurrent_kda``  decode (forward only); ``fused_recurrent_kda_pool`` for an in-place state pool.
``naive_recurrent_kda``  token-by-token fp32/fp64 reference; ``naive_chunk_kda`` its chunked torch form.
``kda_gate``             the bounded forget gate; ``kda_softplus_gate`` the unbounded one; ``kda_gate_fused`` either;
                         ``fused_kda_gate`` the same under fla's name and signature.
Every argument of fla 0.6.0's ``chunk_kda`` / ``fused_recurrent_kda`` is accepted in fla's order and meaning.
``build_cp_context``     context parallel over a process group: ``chunk_kda(..., cp_context=ctx)``, ``cp_conv_halo``.
Long no-grad prefills are split into exactly-chained segments on their own (``prefix.py``; ``K3_KDA_SPLITS``).
Inside ``torch.compile`` both entry points run as registered ops (``k3::chunk_kda``, ``k3::fused_recurrent_kda``).
"""

from k3.ops.kda.chunk import chunk_kda
from k3.ops.kda.cp import KDACPContext, build_cp_context, cp_conv_halo
from k3.ops.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_pool
from k3.ops.kda.gate import fused_kda_gate, kda_gate, kda_gate_fused, kda_softplus_gate
from k3.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "fused_recurrent_kda_pool",
    "naive_recurrent_kda",
    "naive_chunk_kda",
    "kda_gate",
    "kda_softplus_gate",
    "kda_gate_fused",
    "fused_kda_gate",
    "build_cp_context",
    "cp_conv_halo",
    "KDACPContext",
]
