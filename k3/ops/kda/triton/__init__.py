"""Triton kernels for KDA (CUDA; CPU through ``TRITON_INTERPRET=1``)."""

from k3.ops.kda.triton.chunk import chunk_kda_triton

__all__ = ["chunk_kda_triton"]
