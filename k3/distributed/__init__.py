"""Parallelism that wraps the single-device model from outside (``docs/parallelism.md``, ``docs/training.md``).

``parallel_dims``     the degrees of a run and its named DeviceMesh views.
``parallelize``       ``parallelize_k3``: expert parallel, context parallel, checkpointing, compile, FSDP2.
``expert_parallel``   exact-volume expert parallel for the Latent MoE (``apply_expert_parallel``).
``context_parallel``  every layer over slices of each sequence (``apply_context_parallel``).
``release``           the released checkpoint loaded expert-sharded (``load_expert_sharded``).
``plan``              ``k3 plan``: memory, FLOPs, traffic and step time on N GPUs.
``data_parallel``     where a process sits in a run; each rank's part of the global batch.
``checkpoint``        torch.distributed.checkpoint directories of parallel runs, resumable by any layout.
"""

from k3.distributed.context_parallel import apply_context_parallel
from k3.distributed.expert_parallel import ExpertParallelMoE, apply_expert_parallel

__all__ = ["ExpertParallelMoE", "apply_expert_parallel", "apply_context_parallel"]
