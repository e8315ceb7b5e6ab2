"""nn.Modules built from ``k3.ops``: one mechanism of the SPEC per file.

``norm``     RMSNorm (fp32 statistics)              ``conv``  depthwise causal short conv + decode tail
``kda``      Kimi Delta Attention layer (SPEC §2)   ``mla``   Gated MLA, NoPE (SPEC §3)
``attnres``  Block AttnRes bookkeeping (SPEC §4)    ``mlp``   dense SiTU-GLU MLP (layer 0, shared experts)
``moe``      Latent MoE + GroupedExperts + QB bias (SPEC §5)
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
