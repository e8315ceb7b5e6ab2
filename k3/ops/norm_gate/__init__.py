"""RMSNorm times a sigmoid gate, fused for inference: KDA's output ``RMSNorm_head(o) ⊙ σ(g)`` (``norm_gate.py``)."""

from k3.ops.norm_gate.norm_gate import rms_norm_gate, rms_norm_gate_reference

__all__ = ["rms_norm_gate", "rms_norm_gate_reference"]
