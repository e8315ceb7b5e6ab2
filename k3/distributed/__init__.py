"""Parallelism that wraps single-device modules from outside.

``expert_parallel``  exact-volume expert parallel for the Latent MoE (``ExpertParallelMoE``, ``parallelize_moe``).
``data_parallel``    data-parallel training under torchrun (gradient all-reduce, per-rank rows of a global batch).
"""

from k3.distributed.expert_parallel import ExpertParallelMoE, parallelize_moe

__all__ = ["ExpertParallelMoE", "parallelize_moe"]
