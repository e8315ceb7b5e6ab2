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
the mix itself is ``k3.ops.attn_res`` (fp32), with the RMSNorm that follows it (``input_layernorm``,
``post_attention_layernorm``, the final ``norm``) fused in. "Empty" is represented by ``None`` — never by an alias
of a closed block — so the same tensor can never be both a closed block and the partial sum.

A mixer is any callable ``(norm, proj, sources, eps, out_norm) → normed input``: ``attn_res_mix`` mixes all sources
per call; ``TwoPhaseMixer`` (inference) scores every query that sees the same closed blocks in one batched pass
when those blocks change, then merges each layer's partial sum in (exact: ``k3.ops.attnres.two_phase``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from k3.layers.norm import RMSNorm
from k3.ops.attnres import GradSink, attn_res, attn_res_merge, attn_res_phase1, attn_res_sinked, uses_fused

__all__ = ["ResidualStream", "AttnResPair", "Mixer", "TwoPhaseMixer", "attn_res_mix", "closed_blocks_seen",
           "new_res_pair"]


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


def attn_res_mix(norm: RMSNorm, proj: nn.Linear, sources: list[torch.Tensor], eps: float,
                 out_norm: RMSNorm | None = None) -> torch.Tensor:
    """Σ_i softmax_i(⟨γ ⊙ w, RMS(v_i)⟩) v_i in fp32, then ``out_norm`` (fused), cast back to the sources' dtype.

    Under autocast the embedding (b_0) stays fp32 while sublayer outputs are bf16: the sources are brought to their
    common (promoted) dtype first, since the op takes one dtype. When autograd records on the fused kernels, each
    stream tensor carries a :class:`GradSink`: its gradients from all the mixes that read it are summed inside the
    backward kernel instead of by autograd, one add pass per extra reader fewer (``k3.ops.attnres.sink``)."""
    dt = functools.reduce(torch.promote_types, (s.dtype for s in sources))
    sources = [s if s.dtype == dt else s.to(dt) for s in sources]
    onw = None if out_norm is None else out_norm.weight
    if (torch.is_grad_enabled() and uses_fused(sources[0]) and not torch.compiler.is_compiling()
            and len({id(s) for s in sources}) == len(sources)):
        return attn_res_sinked(proj.weight[0], sources, [_sink(s) for s in sources], norm.weight, eps, onw)
    return attn_res(proj.weight[0], sources, norm.weight, eps, onw)


def _sink(t: torch.Tensor) -> GradSink:
    """The tensor's gradient sink, made at its first mix (an attribute: it lives exactly as long as the tensor)."""
    sink = getattr(t, "_k3_grad_sink", None)
    if sink is None:
        sink = GradSink()
        t._k3_grad_sink = sink  # type: ignore[attr-defined]
    return sink


Mixer = Callable[[RMSNorm, nn.Linear, list[torch.Tensor], float, "RMSNorm | None"], torch.Tensor]


def closed_blocks_seen(layer_idx: int, block_size: int, sublayer: str) -> int:
    """How many closed blocks the ``"attn"`` / ``"mlp"`` mix of decoder layer ``layer_idx`` (or, with ``"output"``
    and the layer count as ``layer_idx``, the output mix) sees: blocks close at layers 0, S, 2S, … after the
    attention mix, so the attention mix of layer l ≥ 1 sees 1 + (l−1)//S of them and its MLP mix 1 + l//S."""
    if sublayer == "attn":
        return 1 + (layer_idx - 1) // block_size
    if sublayer == "mlp":
        return 1 + layer_idx // block_size
    if sublayer == "output":
        return 1 + (layer_idx - 1) // block_size
    raise ValueError(f"sublayer must be 'attn', 'mlp' or 'output', got {sublayer!r}")


# Up to this many tokens per forward (decode steps, short pieces) a mix reads its few sources directly in one
# fused launch; phase 1 would cost about ten small launches per group to save reads that are a few KiB here.
DIRECT_MAX_TOKENS = 256


class TwoPhaseMixer:
    """Exact two-phase mixing for inference. ``pairs`` lists every mix as ``(closed blocks it sees, norm, proj)``.
    When a call sees a new set of closed blocks, all queries that see that many blocks are scored against them in
    one pass (phase 1); each call then merges its own partial sum in (phase 2), with the following norm fused.
    Forwards of at most ``DIRECT_MAX_TOKENS`` tokens mix each call's sources in one fused pass instead (the same
    mix; no phase 1). The score vectors γ ⊙ w of all pairs are made in one batched op per mixer (a forward)."""

    def __init__(self, pairs: Iterable[tuple[int, RMSNorm, nn.Linear]]) -> None:
        pairs = list(pairs)
        self._groups: dict[int, list[nn.Linear]] = {}
        for n, _, proj in pairs:
            self._groups.setdefault(n, []).append(proj)
        scores = (torch.stack([proj.weight[0] for _, _, proj in pairs]).float()
                  * torch.stack([norm.weight for _, norm, _ in pairs]).float()) if pairs else None
        self._score = {id(proj): scores[i] for i, (_, _, proj) in enumerate(pairs)}
        self._closed: list[torch.Tensor] = []
        self._phase1: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, norm: RMSNorm, proj: nn.Linear, sources: list[torch.Tensor], eps: float,
                 out_norm: RMSNorm | None = None) -> torch.Tensor:
        if id(proj) not in self._score:
            raise RuntimeError("AttnRes: a mix that is not one of the mixer's pairs (bookkeeping)")
        score, onw = self._score[id(proj)], None if out_norm is None else out_norm.weight
        closed, partial = sources[:-1], sources[-1]
        if partial.numel() <= DIRECT_MAX_TOKENS * partial.shape[-1]:
            return attn_res(score, sources, None, eps, onw)
        if len(closed) != len(self._closed) or any(a is not b for a, b in zip(closed, self._closed)):
            self._start_group(closed, eps)
        if id(proj) not in self._phase1:
            raise RuntimeError(f"AttnRes: a mix over {len(closed)} closed blocks was not in that group (bookkeeping)")
        o1, lse = self._phase1[id(proj)]
        return attn_res_merge(o1, lse, partial, score, eps, onw)

    def _start_group(self, closed: list[torch.Tensor], eps: float) -> None:
        group = self._groups.get(len(closed), [])
        self._closed, self._phase1 = list(closed), {}
        if not group:
            return
        o1, lse = attn_res_phase1(torch.stack([self._score[id(proj)] for proj in group]), closed, eps)
        self._phase1 = {id(proj): (o1[i], lse[i]) for i, proj in enumerate(group)}


def attn_input(stream: ResidualStream, layer_idx: int, block_size: int, norm: RMSNorm, proj: nn.Linear,
               eps: float, out_norm: RMSNorm, mixer: Mixer | None = None) -> torch.Tensor:
    """Steps 1–2: the attention sublayer's normed input (``out_norm`` = ``input_layernorm``), and the block
    boundary."""
    if stream.blocks:
        x = (mixer or attn_res_mix)(norm, proj, stream.sources(), eps, out_norm)
    else:
        x = out_norm(stream.sources()[-1])
    if layer_idx % block_size == 0:
        stream.close_block()
    return x


def mlp_input(stream: ResidualStream, norm: RMSNorm, proj: nn.Linear, eps: float, out_norm: RMSNorm,
              mixer: Mixer | None = None) -> torch.Tensor:
    """Step 4: the MLP / MoE sublayer's normed input (``out_norm`` = ``post_attention_layernorm``)."""
    return (mixer or attn_res_mix)(norm, proj, stream.sources(), eps, out_norm)
