"""The Kimi K3 decoder (docs/architecture.md) in plain PyTorch; module names mirror the released checkpoint.

Data path: token ids → ``embed_tokens`` (= b_0) → for each decoder layer l:
AttnRes mix → ``input_layernorm`` → KDA or Gated MLA → add to the open block's partial sum → (l % block_size == 0:
the previous partial sum closes into a block, before the add) → AttnRes mix → ``post_attention_layernorm`` → dense
SiTU-GLU MLP (l < first_k_dense) or Latent MoE → add → … → output AttnRes mix → ``norm`` → ``lm_head``.
See ``k3.layers.attnres`` for the exact order; each norm that follows a mix is fused into it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3.config import K3Config
from k3.layers.attnres import (Mixer, ResidualStream, TwoPhaseMixer, attn_input, attn_res_mix, closed_blocks_seen,
                               mlp_input, new_res_pair)
from k3.layers.conv import ShortConv
from k3.layers.kda import KimiDeltaAttention
from k3.layers.mla import GatedMLA
from k3.layers.mlp import SiTUMLP
from k3.layers.moe import GroupedExperts, LatentMoE, MoEGate
from k3.layers.norm import RMSNorm
from k3.ops.loss import linear_cross_entropy
from k3.ops.moe.qb import qb_all_reduce
from k3.state import K3State, MLACache

__all__ = ["K3ForCausalLM", "K3Model", "K3DecoderLayer", "K3Output", "keeps_fp32", "IGNORE_INDEX", "AC_POLICIES"]

# activation checkpointing (K3ForCausalLM.gradient_checkpointing_enable)
AC_POLICIES = ("none", "full", "selective", "experts")
_LAYER_POLICIES = ("full", "selective")  # checkpointed per decoder layer; "experts" inside each MoE layer

IGNORE_INDEX = -100
# Tensors kept in fp32 whatever config.dtype says (as in the released checkpoint).
_FP32_SUFFIXES = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")


def keeps_fp32(name: str) -> bool:
    """Whether parameter/buffer ``name`` (as in ``named_parameters``) is stored in fp32 regardless of config.dtype."""
    return name.endswith(_FP32_SUFFIXES)


class K3Output:
    """``logits [B, T, vocab]`` in the model dtype; ``loss``: fp32 scalar, mean next-token cross entropy over
    non-ignored targets (None without labels); ``state``: the decode state updated in place, when one was passed.

    When the loss was computed by the fused linear + cross-entropy op (CUDA), the logits are not materialised
    until ``.logits`` is first read (then ``lm_head`` runs on the kept final hidden states, once)."""

    def __init__(self, logits: torch.Tensor | None = None, loss: torch.Tensor | None = None,
                 state: K3State | None = None, hidden: torch.Tensor | None = None,
                 lm_head: nn.Module | None = None) -> None:
        self._logits, self.loss, self.state = logits, loss, state
        self._hidden, self._lm_head = hidden, lm_head

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            assert self._hidden is not None and self._lm_head is not None
            self._logits = self._lm_head(self._hidden)
            self._hidden = None
        return self._logits


class K3DecoderLayer(nn.Module):
    """One decoder layer: two AttnRes mixes, a token mixer (KDA or MLA) and a channel mixer (MLP or MoE)."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx, self.block_size, self.eps = layer_idx, config.attn_res_block_size, float(eps)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.self_attention_res_norm, self.self_attention_res_proj = new_res_pair(d)
        self.mlp_res_norm, self.mlp_res_proj = new_res_pair(d)
        mixer = GatedMLA if config.layer_type(layer_idx) == "mla" else KimiDeltaAttention
        self.self_attn = mixer(config, layer_idx)
        if config.is_moe(layer_idx):
            self.block_sparse_moe = LatentMoE(config, layer_idx)
        else:
            self.mlp = SiTUMLP(d, config.dense_intermediate_size, config.situ_beta1, config.situ_beta2)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, blocks: list[torch.Tensor], partial: torch.Tensor, state: Any = None,
                mixer: Mixer | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Closed blocks + partial sum (each ``[B, T, d]``) → the same after this layer (new list; the input list
        is not mutated, so activation checkpointing can re-run the layer). ``mixer``: how the AttnRes mixes run
        (default ``attn_res_mix``; the model passes a ``TwoPhaseMixer`` for inference with a decode state)."""
        stream = ResidualStream(list(blocks), partial)
        x = attn_input(stream, self.layer_idx, self.block_size, self.self_attention_res_norm,
                       self.self_attention_res_proj, self.eps, self.input_layernorm, mixer)
        stream.add(self.self_attn(x, state))
        x = mlp_input(stream, self.mlp_res_norm, self.mlp_res_proj, self.eps, self.post_attention_layernorm, mixer)
        stream.add(self.ffn(x))
        assert stream.partial is not None
        return stream.blocks, stream.partial


class K3Model(nn.Module):
    """Embedding, decoder layers, output AttnRes mix and final norm → hidden states ``[B, T, d]``."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.output_attn_res_norm, self.output_attn_res_proj = new_res_pair(d)
        self.gradient_checkpointing = "none"  # one of AC_POLICIES: K3ForCausalLM.gradient_checkpointing_enable

    def forward(self, input_ids: torch.Tensor, state: K3State | None = None) -> torch.Tensor:
        """``input_ids [B, T]`` (validated by ``K3ForCausalLM``) → final-normed hidden states ``[B, T, d]``.
        With ``state``: continues the sequences of its bound pool rows and advances them by T (device-side only:
        a caller that validated its inputs may call this directly, e.g. inside a CUDA graph); the AttnRes mixes then
        run through ``TwoPhaseMixer`` (exact two-phase form for long pieces, one fused pass per mix for short ones)."""
        if state is not None:
            state.begin()
        blocks: list[torch.Tensor] = []
        partial = self.embed_tokens(input_ids)  # layer 0 closes it as b_0
        mixer = self.two_phase_mixer() if state is not None else attn_res_mix
        for i, layer in enumerate(self.layers):
            s = state.layers[i] if state is not None else None
            policy = self.gradient_checkpointing
            if policy in _LAYER_POLICIES and s is None and self.training and torch.is_grad_enabled():
                blocks, partial = _checkpointed(layer, blocks, partial, policy == "selective")
            else:
                blocks, partial = layer(blocks, partial, s, mixer)
        h = mixer(self.output_attn_res_norm, self.output_attn_res_proj, [*blocks, partial], self.config.rms_norm_eps,
                  self.norm)
        if state is not None:
            state.advance(input_ids.shape[1])
        return h

    def two_phase_mixer(self) -> TwoPhaseMixer:
        """Every mix of the model grouped by the closed blocks it sees (layer 0's attention pair is never read)."""
        S, L = self.config.attn_res_block_size, len(self.layers)
        pairs = [(closed_blocks_seen(i, S, "attn"), m.self_attention_res_norm, m.self_attention_res_proj)
                 for i, m in enumerate(self.layers) if i > 0]
        pairs += [(closed_blocks_seen(i, S, "mlp"), m.mlp_res_norm, m.mlp_res_proj) for i, m in enumerate(self.layers)]
        pairs.append((closed_blocks_seen(L, S, "output"), self.output_attn_res_norm, self.output_attn_res_proj))
        return TwoPhaseMixer(pairs)


def _can_sync(t: torch.Tensor) -> bool:
    """Whether a host read of ``t`` is allowed now (not meta, not traced by torch.compile, not a CUDA graph capture)."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def _qb_recording(layer: nn.Module, enabled: bool) -> Iterator[None]:
    """While not ``enabled`` (a checkpointed layer's recompute), the layer's MoE adds 0 to the QB histogram."""
    moe = getattr(layer, "block_sparse_moe", None)
    if moe is None or enabled:
        yield
        return
    moe.qb_count, moe.qb_zero = moe.qb_zero, moe.qb_count
    try:
        yield
    finally:
        moe.qb_count, moe.qb_zero = moe.qb_zero, moe.qb_count


# Selective checkpointing keeps what is expensive to recompute (matmuls, attention, k3's own kernels) and recomputes
# the cheap elementwise work (norms, gates, activations) around it.
_SAVED_OPS = {getattr(torch.ops.aten, n).default for n in (
    "mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention") if hasattr(torch.ops.aten, n)}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    save = op in _SAVED_OPS or getattr(op, "namespace", None) == "k3"
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(layer: K3DecoderLayer, blocks: list[torch.Tensor], partial: torch.Tensor, selective: bool = False
                  ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run ``layer`` under activation checkpointing; only the first call (not the backward recompute) feeds QB."""
    calls = [0]

    def run(blocks: list[torch.Tensor], partial: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        calls[0] += 1
        with _qb_recording(layer, calls[0] == 1):
            return layer(blocks, partial, None)

    if selective:
        return checkpoint(run, blocks, partial, use_reentrant=False, context_fn=_selective_context)
    return checkpoint(run, blocks, partial, use_reentrant=False)


class K3ForCausalLM(nn.Module):
    """Kimi K3 language model. See the module docstring for the data path and ``forward`` for the contract."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        if not isinstance(config, K3Config):
            raise ValueError(f"config must be a K3Config, got {type(config).__name__}")
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.lm_head.weight.device.type != "meta":  # meta tensors hold no values (and their init is slow)
            self.reset_parameters()
        self._cast(config.torch_dtype)

    # --- construction -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, initializer_range) for matrices and the embedding; ones for norm gains; zeros for the AttnRes
        pseudo-queries and the QB bias; A_log = 0 and dt_bias as in ``KimiDeltaAttention``; convs U(±1/√W)."""
        std = self.config.initializer_range
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.weight) if name.endswith("_res_proj") else nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()
            elif isinstance(m, GroupedExperts):
                for w in (m.w1, m.w3, m.w2):
                    nn.init.normal_(w, 0.0, std)
            elif isinstance(m, MoEGate):
                nn.init.normal_(m.weight, 0.0, std)
                m.e_score_correction_bias.zero_()
            elif isinstance(m, ShortConv):
                m.reset_parameters()
            elif isinstance(m, KimiDeltaAttention):
                m.reset_gate_parameters()

    def _cast(self, dtype: torch.dtype) -> None:
        for name, p in self.named_parameters():
            want = torch.float32 if keeps_fp32(name) else dtype
            if p.dtype != want:
                p.data = p.data.to(want)

    def gradient_checkpointing_enable(self, policy: bool | str = True) -> None:
        """Activation checkpointing of training forwards without a state: ``"full"`` (or True) recomputes each
        decoder layer in the backward, ``"selective"`` each layer but its matmul / attention / k3-kernel outputs,
        ``"experts"`` only the routed experts of every MoE layer (their expert-sorted rows, gate/up and SiTU-GLU
        outputs: top_k rows per token, the bulk of a layer's saved activations, recomputed from the latent z);
        ``"none"`` (or False) stores everything."""
        if isinstance(policy, bool):
            policy = "full" if policy else "none"
        if policy not in AC_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(AC_POLICIES)}, got {policy!r}")
        self.model.gradient_checkpointing = policy
        for moe in self.moe_layers():
            moe.recompute_experts = policy == "experts"

    def fuse_projections(self) -> None:
        """Serving: inference forwards run each layer's projections of one input as one GEMM (KDA's six input
        projections; the MoE's down projection with the shared experts' gate and up; a dense MLP's gate and up).
        Stacked copies of those weights, kept in step with them (``k3.layers.fused``); training is unaffected."""
        for layer in self.model.layers:
            for m in (layer.self_attn, layer.ffn):
                if hasattr(m, "fuse_projections"):
                    m.fuse_projections()

    def set_kda_impl(self, impl: str) -> None:
        """"auto" (chunk / fused-recurrent ops) or "reference" (fp32 token loop) for every KDA layer."""
        if impl not in ("auto", "reference"):
            raise ValueError(f"impl must be 'auto' or 'reference', got {impl!r}")
        for m in self.modules():
            if isinstance(m, KimiDeltaAttention):
                m.impl = impl

    # --- forward ------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                state: K3State | None = None, logits_to_keep: int = 0, targets: torch.Tensor | None = None
                ) -> K3Output:
        """``input_ids [B, T]`` integer → ``K3Output(logits [B, T, vocab], loss, state)``.

        ``labels [B, T]`` are aligned with ``input_ids`` (pass ``labels=input_ids`` for language modelling): the
        model shifts them inside, so position t is scored on ``labels[:, t+1]``; ``-100`` targets are ignored and the
        loss is the mean over the remaining ones (0 when there are none). On CUDA the loss comes from the fused
        linear + cross-entropy op (``k3.ops.loss``), which never holds the [B·T, vocab] logits: the returned
        ``logits`` are then computed only if read. ``state`` (from ``init_state``) makes the call continue the
        sequences it holds and is updated in place: one call, several pieces, or one token at a time give the same
        logits. ``logits_to_keep`` > 0: logits of the last that many positions only (a prefill needs one row of the
        vocabulary-wide projection, not T). ``targets [B, T]`` instead of ``labels``: position t is scored on
        ``targets[:, t]`` itself (already shifted, as a data loader's next tokens are; every position can be scored,
        and a sequence cut into slices across ranks needs nothing from its neighbours).
        """
        if labels is not None and targets is not None:
            raise ValueError("pass labels (shifted inside) or targets (already shifted), not both")
        B, T = self._check_inputs(input_ids, labels if targets is None else targets, state,
                                  "labels" if targets is None else "targets")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be a non-negative integer (0 = all), got {logits_to_keep!r}")
        if (labels is not None or targets is not None) and logits_to_keep:
            raise ValueError("logits_to_keep applies without labels only (the loss needs every position)")
        hidden = self.model(input_ids, state)
        if (labels is not None or targets is not None) and hidden.is_cuda:
            if targets is None:
                targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # the last position has no next token
            loss = linear_cross_entropy(hidden, self.lm_head.weight, targets, IGNORE_INDEX)
            return K3Output(loss=loss, state=state, hidden=hidden, lm_head=self.lm_head)
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = self.loss(logits, labels)
        elif targets is not None:
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
            loss = total / (targets != IGNORE_INDEX).sum().clamp(min=1)
        return K3Output(logits=logits, loss=loss, state=state)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy (fp32) of ``logits [B, T, V]`` against ``labels [B, T]`` shifted by one."""
        V = logits.shape[-1]
        targets = labels[:, 1:].reshape(-1)
        total = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), targets, ignore_index=IGNORE_INDEX,
                                reduction="sum")
        return total / (targets != IGNORE_INDEX).sum().clamp(min=1)

    def _check_inputs(self, input_ids: Any, labels: Any, state: Any, name: str = "labels") -> tuple[int, int]:
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"input_ids must be a torch.Tensor [B, T] of token ids, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor (int64/int32), got {input_ids.dtype}")
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with B, T >= 1, got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        V = self.config.vocab_size
        if _can_sync(input_ids):
            lo, hi = torch.aminmax(input_ids)
            if int(lo) < 0 or int(hi) >= V:
                raise ValueError(f"input_ids must lie in [0, vocab_size={V}), got values in [{int(lo)}, {int(hi)}]")
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
                raise ValueError(f"{name} must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got "
                                 f"{tuple(getattr(labels, 'shape', ())) or type(labels).__name__}")
            if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got {labels.dtype}")
            if _can_sync(labels):
                bad = ((labels < 0) | (labels >= V)) & (labels != IGNORE_INDEX)
                if bool(bad.any()):
                    raise ValueError(f"{name} must lie in [0, vocab_size={V}) or be {IGNORE_INDEX} (ignored), got "
                                     f"{labels[bad][0].item()}")
        if state is not None:
            if not isinstance(state, K3State) or len(state.layers) != len(self.model.layers):
                raise ValueError("state must be a K3State from this model's init_state(batch_size)")
            if state.batch_size != B:
                raise ValueError(f"state holds {state.batch_size} sequences but input_ids has batch size {B}")
            if state.device != input_ids.device:
                raise ValueError(f"state lives on {state.device} but input_ids on {input_ids.device}")
            if state.capacity is not None and state.position + T > state.capacity:
                raise ValueError(f"state holds at most {state.capacity} tokens per sequence (its MLA capacity); "
                                 f"{state.position} are cached and input_ids adds {T}: pass a larger capacity to "
                                 "init_state")
        return B, T

    # --- decode state ---------------------------------------------------------------------------------------------
    def init_state(self, batch_size: int, device: torch.device | str | None = None,
                   capacity: int | None = None) -> K3State:
        """Empty decode state for ``batch_size`` sequences (KDA: S + conv tails; MLA: latent caches of ``capacity``
        tokens per sequence, default ``config.max_seq_len``). It is a pool of ``batch_size`` rows bound to all of
        them (``k3.state``): ``model(ids, state=state)`` continues the sequences together."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        cap = self.config.max_seq_len if capacity is None else capacity
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"capacity must be a positive integer (tokens per sequence), got {capacity!r}")
        w = self.model.embed_tokens.weight
        device = w.device if device is None else torch.device(device)
        layers = []
        for layer in self.model.layers:
            mixer = layer.self_attn
            if isinstance(mixer, GatedMLA):
                layers.append(MLACache(batch_size, cap, mixer.cache_dim, w.dtype, device))
            else:
                layers.append(mixer.init_state(batch_size, dtype=w.dtype, device=device))
        has_mla = any(isinstance(s, MLACache) for s in layers)
        state = K3State(layers=layers, lengths=torch.zeros(batch_size, dtype=torch.int32, device=device),
                        slots=torch.arange(batch_size, device=device), capacity=cap if has_mla else None)
        state.bind(state.slots)
        return state

    # --- accounting -----------------------------------------------------------------------------------------------
    def moe_layers(self) -> list[LatentMoE]:
        return [m for m in self.modules() if isinstance(m, LatentMoE)]

    def num_parameters(self, active: bool = False) -> int:
        """All parameters (+ the QB bias buffers, as in the released checkpoint). ``active``: what one token uses —
        everything except the input embedding (kept when tied to lm_head), routed experts at top_k / n_experts."""
        total = sum(p.numel() for p in self.parameters())
        total += sum(b.numel() for n, b in self.named_buffers() if n.endswith("e_score_correction_bias"))
        if not active:
            return total
        if not self.config.tie_word_embeddings:
            total -= self.model.embed_tokens.weight.numel()
        for moe in self.moe_layers():
            e = moe.experts
            per_expert = sum(p.numel() for p in e.parameters()) // e.n_experts
            total -= per_expert * (e.n_experts - self.config.top_k)
        return total

    # --- Quantile Balancing -------------------------------------------------------------------------------------
    @torch.no_grad()
    def qb_step(self, group: "torch.distributed.ProcessGroup | None" = None) -> None:
        """Apply the QB histograms accumulated since the last call (all MoE layers, one all-reduce over ``group``),
        then reset them. Call once per optimizer step, on every rank."""
        moes = self.moe_layers()
        if not moes:
            return
        hists = [m.gate.histogram(m.gate.e_score_correction_bias.device) for m in moes]
        if group is not None:
            qb_all_reduce(hists, group)  # all layers packed into one collective
        for m, h in zip(moes, hists):
            m.gate.apply_histogram(h)
            h.zero_()

    def load_imbalance(self) -> float:
        """max / mean expert load of the last training forward, worst MoE layer (NaN before any)."""
        loads = [m.last_load.float() for m in self.moe_layers()]
        if not loads:
            return float("nan")
        L = torch.stack(loads)
        if not bool(L.sum(1).gt(0).any()):  # no training forward yet
            return float("nan")
        return float((L.max(1).values / L.mean(1).clamp(min=1e-9)).max())
