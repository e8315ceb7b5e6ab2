"""Gated MLA attention ops, each fast path beside its plain reference (``naive.py``). The math: ``docs/mla.md``.

``attention``      expanded-form flash attention (q·k over nope + rope, v of its own width), forward + backward,
                   returning the log-sum-exp; Triton on CUDA, fp32 reference on CPU (training, prefill segments).
``mla_decode``     absorbed attention over the bf16 latent cache pool (split-K, heads grouped per cache block).
``mla_prefill``    a chunk's queries over the whole latent cache, re-expanded segment by segment (bounded memory).
"""

from k3.ops.mla.attention import attention
from k3.ops.mla.decode import mla_decode
from k3.ops.mla.naive import attention_ref, mla_decode_ref
from k3.ops.mla.prefill import expand_latent, mla_prefill

__all__ = ["attention", "mla_decode", "mla_prefill", "expand_latent", "attention_ref", "mla_decode_ref"]
