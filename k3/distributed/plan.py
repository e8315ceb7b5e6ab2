"""``k3 plan``: per-GPU memory, FLOPs, bytes per collective and a step-time estimate for a model on N GPUs — for
training under FSDP2 × expert parallel × context parallel, or for serving the release (``--serve``).

Every number comes from stated assumptions (``Hardware``, printed with the result) and the model's own modules:
one decoder layer of each kind (KDA/MLA × dense MLP/MoE) is built on the ``meta`` device and its parameters are
counted by part, so the totals equal ``K3ForCausalLM(config).num_parameters()`` without allocating anything.

Training layout (torchtitan's, ``k3.distributed.parallel_dims``): world = dp_replicate · dp_shard · cp; ep is
borrowed from dp_shard · cp. Dense parameters are FSDP-sharded over dp_shard·cp, experts over ep (whole experts)
× dp_shard·cp/ep (FSDP), so the static bytes per GPU are P·(4 master + 4 grad + optimizer) / (dp_shard·cp) either
way; expert and context parallel change the activations, the transient unsharded layers and the traffic.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from k3.config import K3Config
from k3.model import K3DecoderLayer, keeps_fp32

__all__ = ["Hardware", "ModelStats", "Layout", "model_stats", "train_estimate", "serve_estimate", "search_layouts",
           "parse_bytes", "run_plan"]

GB = 1e9


# ------------------------------------------------------------------------------------------------ assumptions
@dataclass
class Hardware:
    """What the estimate assumes about one GPU and the network (defaults: H200 SXM nodes of 8 with NVLink 4 and
    one 400 Gb/s NIC per GPU)."""

    gpu_memory: float = 141 * GB  # bytes
    peak_tflops: float = 989.0  # dense bf16 tensor-core peak, TFLOP/s
    efficiency: float = 0.40  # achieved fraction of the peak on the executed FLOPs (recompute included)
    hbm_gbps: float = 4800.0  # GB/s
    nvlink_gbps: float = 450.0  # GB/s per GPU per direction inside a node
    net_gbps: float = 50.0  # GB/s per GPU per direction between nodes
    gpus_per_node: int = 8
    reserve: float = 4 * GB  # CUDA context, NCCL buffers, allocator fragmentation
    latency_us: float = 15.0  # per small collective (decode all-reduces)

    def lines(self) -> list[str]:
        return [f"GPU: {self.gpu_memory / GB:.0f} GB, {self.peak_tflops:.0f} TFLOP/s bf16 peak at "
                f"{self.efficiency:.0%} efficiency, HBM {self.hbm_gbps / 1000:.1f} TB/s; {self.gpus_per_node} GPUs "
                f"per node, NVLink {self.nvlink_gbps:.0f} GB/s, network {self.net_gbps:.0f} GB/s per GPU and "
                f"direction; {self.reserve / GB:.0f} GB reserved per GPU (CUDA context, NCCL, fragmentation)"]


# ------------------------------------------------------------------------------------------------ the model
@dataclass
class ModelStats:
    """Parameter counts by part (all layers) and the dimensions the estimates need."""

    config: Any
    parts: dict[str, int]  # part → parameters (the QB bias buffers counted, as num_parameters does)
    expert_params: int  # routed experts, all layers
    layer_dense: dict[str, int]  # layer kind → non-expert parameters of one layer
    layer_experts: int  # routed-expert parameters of one MoE layer
    matmul_active: int  # weight-matrix parameters one token multiplies with (experts at top_k/E), lm_head included
    fp32_kept: int  # parameters K3 keeps in fp32 (replicated, outside FSDP)
    muon: int  # parameters Muon orthogonalises (matrices; the rest take AdamW)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def active(self) -> int:
        c = self.config
        emb = 0 if c.tie_word_embeddings else self.parts["embedding"]
        return self.total - emb - self.expert_params * (c.n_experts - c.top_k) // c.n_experts

    @property
    def dense_params(self) -> int:
        return self.total - self.expert_params


def _kinds(config: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in range(config.num_layers):
        out.setdefault(f"{config.layer_type(i)}+{'moe' if config.is_moe(i) else 'mlp'}", []).append(i)
    return out


def _part(name: str) -> str:
    if ".experts." in name and ".shared_experts." not in name:
        return "routed experts"
    if ".shared_experts." in name:
        return "shared experts"
    if ".block_sparse_moe." in name:
        return "routers and latent projections"
    if ".self_attn." in name:
        return "attention (KDA / MLA)"
    if ".mlp." in name:
        return "dense MLP"
    return "norms and AttnRes"


def model_stats(config: Any) -> ModelStats:
    """Count parameters by part from one meta layer per kind (fast: nothing allocated, no init)."""
    c = config
    parts: dict[str, int] = {"embedding": c.vocab_size * c.hidden_size,
                             "lm_head": 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size,
                             "norms and AttnRes": 3 * c.hidden_size}  # final norm + output AttnRes pair
    layer_dense: dict[str, int] = {}
    layer_experts = 0
    matmul_active = parts["lm_head"] or parts["embedding"]
    fp32_kept = muon = 0
    expert_params = 0
    for kind, idx in _kinds(c).items():
        with torch.device("meta"):
            layer = K3DecoderLayer(c, idx[0])
        dense = experts = 0
        tensors = [*layer.named_parameters(),
                   *((n, b) for n, b in layer.named_buffers() if n.endswith("e_score_correction_bias"))]
        for name, t in tensors:
            n = t.numel()
            part = _part("." + name)
            parts[part] = parts.get(part, 0) + n * len(idx)
            if part == "routed experts":
                experts += n
                matmul_active += n * c.top_k // c.n_experts * len(idx)
            else:
                dense += n
                if t.dim() >= 2 and min(t.shape) > 1:
                    matmul_active += n * len(idx)
            if keeps_fp32(name):
                fp32_kept += n * len(idx)
            if isinstance(t, nn.Parameter) and t.dim() in (2, 3) and min(t.shape[-2:]) > 1:  # what Muon takes
                muon += n * len(idx)
        layer_dense[kind] = dense
        expert_params += experts * len(idx)
        layer_experts = max(layer_experts, experts)
    return ModelStats(config=c, parts=parts, expert_params=expert_params, layer_dense=layer_dense,
                      layer_experts=layer_experts, matmul_active=matmul_active, fp32_kept=fp32_kept, muon=muon)


# ------------------------------------------------------------------------------------------------ training
@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, float]  # bytes per GPU by part
    flops: float  # executed FLOPs per step, all GPUs
    model_flops: float  # 6·N·tokens + attention, all GPUs (no recompute)
    comm: dict[str, float]  # bytes received per GPU per step, by collective
    comm_s: dict[str, float]  # seconds per step, by collective
    compute_s: float
    step_s: float
    tokens: int
    fits: bool
    notes: list[str] = field(default_factory=list)

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())


def _attention_flops(c: Any, T: int) -> float:
    """Forward FLOPs per token of the sequence mixing beyond the projections (averaged over a causal sequence of T):
    MLA T·H·(n+r+v); KDA (chunks of 64) H·(6·K·V + 2·64·(K+V))."""
    mla = T * c.mla_num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    K = c.kda_head_dim
    kda = c.kda_num_heads * (6 * K * K + 2 * 64 * 2 * K)
    return len(c.mla_layers) * mla + len(c.kda_layers) * kda


def _layer_activations(c: Any, kind: str, n: int, ep: int) -> float:
    """Bytes one decoder layer's forward keeps for its backward on n tokens (bf16 activations, fp32 where K3
    computes in fp32), and what the backward adds while it runs (≈ the same again)."""
    d = c.hidden_size
    act = 6 * n * d * 2 + 2 * n * d * 4  # norms, AttnRes mixes (fp32 statistics), sublayer outputs
    if kind.startswith("kda"):
        P = c.kda_num_heads * c.kda_head_dim
        act += n * P * 32  # q k v g f projections, fp32 conv outputs, o, o_norm and gate in fp32
        act += 2 * math.ceil(n / 64) * c.kda_num_heads * c.kda_head_dim ** 2 * 4  # chunk states (+ their grads)
    else:
        H, qk, v = c.mla_num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        act += n * H * (2 * qk * 2 + v * (2 + 4 + 4)) + n * (c.kv_lora_rank + c.qk_rope_head_dim) * 2 * 2
    if kind.endswith("moe"):
        rows = n * c.top_k
        act += 2 * n * c.n_experts * 4  # router scores fp32 (+ biased)
        act += rows * c.latent_dim * 2 * (4 if ep > 1 else 2)  # permuted rows (+ sent / received buffers under EP)
        act += rows * c.expert_dim * 2 * 3  # W1 x, W3 x, SiTU-GLU
        act += rows * c.latent_dim * 2 * 2 + n * c.latent_dim * (2 + 4)  # expert outputs, combine
        act += n * c.shared_dim * 2 * 3 if c.n_shared_experts else 0
    else:
        act += n * c.dense_intermediate_size * 2 * 3
    return act * 2  # the backward's transients ≈ what the forward kept


def _group_bw(hw: Hardware, size: int, contiguous: bool = True) -> float:
    """Bytes/s a GPU gets in a collective over ``size`` ranks (NVLink inside a node, the NIC across nodes)."""
    return hw.nvlink_gbps * GB if contiguous and size <= hw.gpus_per_node else hw.net_gbps * GB


def _a2a_seconds(hw: Hardware, nbytes: float, size: int) -> float:
    """All-to-all among ``size`` contiguous ranks: the part of the bytes that stays inside a node over NVLink, the
    rest over the NIC."""
    if size <= 1:
        return 0.0
    intra = (min(size, hw.gpus_per_node) - 1) / (size - 1)
    return nbytes * (intra / (hw.nvlink_gbps * GB) + (1 - intra) / (hw.net_gbps * GB))


def train_estimate(ms: ModelStats, hw: Hardware, lay: Layout, seq_len: int, global_batch: int, micro_batch: int = 1,
                   checkpointing: str = "full", optimizer: str = "muon") -> Estimate:
    """Per-GPU memory, FLOPs, traffic and step time of one optimizer step (see ``run_plan``'s assumptions)."""
    c = ms.config
    shard = lay.dp_shard * lay.cp
    seqs_per_rank = global_batch // lay.dp
    accum = max(1, seqs_per_rank // micro_batch)
    n = micro_batch * seq_len // lay.cp  # tokens per GPU per micro-batch
    tokens = global_batch * seq_len
    P, Pd, Pe = ms.total, ms.dense_params, ms.expert_params
    sharded = P - ms.fp32_kept
    opt_bytes = 8.0 * P if optimizer == "adamw" else 4.0 * ms.muon + 8.0 * (P - ms.muon)
    mem = {"weights": 4.0 * sharded / shard + 4.0 * ms.fp32_kept,  # fp32 master shards (+ replicated fp32 parts)
           "gradients": 4.0 * sharded / shard + 4.0 * ms.fp32_kept,
           "optimizer": opt_bytes / shard}
    big = max(ms.layer_dense.values()) + ms.layer_experts / lay.ep
    mem["unsharded layers"] = 2 * big * 2 + big * 4  # bf16 params of this + the prefetched layer, fp32 grads of one
    if optimizer == "muon":  # Newton–Schulz on the largest gathered matrix: fp32, ~4 temporaries
        mat = max(c.hidden_size * c.kda_num_heads * c.kda_head_dim, c.expert_dim * c.latent_dim,
                  c.hidden_size * c.dense_intermediate_size)
        mem["optimizer"] += 4 * mat * 4
    kinds = _kinds(c)
    layer_act = {k: _layer_activations(c, k, n, lay.ep) for k in kinds}
    d = c.hidden_size
    n_blocks = math.ceil(c.num_layers / c.attn_res_block_size) + 1
    if checkpointing == "full":
        mem["activations"] = (c.num_layers + n_blocks) * n * d * 2 + max(layer_act.values())
    else:
        mem["activations"] = sum(layer_act[k] * len(i) for k, i in kinds.items()) + n_blocks * n * d * 2
    mem["logits"] = n * c.vocab_size * (2 + 4)  # bf16 logits + fp32 cross entropy
    mem["reserve"] = hw.reserve

    # FLOPs: forward = 2·(matmul params)·tokens + attention; backward 2×; full checkpointing recomputes the forward
    fwd = 2.0 * ms.matmul_active * tokens + 2.0 * _attention_flops(c, seq_len) * tokens
    model_flops = 3 * fwd
    flops = (4 if checkpointing == "full" else 3) * fwd
    compute_s = flops / lay.world / (hw.peak_tflops * 1e12 * hw.efficiency)

    # traffic per GPU per step (bytes received)
    passes = 3 if checkpointing == "full" else 2  # forward, backward (+ recompute) through the EP / CP collectives
    moe_layers = sum(len(i) for k, i in kinds.items() if k.endswith("moe"))
    m = shard // lay.ep  # the experts' FSDP degree
    comm = {
        "FSDP all-gather": accum * 2 * 2.0 * ((shard - 1) / shard * (Pd - ms.fp32_kept)
                                              + (m - 1) / m * Pe / lay.ep),
        "FSDP reduce-scatter": 4.0 * ((shard - 1) / shard * (Pd - ms.fp32_kept) + (m - 1) / m * Pe / lay.ep),
        "HSDP all-reduce": 2 * (lay.dp_replicate - 1) / lay.dp_replicate * 4.0 * sharded / shard,
        "EP all-to-all": accum * moe_layers * passes * 2 * n * c.top_k * c.latent_dim * 2.0 * (lay.ep - 1) / lay.ep,
        "CP all-gather": accum * passes * (lay.cp - 1) * micro_batch * (
            len(c.kda_layers) * c.kda_num_heads * c.kda_head_dim * 2 * c.kda_head_dim * 4
            + len(c.mla_layers) * (n // micro_batch) * (c.kv_lora_rank + c.qk_rope_head_dim) * 2),
    }
    comm_s = {
        "FSDP all-gather": comm["FSDP all-gather"] / _group_bw(hw, shard),
        "FSDP reduce-scatter": comm["FSDP reduce-scatter"] / _group_bw(hw, shard),
        "HSDP all-reduce": comm["HSDP all-reduce"] / hw.net_gbps / GB if lay.dp_replicate > 1 else 0.0,
        "EP all-to-all": _a2a_seconds(hw, comm["EP all-to-all"], lay.ep),
        "CP all-gather": comm["CP all-gather"] / _group_bw(hw, lay.cp),
    }
    fsdp_s = comm_s["FSDP all-gather"] + comm_s["FSDP reduce-scatter"] + comm_s["HSDP all-reduce"]
    step_s = compute_s + max(0.0, fsdp_s - compute_s) + comm_s["EP all-to-all"] + comm_s["CP all-gather"]
    est = Estimate(layout=lay, memory=mem, flops=flops, model_flops=model_flops, comm=comm, comm_s=comm_s,
                   compute_s=compute_s, step_s=step_s, tokens=tokens, fits=False)
    est.fits = est.total_memory <= hw.gpu_memory
    return est


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def layout_problem(c: Any, lay: Layout, gpus: int, seq_len: int, global_batch: int, micro_batch: int) -> str | None:
    """Why a layout cannot run (None when it can), naming the flag."""
    if lay.world != gpus:
        return (f"--dp-replicate {lay.dp_replicate} × --dp-shard {lay.dp_shard} × --cp {lay.cp} = {lay.world} "
                f"ranks, but --gpus is {gpus}")
    if seq_len % lay.cp:
        return f"--cp {lay.cp} must divide --seq-len ({seq_len})"
    if lay.ep > 1 and (lay.ep % lay.cp or (lay.dp_shard * lay.cp) % lay.ep):
        return f"--ep {lay.ep} must be a multiple of --cp {lay.cp} and divide --dp-shard × --cp"
    if c.n_experts % lay.ep:
        return f"--ep {lay.ep} must divide the model's n_experts ({c.n_experts})"
    if global_batch % (lay.dp * micro_batch):
        return (f"--global-batch {global_batch} must be a multiple of the data-parallel degree × --micro-batch "
                f"({lay.dp} × {micro_batch})")
    return None


def search_layouts(c: Any, gpus: int, seq_len: int, global_batch: int, micro_batch: int = 1,
                   fixed: dict[str, int | None] | None = None) -> list[Layout]:
    """Every valid layout on ``gpus`` (degrees given in ``fixed`` held)."""
    fixed = fixed or {}
    out = []
    for cp in _divisors(gpus):
        for rep in _divisors(gpus // cp):
            lay0 = Layout(dp_replicate=rep, dp_shard=gpus // cp // rep, cp=cp)
            for ep in _divisors(lay0.dp_shard * cp):
                lay = Layout(rep, lay0.dp_shard, cp, ep)
                if any(v is not None and getattr(lay, k) != v for k, v in fixed.items()):
                    continue
                if layout_problem(c, lay, gpus, seq_len, global_batch, micro_batch) is None:
                    out.append(lay)
    return out


# ------------------------------------------------------------------------------------------------ serving
@dataclass
class ServeEstimate:
    ep: int
    memory: dict[str, float]
    per_sequence: float  # KDA states + conv tails, bytes
    per_token: float  # MLA latent cache, bytes per token of context
    max_batch: int
    decode_s: float
    prefill_tok_s: float
    fits: bool


def serve_estimate(ms: ModelStats, hw: Hardware, gpus: int, batch: int, context: int, chunk: int = 8192
                   ) -> ServeEstimate:
    """The release on ``gpus`` GPUs: experts MXFP4 sharded over all of them (expert parallel, replicated tokens),
    the dense part bf16 on each; every GPU holds every sequence's state."""
    c = ms.config
    ep = gpus
    mx = 0.5 + 1 / 32  # MXFP4: 4-bit codes + one 8-bit scale per 32 weights
    per_seq = len(c.kda_layers) * (c.kda_num_heads * c.kda_head_dim ** 2 * 4
                                   + 3 * (c.kda_conv_size - 1) * c.kda_num_heads * c.kda_head_dim * 2)
    per_tok = len(c.mla_layers) * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    dense_b = {"bfloat16": 2, "float16": 2, "float32": 4}[c.dtype]
    mem = {"dense weights (bf16)": float(dense_b) * (ms.dense_params - ms.fp32_kept) + 4.0 * ms.fp32_kept,
           "experts (MXFP4)": mx * ms.expert_params / ep,
           "states": batch * (per_seq + context * per_tok),
           "prefill working set": max(_layer_activations(c, k, chunk, 1) for k in _kinds(c)) / 2,
           "reserve": hw.reserve}
    free = hw.gpu_memory - sum(v for k, v in mem.items() if k != "states")
    max_batch = max(0, int(free // (per_seq + context * per_tok)))
    # decode: memory-bound reads of the dense weights, the experts the batch touches, the states and caches
    E_local = c.n_experts / ep
    picks = batch * c.top_k / c.n_experts  # expected picks of one expert per layer
    touched = E_local * (1 - math.exp(-picks))
    moe_layers = sum(1 for i in range(c.num_layers) if c.is_moe(i))
    read = (mem["dense weights (bf16)"] + touched * moe_layers * ms.layer_experts / c.n_experts * mx * 1.0
            + batch * (2 * per_seq + context * per_tok))
    decode_s = read / (hw.hbm_gbps * GB) + moe_layers * hw.latency_us * 1e-6 * (ep > 1)
    prefill = 2.0 * ms.matmul_active + 2.0 * _attention_flops(c, chunk)
    prefill_tok_s = hw.peak_tflops * 1e12 * hw.efficiency / prefill
    return ServeEstimate(ep=ep, memory=mem, per_sequence=per_seq, per_token=per_tok, max_batch=max_batch,
                         decode_s=decode_s, prefill_tok_s=prefill_tok_s, fits=sum(mem.values()) <= hw.gpu_memory)


# ------------------------------------------------------------------------------------------------ the command
def parse_bytes(s: str, flag: str = "--gpu-memory") -> float:
    """``141GB`` / ``80GiB`` / ``141`` (GB) → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GB|GiB|TB|TiB|MB|MiB)?\s*", str(s), re.IGNORECASE)
    if not m:
        raise ValueError(f"{flag} must be a size like 141GB or 80GiB, got {s!r}")
    unit = (m.group(2) or "GB").lower()
    scale = {"gb": 1e9, "gib": 2**30, "tb": 1e12, "tib": 2**40, "mb": 1e6, "mib": 2**20}[unit]
    v = float(m.group(1)) * scale
    if not v > 0:
        raise ValueError(f"{flag} must be positive, got {s!r}")
    return v


def _g(b: float) -> str:
    return f"{b / GB:,.1f}"


def _human(n: float) -> str:
    for unit, v in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= v:
            return f"{n / v:.2f}{unit}"
    return f"{n:.0f}"


def _param_table(ms: ModelStats) -> list[str]:
    L = ["| part | parameters |", "|---|---:|"]
    for k, v in ms.parts.items():
        if v:
            L.append(f"| {k} | {v:,} |")
    L.append(f"| **total** | **{ms.total:,}** |")
    L.append(f"| active per token | {ms.active:,} |")
    return L


def _train_row(e: Estimate) -> str:
    lay = e.layout
    comm = e.comm
    return (f"| {lay.dp_replicate} | {lay.dp_shard} | {lay.cp} | {lay.ep} | {_g(e.memory['weights'] + e.memory['gradients'])}"
            f" | {_g(e.memory['optimizer'])} | {_g(e.memory['activations'] + e.memory['logits'])} | "
            f"{_g(e.memory['unsharded layers'])} | **{_g(e.total_memory)}** | {'yes' if e.fits else 'no'} | "
            f"{_g(comm['FSDP all-gather'] + comm['FSDP reduce-scatter'] + comm['HSDP all-reduce'])} | "
            f"{_g(comm['EP all-to-all'])} | {_g(comm['CP all-gather'])} | {e.step_s:.2f} | "
            f"{e.tokens / e.step_s / e.layout.world:,.0f} |")


_TRAIN_HEAD = ["| dp_rep | dp_shard | cp | ep | weights+grads GB | optimizer GB | activations GB | unsharded layers GB "
               "| total GB/GPU | fits | FSDP GB/step | EP a2a GB/step | CP GB/step | step s | tokens/s/GPU |",
               "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--:|---:|---:|---:|---:|---:|"]


def _train_assumptions(seq_len: int, global_batch: int, micro_batch: int, checkpointing: str, optimizer: str
                       ) -> list[str]:
    return [
        f"training: seq-len {seq_len}, global batch {global_batch} sequences ({global_batch * seq_len:,} tokens) "
        f"in micro-batches of {micro_batch} sequence(s) per data rank; activation checkpointing {checkpointing}; "
        f"{optimizer}",
        "memory: fp32 master weights and fp32 gradients FSDP-sharded over dp_shard·cp (experts: ep × the rest), "
        "the fp32-kept KDA gate/conv parameters replicated; optimizer AdamW 8 B/param, Muon 4 B/matrix param (AdamW "
        "for the rest) + Newton–Schulz temporaries of the largest matrix; two decoder layers unsharded in bf16 "
        "(current + prefetch) and one layer's fp32 gradients; activations: bf16, each layer's input kept "
        "(checkpointing) plus one layer's forward + backward working set (KDA chunk states, MoE rows and "
        "expert hidden states, EP buffers); bf16 logits + fp32 cross entropy",
        "FLOPs: forward = 2·(weight-matrix parameters a token multiplies, experts at top_k/E)·tokens + attention "
        "(MLA T·H·(n+r+v), KDA H·(6K² + 256K) per token); backward 2×; full checkpointing recomputes the forward",
        "traffic (bytes received per GPU): FSDP all-gathers bf16 in forward and backward per micro-batch, "
        "reduce-scatters fp32 once per step; EP moves each routed row there and back in every pass (forward, "
        "backward, recompute), balanced routing (no spill); CP all-gathers the KDA state summaries (fp32) and MLA "
        "latents (bf16) of the other ranks in every pass",
        "time: compute at the stated efficiency; FSDP traffic overlapped with compute (only its excess counts), EP "
        "and CP traffic on the critical path; collectives inside a node at NVLink speed, across nodes at the network "
        "speed (ranks laid out cp innermost, then ep)",
    ]


def run_plan(ns: Any, out: Any) -> int:
    """The ``k3 plan`` command (flags validated here: ``ValueError`` names the flag)."""
    if ns.config is not None:
        config = K3Config.from_json(ns.config)
        name = ns.config
    else:
        config = K3Config.from_preset(ns.preset)
        name = f"preset {ns.preset}"
    hw = Hardware(gpu_memory=parse_bytes(ns.gpu_memory))
    for key in ("peak_tflops", "efficiency", "hbm_gbps", "nvlink_gbps", "net_gbps"):
        v = getattr(ns, key, None)
        if v is not None:
            setattr(hw, key, v)
    if not 0 < hw.efficiency <= 1:
        raise ValueError(f"--efficiency must be in (0, 1], got {hw.efficiency}")
    if ns.gpus_per_node is not None:
        hw.gpus_per_node = ns.gpus_per_node
    ms = model_stats(config)
    c = config
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"k3 plan: {name} — {ms.total:,} parameters ({ms.active:,} active per token); {c.num_layers} layers "
      f"({len(c.kda_layers)} KDA, {len(c.mla_layers)} MLA), {c.n_experts} experts top-{c.top_k}, on {ns.gpus} GPUs")
    p("")
    p("\n".join(_param_table(ms)))
    p("")
    if ns.serve:
        return _run_serve(ms, hw, ns, p)
    return _run_train(ms, hw, ns, p)


def _check_degrees(c: Any, ns: Any) -> None:
    """Each given degree on its own (``ValueError`` naming the flag)."""
    for flag, v in (("--dp-replicate", ns.dp_replicate), ("--dp-shard", ns.dp_shard), ("--cp", ns.cp),
                    ("--ep", ns.ep)):
        if v is not None and ns.gpus % v and flag != "--ep":
            raise ValueError(f"{flag} {v} must divide --gpus ({ns.gpus})")
    if ns.cp is not None and ns.seq_len % ns.cp:
        raise ValueError(f"--cp {ns.cp} must divide --seq-len ({ns.seq_len})")
    if ns.ep is not None and c.n_experts % ns.ep:
        raise ValueError(f"--ep {ns.ep} must divide the model's n_experts ({c.n_experts})")


def _run_train(ms: ModelStats, hw: Hardware, ns: Any, p: Any) -> int:
    c = ms.config
    _check_degrees(c, ns)
    if ns.dp_shard is not None:  # the layout is given (degrees not named are 1)
        lay = Layout(ns.dp_replicate or 1, ns.dp_shard, ns.cp or 1, ns.ep or 1)
        problem = layout_problem(c, lay, ns.gpus, ns.seq_len, ns.global_batch, ns.micro_batch)
        if problem:
            raise ValueError(problem)
        layouts = [lay]
    else:
        fixed = {"dp_replicate": ns.dp_replicate, "cp": ns.cp, "ep": ns.ep}
        layouts = search_layouts(c, ns.gpus, ns.seq_len, ns.global_batch, ns.micro_batch, fixed)
        if not layouts:
            given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in fixed.items() if v is not None)
            raise ValueError(f"no layout of --gpus {ns.gpus} {given} runs --seq-len {ns.seq_len} with "
                             f"--global-batch {ns.global_batch} (it must be a multiple of the data-parallel degree)")
    ests = [train_estimate(ms, hw, lay, ns.seq_len, ns.global_batch, ns.micro_batch, ns.activation_checkpointing,
                           ns.optimizer) for lay in layouts]
    fit = sorted((e for e in ests if e.fits), key=lambda e: e.step_s)
    p("assumptions:")
    for line in hw.lines() + _train_assumptions(ns.seq_len, ns.global_batch, ns.micro_batch,
                                                ns.activation_checkpointing, ns.optimizer):
        p(f"- {line}")
    p("")
    shown = fit[:ns.top] if fit else sorted(ests, key=lambda e: e.total_memory)[:ns.top]
    p(f"{len(fit)} of {len(ests)} layouts fit; " + ("the fastest:" if fit else "none fits; the smallest:"))
    p("\n".join(_TRAIN_HEAD + [_train_row(e) for e in shown]))
    best = shown[0]
    p("")
    p(f"FLOPs per step: {_human(best.flops)} executed ({_human(best.model_flops)} model FLOPs, "
      f"MFU {best.model_flops / best.layout.world / best.step_s / (hw.peak_tflops * 1e12):.0%} at the estimated "
      f"step time); compute {best.compute_s:.2f} s, " +
      ", ".join(f"{k} {_g(v)} GB ({best.comm_s[k]:.2f} s)" for k, v in best.comm.items() if v))
    lay = best.layout
    p(f"launch: torchrun --nnodes {max(1, ns.gpus // hw.gpus_per_node)} --nproc_per_node "
      f"{min(ns.gpus, hw.gpus_per_node)} -m k3 train --preset {ns.preset} --dp-replicate {lay.dp_replicate} "
      f"--dp-shard {lay.dp_shard} --cp {lay.cp} --ep {lay.ep} --seq-len {ns.seq_len} "
      f"--batch-size {ns.global_batch}" + (" --activation-checkpointing" if ns.activation_checkpointing != "none"
                                           else ""))
    return 0


def _run_serve(ms: ModelStats, hw: Hardware, ns: Any, p: Any) -> int:
    c = ms.config
    if ns.dp_shard is not None or ns.cp is not None:
        raise ValueError("--serve places the experts over all --gpus (expert parallel); drop --dp-shard / --cp")
    if ns.ep is not None and ns.ep != ns.gpus:
        raise ValueError(f"--serve runs expert parallel over all GPUs: --ep must equal --gpus ({ns.gpus})")
    if c.n_experts % ns.gpus:
        raise ValueError(f"--gpus {ns.gpus} must divide the model's n_experts ({c.n_experts}) to serve expert-parallel")
    s = serve_estimate(ms, hw, ns.gpus, ns.batch, ns.context)
    p("assumptions:")
    for line in hw.lines() + [
            f"serving the release: experts MXFP4 (4.25 bits/weight) sharded over all {ns.gpus} GPUs, the dense part "
            "bf16 on every GPU (replicated tokens: each GPU holds every sequence's state); KDA state fp32 H·K·V per "
            "layer and sequence, MLA cache bf16 (kv_lora + rope) per layer and token; prefill in chunks of 8192 "
            "tokens",
            "decode: HBM-bound — dense weights, the experts the batch touches, states and caches read once per "
            "step, + one all-reduce latency per MoE layer; prefill: compute-bound at the stated efficiency"]:
        p(f"- {line}")
    p("")
    p("| GPUs (ep) | dense GB | experts GB | states GB | prefill GB | total GB/GPU | fits | KDA state MB/seq | "
      "MLA KB/token | max batch at this context | decode ms/step | decode tokens/s | prefill tokens/s/GPU |")
    p("|---:|---:|---:|---:|---:|---:|:--:|---:|---:|---:|---:|---:|---:|")
    m = s.memory
    p(f"| {ns.gpus} | {_g(m['dense weights (bf16)'])} | {_g(m['experts (MXFP4)'])} | {_g(m['states'])} | "
      f"{_g(m['prefill working set'])} | **{_g(sum(m.values()))}** | {'yes' if s.fits else 'no'} | "
      f"{s.per_sequence / 1e6:.0f} | {s.per_token / 1e3:.1f} | {s.max_batch} | {s.decode_s * 1e3:.1f} | "
      f"{ns.batch / s.decode_s:,.0f} | {s.prefill_tok_s:,.0f} |")
    p("")
    fitting = [g for g in _divisors(c.n_experts) if serve_estimate(ms, hw, g, ns.batch, ns.context).fits]
    if fitting:
        p(f"the fewest GPUs that fit batch {ns.batch} at {ns.context:,} tokens: {fitting[0]}")
    else:
        floor = m["dense weights (bf16)"] + m["reserve"] + m["prefill working set"] + m["states"]
        p(f"no GPU count fits: the replicated dense part with the reserve, prefill working set and states already "
          f"needs {_g(floor)} GB per GPU (> {_g(hw.gpu_memory)} GB); it would need the dense part sharded too "
          f"(tensor parallel, not implemented) or GPUs with more memory")
    p(f"batch {ns.batch}, context {ns.context:,} tokens per sequence; launch: torchrun --nproc_per_node "
      f"{min(ns.gpus, hw.gpus_per_node)} -m k3 generate --model PATH …")
    return 0
