"""Short causal convolution ops: the one-token decode update against a pool of conv tails (``update.py``)."""

from k3.ops.conv.update import short_conv_update, short_conv_update_reference

__all__ = ["short_conv_update", "short_conv_update_reference"]
