"""Parallelism that wraps single-device modules from outside.

``expert_parallel``  exact-volume expert parallel for the Latent MoE (``apply_expert_parallel``).
``data_parallel``    data-parallel training under torchrun (gradient all-reduce, per-rank rows of a global batch).
"""

from k3.distributed.expert_parallel import ExpertParallelMoE, apply_expert_parallel

__all__ = ["ExpertParallelMoE", "apply_expert_parallel"]
