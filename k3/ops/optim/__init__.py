"""Optimizer updates fused into one pass per parameter (``adamw``: AdamW on an fp32 master with a bf16 model copy)."""

from k3.ops.optim.adamw import adamw_master_reference, adamw_master_step

__all__ = ["adamw_master_step", "adamw_master_reference"]
