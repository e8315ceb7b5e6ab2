"""Token sampling ops: Gumbel-max with a Philox stream per row (``gumbel.py``; Triton kernel on CUDA)."""

from k3.ops.sampling.gumbel import gumbel_argmax, gumbel_argmax_reference, philox_uniform

__all__ = ["gumbel_argmax", "gumbel_argmax_reference", "philox_uniform"]
