"""Short causal convolution ops: a whole piece with its decode tail, forward and backward (``causal.py``), and the
one-token decode update against a pool of conv tails (``update.py``)."""

from k3.ops.conv.causal import short_conv, short_conv_fused, short_conv_reference
from k3.ops.conv.update import short_conv_update, short_conv_update_reference

__all__ = ["short_conv", "short_conv_fused", "short_conv_reference", "short_conv_update",
           "short_conv_update_reference"]
