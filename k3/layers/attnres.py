"""Block Attention Residuals bookkeeping with K3's rules (docs/architecture.md#block-attention-residuals).

The residual stream is a list of closed blocks ``b_0 = embedding, b_1, …`` plus the running partial sum ``p`` of
the open block. Decoder layer ``l`` (0-based), block size S counted in decoder layers:

1. ``h = mix_attn([b…, p])`` if any block is closed, else ``h = p`` (only at l = 0, where p is the embedding);
2. if ``l % S == 0``: close ``p`` as a new block and open an empty one (at l = 0 this closes b_0 = embedding);
3. ``p += Attn(input_layernorm(h))``;
4. ``h = mix_mlp([b…, p])``;
5. ``p += MLP(post_attention_layernorm(h))``.

After the last layer, ``output_mix([b…, p])``, then the final norm and lm_head. Each mix has its own pair
(gain γ = ``*_res_norm.weight`` [d], pseudo-query w = ``*_res_proj.weight`` [1, d]); its score vector is γ ⊙ w and
the mix itself is ``k3.ops.attn_res`` (fp32). "Empty" is represented by ``None`` — never by an alias of a closed
block — so the same tensor can never be both a closed block and the partial sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from k3.layers.norm import RMSNorm
from k3.ops.attnres.naive import attn_res

__all__ = ["ResidualStream", "AttnResPair", "attn_res_mix", "new_res_pair"]


@dataclass
class ResidualStream:
    """Closed block representations and the open block's partial sum (each ``[B, T, d]``)."""

    blocks: list[torch.Tensor] = field(default_factory=list)
    partial: torch.Tensor | None = None

    @classmethod
    def start(cls, embedding: torch.Tensor) -> "ResidualStream":
        """Before layer 0 the running sum is the embedding; layer 0 closes it as b_0."""
        return cls(blocks=[], partial=embedding)

    def sources(self) -> list[torch.Tensor]:
        if self.partial is None:  # only right after a close, before any sublayer output: never mixed
            raise RuntimeError("AttnRes: mixing with an empty open block (bookkeeping bug)")
        return [*self.blocks, self.partial]

    def close_block(self) -> None:
        assert self.partial is not None, "closing an empty block"
        self.blocks.append(self.partial)
        self.partial = None

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out


AttnResPair = tuple[RMSNorm, nn.Linear]


def new_res_pair(dim: int) -> AttnResPair:
    """(γ ``[d]`` ones, pseudo-query ``Linear(d, 1)`` zero-initialised: uniform weights at the start)."""
    proj = nn.Linear(dim, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return RMSNorm(dim), proj


def attn_res_mix(norm: RMSNorm, proj: nn.Linear, sources: list[torch.Tensor], eps: float) -> torch.Tensor:
    """Σ_i softmax_i(⟨γ ⊙ w, RMS(v_i)⟩) v_i in fp32, cast back to the sources' dtype."""
    return attn_res(proj.weight[0], sources, norm.weight, eps)


def attn_input(stream: ResidualStream, layer_idx: int, block_size: int, norm: RMSNorm, proj: nn.Linear,
               eps: float) -> torch.Tensor:
    """Steps 1–2: the attention sublayer's (pre-norm) input, and the block boundary."""
    h = attn_res_mix(norm, proj, stream.sources(), eps) if stream.blocks else stream.sources()[-1]
    if layer_idx % block_size == 0:
        stream.close_block()
    return h


def mlp_input(stream: ResidualStream, norm: RMSNorm, proj: nn.Linear, eps: float) -> torch.Tensor:
    """Step 4: the MLP / MoE sublayer's (pre-norm) input."""
    return attn_res_mix(norm, proj, stream.sources(), eps)
