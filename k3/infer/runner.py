"""The model runner: device-side serving state of one model, chunked prefill, and a CUDA-graph decode step.

gpt-fast's recipe for decode at the speed of memory, over a pool of slots:

- The runner owns every device buffer: the decode state pool (``K3State`` of ``max_batch + 1`` rows; the last row is
  scratch for padding), and per slot the last token, the sampling parameters (temperature, top-k, top-p, seed) and
  the sampling step. A decode step reads them by slot index on the device: the host passes slot numbers, never
  tokens or positions, and never reads anything back inside a step.
- ``decode(slots)`` pads the batch to a bucket (1, 2, 4, 8, …, ``max_batch``) with the scratch slot and replays the
  CUDA graph captured for that bucket and sampling mode (greedy / sample / filtered, chosen on the host from the
  parameters the host already knows). Inputs are validated at admission (``admit``/``prefill``), so the step calls
  ``model.model`` directly, without ``K3ForCausalLM``'s input checks (which read token ids on the host).
- ``prefill(slot, ids)`` runs a prompt in chunks (size from free memory and the model's widths, or given), carrying
  the KDA states, conv tails and MLA caches of the slot; only the last position goes through ``lm_head``; the first
  token is sampled on the device into the slot's last token.
- Results come back through :class:`Pending`: a pinned host copy and an event, so the caller can launch the next
  step before it looks at this one's tokens.

On CPU everything runs eagerly (same step function, no graphs).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Sequence

import torch

from k3.infer.sampling import SamplingParams, sample_tokens, sampling_mode
from k3.state import K3State

__all__ = ["ModelRunner", "Pending", "auto_prefill_chunk", "batch_buckets"]

_MODES = ("greedy", "sample", "filtered")


def _on_model_device(fn: Callable) -> Callable:
    """Run a runner method with the model's GPU current (launches, streams, events and graphs go to it)."""

    @functools.wraps(fn)
    def wrapper(self: "ModelRunner", *args: Any, **kwargs: Any) -> Any:
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            return fn(self, *args, **kwargs)

    return wrapper


class Pending:
    """Device int64 tokens on their way to the host: a pinned copy enqueued now, read by :meth:`tokens`."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens.clone()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def tokens(self) -> list[int]:
        """The tokens (waits for this copy only)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes with a captured graph each: powers of two below ``max_batch``, then ``max_batch``."""
    out = [1 << i for i in range(max(0, max_batch - 1).bit_length()) if (1 << i) < max_batch]
    return out + [max_batch]


def _activation_bytes_per_token(config) -> int:
    """A generous estimate of the activation bytes one prefill token holds at the peak of a forward (no grad):
    the AttnRes blocks and partial sums in the model dtype plus the largest sublayer's temporaries."""
    es = torch.finfo(config.torch_dtype).bits // 8
    d, hk = config.hidden_size, config.kda_num_heads * config.kda_head_dim
    blocks = (config.num_layers // config.attn_res_block_size + 3) * d * es
    mix = 4 * 8 * d  # fp32 AttnRes mix over a few sources at once
    kda = 6 * hk * es + 12 * hk * 4  # projections, conv and gate in fp32, the chunked op's per-token buffers
    qk, vd, h = config.mla_qk_head_dim, config.v_head_dim, config.mla_num_heads
    mla = h * (qk + 2 * vd) * 4 + (config.kv_lora_rank + config.qk_rope_head_dim) * 4 * 2
    rows = config.top_k * (2 * config.latent_dim + 3 * config.expert_dim) * es
    moe = rows + config.n_experts * 8 + 3 * config.shared_dim * es + 2 * d * 4
    dense = 3 * config.dense_intermediate_size * es
    return blocks + mix + max(kda, mla, moe, dense)


def auto_prefill_chunk(model: torch.nn.Module, device: torch.device, budget_bytes: int | None = None) -> int:
    """Prefill chunk length (tokens, a multiple of 64): what fits in ``budget_bytes`` of activations (default on
    CUDA: a quarter of the free memory, at most 4 GiB; on CPU 256 MiB), between 64 and 65,536. The working memory
    of a prefill is then this chunk's, whatever the prompt length.

    Long chunks matter on a GPU: from 32K tokens a KDA layer's prefill splits the sequence into segments that run
    side by side (``k3.ops.kda.prefix``), which one sequence of a few heads needs to fill the device (``small``'s
    all-KDA prefill of 131K tokens: 163 K tokens/s in chunks of 9,856 tokens, 552 K in chunks of 32,768)."""
    if budget_bytes is None:
        if device.type == "cuda":
            budget_bytes = min(4 << 30, torch.cuda.mem_get_info(device)[0] // 4)
        else:
            budget_bytes = 256 << 20
    # the estimate already holds the slack: the measured peak of ``small``'s prefill is about 0.7 of it
    per_token = _activation_bytes_per_token(model.config)
    return max(64, min(65536, budget_bytes // per_token // 64 * 64))


class ModelRunner:
    """Serving state of ``model`` on its device for up to ``max_batch`` concurrent sequences.

    ``capacity``: tokens per sequence (prompt + generated; default ``config.max_seq_len``, lowered when the MLA
    caches of the pool would take more than half the free device memory). ``prefill_chunk``: tokens per prefill
    forward (default :func:`auto_prefill_chunk`). ``cuda_graphs``: "auto" (capture on CUDA, fall back to eager with
    a warning if capture fails), True (capture or raise), False (eager). ``vocab_limit``: never sample ids ≥ it (the
    model's vocabulary is padded past the tokenizer's)."""

    def __init__(self, model: torch.nn.Module, max_batch: int = 8, capacity: int | None = None,
                 prefill_chunk: int | None = None, cuda_graphs: bool | str = "auto",
                 vocab_limit: int | None = None) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive integer (tokens), got {prefill_chunk!r}")
        if cuda_graphs not in (True, False, "auto"):
            raise ValueError(f"cuda_graphs must be True, False or 'auto', got {cuda_graphs!r}")
        self.model = model.eval()
        model.fuse_projections()  # a decode step is launch-bound: one GEMM per layer input where it can
        cfg = model.config
        self.device = model.model.embed_tokens.weight.device
        self.max_batch = max_batch
        self.scratch = max_batch  # pool row of padded batch entries
        P = max_batch + 1
        self.capacity = self._capacity(capacity, P)
        self.vocab_limit = min(cfg.vocab_size, vocab_limit or cfg.vocab_size)
        self.prefill_chunk = prefill_chunk or auto_prefill_chunk(model, self.device)
        with torch.no_grad():
            self.state: K3State = model.init_state(P, device=self.device, capacity=self.capacity)
        dev, i64 = self.device, torch.int64
        self.last_token = torch.zeros(P, dtype=i64, device=dev)
        self.temperature = torch.zeros(P, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(P, dtype=i64, device=dev)
        self.top_p = torch.ones(P, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(P, dtype=i64, device=dev)
        self.step = torch.zeros(P, dtype=i64, device=dev)
        self.buckets = batch_buckets(max_batch)
        self._slots = torch.full((max_batch,), self.scratch, dtype=i64, device=dev)  # the decode batch (static)
        self._out = torch.zeros(max_batch, dtype=i64, device=dev)
        self._scratch_idx = torch.tensor([self.scratch], dtype=i64, device=dev)
        self._bound: tuple[int, ...] | None = None  # slots now in self._slots (padded)
        self._params: dict[int, SamplingParams] = {}  # host copy of each admitted slot's parameters
        self._length = [0] * P  # host copy of each slot's cached tokens
        self.use_graphs = self.device.type == "cuda" and cuda_graphs is not False
        self._graphs_required = cuda_graphs is True
        self._graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    # --- sizes ------------------------------------------------------------------------------------------------------
    def _capacity(self, capacity: int | None, P: int) -> int:
        cfg = self.model.config
        if capacity is not None:
            if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
                raise ValueError(f"capacity must be a positive integer (tokens per sequence), got {capacity!r}")
            return capacity
        cap = cfg.max_seq_len
        n_mla = len(cfg.mla_layers)
        if self.device.type == "cuda" and n_mla:
            per_token = P * n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * (cfg.torch_dtype.itemsize)
            fit = torch.cuda.mem_get_info(self.device)[0] // 2 // per_token
            if fit < cap:
                cap = max(1, fit // 256 * 256)
                warnings.warn(f"k3: MLA caches of {P} slots at max_seq_len {cfg.max_seq_len} do not fit in half the "
                              f"free memory: capacity lowered to {cap} tokens per sequence", stacklevel=3)
        return cap

    def length(self, slot: int) -> int:
        """Tokens cached in ``slot`` (host bookkeeping; no device read)."""
        return self._length[slot]

    # --- admission ---------------------------------------------------------------------------------------------------
    @_on_model_device
    def admit(self, slot: int, params: SamplingParams, seed: int) -> None:
        """Start a new sequence in ``slot``: empty its state, store its sampling parameters (device writes only)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_batch:
            raise ValueError(f"slot must be an integer in [0, {self.max_batch}), got {slot!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ints = _to_device(torch.tensor([slot, params.top_k, int(seed) % (1 << 63)], dtype=torch.int64), self.device)
        floats = _to_device(torch.tensor([params.temperature, params.top_p], dtype=torch.float32), self.device)
        idx = ints[:1]
        with torch.no_grad():
            self.state.reset(idx)
            self.top_k.index_copy_(0, idx, ints[1:2])
            self.seed.index_copy_(0, idx, ints[2:3])
            self.temperature.index_copy_(0, idx, floats[:1])
            self.top_p.index_copy_(0, idx, floats[1:2])
            self.step.index_fill_(0, idx, 0)
        self._params[slot] = params
        self._length[slot] = 0

    # --- prefill ------------------------------------------------------------------------------------------------------
    @_on_model_device
    @torch.no_grad()
    def prefill(self, slot: int, ids: torch.Tensor | Sequence[int], last: bool = True) -> Pending | None:
        """Feed prompt tokens ``ids`` to ``slot`` (admitted). With ``last``, the prompt is complete: the first
        generated token is sampled into the slot (its last position alone goes through ``lm_head``) and returned as
        a :class:`Pending`."""
        return self.prefill_batch([slot], [ids], last)

    @_on_model_device
    @torch.no_grad()
    def prefill_batch(self, slots: Sequence[int], pieces: Sequence[torch.Tensor | Sequence[int]],
                      last: bool = True) -> Pending | None:
        """:meth:`prefill` of several slots in one forward per chunk: ``pieces[i]`` (all of one length) goes to
        ``slots[i]``. With ``last``, one first token per slot, in ``slots`` order."""
        hidden = self._feed(slots, pieces)
        if not last:
            return None
        idx = self._slots_index(slots)
        nxt = self._sample(self.model.lm_head(hidden), idx, sampling_mode([self._params[s] for s in slots]))
        self.last_token.index_copy_(0, idx, nxt)
        return Pending(nxt)

    @_on_model_device
    @torch.no_grad()
    def warmup(self) -> None:
        """One prefill of a full chunk and a short tail on the scratch row (emptied after), so that the first
        request does not pay for compiling and tuning the prefill kernels at the chunk's shapes (on a GPU, seconds:
        KDA's split prefill alone compiles its kernels on first use)."""
        s = self.scratch
        self._params[s], self._length[s] = SamplingParams(max_tokens=1, temperature=0), 0
        try:
            self._feed([s], [torch.zeros(min(self.capacity, self.prefill_chunk + 17), dtype=torch.int64)])
        finally:
            del self._params[s]
            self._length[s] = 0
            self.state.reset(self._scratch_idx)

    @_on_model_device
    @torch.no_grad()
    def feed(self, slot: int, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Run prompt tokens through ``slot`` in chunks of ``prefill_chunk`` (each chunk continues the KDA states,
        conv tails and MLA cache of the one before; working memory is one chunk's); returns the final-normed hidden
        state of the last token, ``[1, d]``."""
        return self._feed([slot], [ids])

    def _feed(self, slots: Sequence[int], pieces: Sequence[torch.Tensor | Sequence[int]]) -> torch.Tensor:
        """``pieces`` through ``slots`` as the rows of one batch, ``prefill_chunk`` tokens per forward in all (each
        row keeps its own position: the KDA state, conv tail and MLA cache of its slot) → ``[B, d]``."""
        if not slots or len(set(slots)) != len(slots) or len(pieces) != len(slots):
            raise ValueError(f"slots must be distinct, one per piece: got {list(slots)} for {len(pieces)} pieces")
        for slot in slots:
            if slot not in self._params:
                raise ValueError(f"slot {slot} was not admitted")
        rows = [self._checked_ids(ids, self._length[slot]) for slot, ids in zip(slots, pieces)]
        T = rows[0].shape[0]
        if T == 0:
            raise ValueError("ids must hold at least one token")
        if any(r.shape[0] != T for r in rows):
            raise ValueError(f"pieces must have one length, got {[r.shape[0] for r in rows]}")
        ids = torch.stack(rows)
        idx = self._slots_index(slots)
        step = max(1, self.prefill_chunk // len(rows))
        for a in range(0, T, step):
            self.state.bind(idx)
            hidden = self.model.model(ids[:, a:a + step], self.state)
        for slot in slots:
            self._length[slot] += T
        return hidden[:, -1]

    def _slots_index(self, slots: Sequence[int]) -> torch.Tensor:
        return _to_device(torch.tensor(list(slots), dtype=torch.int64), self.device)

    def _checked_ids(self, ids: torch.Tensor | Sequence[int], cached: int) -> torch.Tensor:
        """Validated prompt ids as a 1-D int64 device tensor (checked on the host, before anything runs)."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
            lo, hi = (int(v) for v in torch.aminmax(ids)) if ids.numel() else (0, 0)
        else:
            ids = list(ids)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError("ids must be integers")
            lo, hi = (min(ids), max(ids)) if ids else (0, 0)
            ids = torch.tensor(ids, dtype=torch.int64)
        if lo < 0 or hi >= self.model.config.vocab_size:
            raise ValueError(f"ids must lie in [0, {self.model.config.vocab_size}), got values in [{lo}, {hi}]")
        if cached + ids.shape[0] > self.capacity:
            raise ValueError(f"{cached + ids.shape[0]} tokens exceed the runner's capacity of {self.capacity} per "
                             "sequence")
        return _to_device(ids.to(torch.int64), self.device)

    # --- decode ----------------------------------------------------------------------------------------------------
    @_on_model_device
    @torch.no_grad()
    def decode(self, slots: Sequence[int]) -> Pending:
        """One token for each of ``slots`` (distinct, admitted, prefilled): feeds each slot's last token, samples
        the next into it. Returns the new tokens (in ``slots`` order) as a :class:`Pending`."""
        B = len(slots)
        if not 1 <= B <= self.max_batch or len(set(slots)) != B:
            raise ValueError(f"slots must be 1 to {self.max_batch} distinct slots, got {list(slots)}")
        for s in slots:
            if s not in self._params or self._length[s] == 0:
                raise ValueError(f"slot {s} has no prefilled sequence")
            if self._length[s] + 1 > self.capacity:
                raise ValueError(f"slot {s} is full ({self.capacity} tokens)")
        b = next(x for x in self.buckets if x >= B) if self.use_graphs else B
        mode = sampling_mode([self._params[s] for s in slots])
        graph = self._graph(b, mode) if self.use_graphs else None
        self._bind_batch(tuple(slots) + (self.scratch,) * (b - B))
        if graph is not None:
            graph.replay()
        else:
            self._step(b, mode)
        for s in slots:
            self._length[s] += 1
        return Pending(self._out[:B])

    def _bind_batch(self, padded: tuple[int, ...]) -> None:
        """Write the batch's slots into the static buffer (skipped when unchanged: the common steady state)."""
        if padded != self._bound:
            self._slots[:len(padded)].copy_(_to_device(torch.tensor(padded, dtype=torch.int64), self.device))
            self._bound = padded

    def _step(self, b: int, mode: str) -> None:
        """The decode step over ``self._slots[:b]``: device work only, static shapes (captured as is)."""
        slots = self._slots[:b]
        self.state.bind(slots)
        hidden = self.model.model(self.last_token.index_select(0, slots).view(b, 1), self.state)
        nxt = self._sample(self.model.lm_head(hidden[:, -1]), slots, mode)
        self.last_token.index_copy_(0, slots, nxt)
        self.state.lengths.index_fill_(0, self._scratch_idx, 0)  # padding never fills the scratch row's cache
        self._out[:b].copy_(nxt)

    def _sample(self, logits: torch.Tensor, slots: torch.Tensor, mode: str) -> torch.Tensor:
        """Next tokens of the rows ``slots``; a sampling mode also advances their random streams' step."""
        logits = logits[:, :self.vocab_limit]
        if mode == "greedy":  # no parameter or random stream is read (greedy requests never sample)
            return logits.argmax(-1)
        steps = self.step.index_select(0, slots)
        nxt = sample_tokens(logits, self.temperature.index_select(0, slots), self.top_k.index_select(0, slots),
                            self.top_p.index_select(0, slots), self.seed.index_select(0, slots), steps, mode)
        self.step.index_copy_(0, slots, steps + 1)
        return nxt

    # --- CUDA graphs ------------------------------------------------------------------------------------------------
    def _graph(self, b: int, mode: str) -> torch.cuda.CUDAGraph | None:
        """The graph of bucket ``b`` and sampling ``mode``, captured on first use (None: eager after a failure)."""
        key = (b, mode)
        if key not in self._graphs and self.use_graphs:
            try:
                self._graphs[key] = self._capture(b, mode)
            except Exception as e:  # noqa: BLE001 — "auto": keep serving eagerly, say why once
                if self._graphs_required:
                    raise
                warnings.warn(f"k3: CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly",
                              stacklevel=3)
                self.use_graphs = False
                self._graphs.clear()
                torch.cuda.synchronize(self.device)
        return self._graphs.get(key)

    @_on_model_device
    def capture_all(self, modes: Sequence[str] = _MODES) -> None:
        """Capture every bucket's graph now (largest first, so the smaller ones reuse its memory)."""
        if not self.use_graphs:
            return
        with torch.no_grad():
            for b in sorted(self.buckets, reverse=True):
                for mode in modes:
                    self._graph(b, mode)

    def _capture(self, b: int, mode: str) -> torch.cuda.CUDAGraph:
        """Warm up (JIT compiles, allocator) then capture ``_step(b, mode)`` on the scratch slot only."""
        self._bind_batch((self.scratch,) * self.max_batch)
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):
                self._step(b, mode)
        torch.cuda.current_stream(self.device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(b, mode)
        torch.cuda.synchronize(self.device)
        return graph

    def memory_bytes(self) -> int:
        """Device bytes of the decode state pool (KDA states, conv tails, MLA caches)."""
        return self.state.nbytes()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync (pinned staging, asynchronous copy)."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
