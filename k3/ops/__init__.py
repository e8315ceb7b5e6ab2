"""Pure functions, each fast path beside its plain reference.

``kda``       Kimi Delta Attention: recurrent/chunked references, Triton kernels, span summaries, context parallel;
              fla's names (``chunk_kda``, ``fused_recurrent_kda``, ``fused_kda_gate``, ``naive_*``) re-exported here.
``mla``       Gated MLA attention: flash (training, prefill segments), absorbed decode over the latent cache.
``situ_glu``  the bounded GLU of the experts and dense MLPs.
``attn_res``  the Block Attention Residuals mix (``fused_attnres`` / ``naive_attnres``: fla's entries).
``qb_bias_update``  Quantile Balancing by histograms.
``gemv``      decode-sized linear layers (one or two rows) with the elementwise op before them fused in.
``optim``     AdamW on an fp32 master written back to its bf16 parameter in the same pass.
"""

from k3.ops import kda
from k3.ops.attnres import attn_res, fused_attnres, naive_attnres
from k3.ops.kda import chunk_kda, fused_kda_gate, fused_recurrent_kda, naive_chunk_kda, naive_recurrent_kda
from k3.ops.moe.qb import qb_bias_update
from k3.ops.moe.situ import situ_glu

__all__ = ["kda", "attn_res", "fused_attnres", "naive_attnres", "qb_bias_update", "situ_glu", "chunk_kda",
           "fused_recurrent_kda", "fused_kda_gate", "naive_chunk_kda", "naive_recurrent_kda"]
