"""RMSNorm with fp32 statistics: the fused Triton kernels (forward + backward) beside the plain reference.

``rms_norm``            Triton on CUDA, the reference elsewhere.
``rms_norm_reference``  the plain fp32 reference.
"""

from k3.ops.norm.naive import rms_norm_reference
from k3.ops.norm.op import rms_norm, rms_norm_fused

__all__ = ["rms_norm", "rms_norm_fused", "rms_norm_reference"]
