"""Checkpoints: run checkpoints (``run``: atomic, verified, resumable) and the released K3 layout (``released``)."""

from k3.ckpt.run import CheckpointError, find_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint

__all__ = ["CheckpointError", "find_checkpoint", "load_checkpoint", "save_checkpoint", "verify_checkpoint"]
