"""Kimi Delta Attention ops (fla-compatible API).

``naive_recurrent_kda``  token-by-token fp32 reference.
"""

from k3.ops.kda.gate import kda_gate
from k3.ops.kda.naive import naive_recurrent_kda

__all__ = ["naive_recurrent_kda", "kda_gate"]
