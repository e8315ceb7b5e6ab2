"""nn.Modules built from ``k3.ops``: one mechanism of docs/architecture.md per file.

``norm``     RMSNorm (fp32 statistics)              ``conv``  depthwise causal short conv + decode tail
``kda``      Kimi Delta Attention layer             ``mla``   Gated MLA, NoPE
``attnres``  Block AttnRes bookkeeping              ``mlp``   dense SiTU-GLU MLP (layer 0, shared experts)
``moe``      Latent MoE + GroupedExperts + QB bias
"""

from k3.layers.attnres import ResidualStream, attn_res_mix
from k3.layers.conv import ShortConv
from k3.layers.kda import KimiDeltaAttention
from k3.layers.mla import GatedMLA
from k3.layers.mlp import SiTUMLP
from k3.layers.moe import GroupedExperts, LatentMoE, MoEGate
from k3.layers.norm import RMSNorm

__all__ = ["RMSNorm", "ShortConv", "KimiDeltaAttention", "GatedMLA", "ResidualStream", "attn_res_mix", "SiTUMLP",
           "LatentMoE", "MoEGate", "GroupedExperts"]
