"""Triton kernels for KDA (CUDA; CPU through ``TRITON_INTERPRET=1``).

``chunk_kda_triton``            chunked forward + backward (autograd), windowed constant-memory inference prefill.
``fused_recurrent_kda_triton``  forward-only decode, optionally over a state pool updated in place.
``span_summaries_triton``       per-sequence affine summaries (M, S_ext) for split prefill and context parallel.
``split_prefill_triton``        the one-card split prefill.
"""

from k3.ops.kda.triton.chunk import chunk_kda_triton
from k3.ops.kda.triton.decode import fused_recurrent_kda_triton
from k3.ops.kda.triton.span import span_summaries_triton
from k3.ops.kda.triton.split import split_prefill_triton

__all__ = ["chunk_kda_triton", "fused_recurrent_kda_triton", "span_summaries_triton", "split_prefill_triton"]
