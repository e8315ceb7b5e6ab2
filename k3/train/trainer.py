"""The training loop behind ``k3 train``: set up a run (or resume one), train, checkpoint, plot, sample.

One optimizer step = ``grad_accum`` micro-batches → clip the gradient norm → optimizer step →
``model.qb_step()`` (Quantile Balancing applies the histograms that the step's training forwards accumulated) →
metrics. Everything a step depends on — weights and QB biases, optimizer state, RNG states, the data position —
is in the checkpoint, so a resumed run computes the same losses as an uninterrupted one (bit-exact on a CPU).

Parallel runs (``torchrun … -m k3 train --dp-shard/--dp-replicate/--ep/--cp``) and every GPU run go through
``k3.distributed``: the degrees are validated on every rank before anything else, the single-device model is
parallelized from outside (``parallelize_k3``: FSDP2 with bf16 compute and fp32 master weights, even on one GPU),
each rank trains on its part of the same global batch, and checkpoints are ``torch.distributed.checkpoint``
directories that any other layout resumes from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

import torch

from k3.ckpt.run import (
    MANIFEST,
    CheckpointError,
    assert_unlocked,
    find_checkpoint,
    load_checkpoint,
    load_trainer_state,
    lock_run,
    only_bookkeeping,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from k3.config import MAX_INT, K3Config
from k3.data import EMBEDDED, IGNORE, RecallLoader, RecallTask, WindowLoader, load_tokenizer, text_streams
from k3.data.loader import TokenStream, eval_windows
from k3.data.tokenizers import Tokenizer, tokenizer_from_dict
from k3.distributed.checkpoint import (is_distributed_checkpoint, load_distributed_checkpoint,
                                      save_distributed_checkpoint, shard_optimizer_state)
from k3.distributed.data_parallel import (Distributed, agree, destroy_distributed, init_distributed, local_batch,
                                          world_size_from_env)
from k3.distributed.master_weights import accumulate_grads
from k3.distributed.parallel_dims import ParallelDims
from k3.distributed.parallelize import AC_POLICIES, EXPERTS_AC_WITH_EP, parallelize_k3, sync_replicated_grads
from k3.infer.generate import generate, prompt_ids
from k3.memory import check_fits, training_footprint
from k3.model import K3ForCausalLM
from k3.train.graph import StepGraph, reshard
from k3.train.optim import SCHEDULES, build_optimizer, clipped_step, lr_factor, set_lr
from k3.train.plot import plot_loss
from k3.train.progress import Progress
from k3.utils import atomic_write_text, read_json

__all__ = ["TrainArgs", "TrainResult", "train", "prepare_args", "resolve_device", "cpu_threads", "default_lr",
           "compute_dtype", "parallel_dims", "evaluate_model", "Stepper", "use_cuda_graph", "RESUMABLE",
           "RECALL_EVAL_SEED"]

RECALL_EVAL_SEED = 20_250_707  # the recall task's evaluation stream: never the training stream, same for every run
# Flags that may differ when resuming without changing what the continued steps compute.
RESUMABLE = ("steps", "device", "threads", "activation_checkpointing", "compile", "cuda_graph", "log_every",
             "save_every", "keep", "eval_every", "eval_batches", "sample_tokens", "prompt", "out", "name", "plot",
             "force_memory", "dp_replicate", "dp_shard", "cp", "ep")  # the layout may change: checkpoints reshard
LAYOUT = ("dp_replicate", "dp_shard", "cp", "ep")
COMPILE = ("auto", "on", "off")
CUDA_GRAPH = ("auto", "on", "off")
# Upper bounds where a larger value cannot be meaningful (the CLI refuses it before any work).
_MOST = {"eval_batches": 1 << 20, "keep": 1 << 20, "max_tokens": 1 << 40}


@dataclass(kw_only=True)
class TrainArgs:
    """Every knob of a run; ``run.json`` records it so ``--resume`` and ``k3 eval`` rebuild the same setup."""

    preset: str = "tiny"
    config: str | None = None  # a K3Config JSON file (overrides the preset)
    task: str = "text"  # "text" or "recall"
    data: str = EMBEDDED  # "embedded", a file / directory / glob, or hf:NAME[:SPLIT]
    val_data: str | None = None
    text_field: str = "text"
    max_tokens: int = 0  # 0: all of the text data (hf: datasets: 10M tokens)
    tokenizer: str = "byte"
    steps: int = 400
    batch_size: int = 8  # the global batch: sequences per micro-batch over all data-parallel ranks
    seq_len: int = 64
    grad_accum: int = 1
    lr: float | None = None  # None: default_lr(config)
    min_lr_ratio: float = 0.1
    warmup: int = 10
    schedule: str = "cosine"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = "muon"
    seed: int = 0
    device: str = "auto"
    threads: int = 0  # CPU intra-op threads; 0 = auto (1 for tiny-class models, see cpu_threads)
    activation_checkpointing: str = "none"  # "full": recompute each layer in the backward; "selective": all but
    # the matmuls / attention / k3 kernels; "experts": the MoE layers' routed expert rows
    # (see K3ForCausalLM.gradient_checkpointing_enable)
    # torch.compile each decoder layer's sublayers: "auto" (on CUDA, for models wider than the tiny class, whose
    # short runs would spend more time compiling than it saves), "on", "off"
    compile: str = "auto"
    # the whole training step as one CUDA graph (k3.train.graph): "auto" (on one GPU), "on" (also under torchrun),
    # "off"
    cuda_graph: str = "auto"
    dp_replicate: int = 1  # parallel degrees (torchrun): see k3.distributed.parallel_dims
    dp_shard: int = -1
    cp: int = 1
    ep: int = 1
    out: str | None = None
    name: str | None = None
    log_every: int = 10
    save_every: int = 0  # 0: only at the end
    keep: int = 2
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    sample_tokens: int = 200
    prompt: str = "The "
    plot: bool = True
    force_memory: bool = False  # skip the memory estimate's refusal (k3.memory)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (the CLI turns it into one line, exit 2)."""
        if isinstance(self.activation_checkpointing, bool):  # run.json files that stored the on/off flag
            self.activation_checkpointing = "full" if self.activation_checkpointing else "none"
        self._check_types()
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "keep", "log_every", "eval_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name in ("warmup", "save_every", "eval_every", "sample_tokens", "seed", "threads", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a non-negative integer, got {v!r}")
        self._check_bounds()
        for name in ("lr", "grad_clip"):
            v = getattr(self, name)
            if name == "lr" and v is None:
                continue
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {v!r}")
        if not (isinstance(self.weight_decay, (int, float)) and 0 <= self.weight_decay < 1):
            raise ValueError(f"--weight-decay must be in [0, 1), got {self.weight_decay!r}")
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.task not in ("text", "recall"):
            raise ValueError(f"--task must be 'text' or 'recall', got {self.task!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"--optimizer must be 'adamw' or 'muon', got {self.optimizer!r}")
        if self.activation_checkpointing not in AC_POLICIES:
            raise ValueError(f"--activation-checkpointing must be one of {', '.join(AC_POLICIES)}, got "
                             f"{self.activation_checkpointing!r}")
        if self.activation_checkpointing == "experts" and isinstance(self.ep, int) and self.ep > 1:
            raise ValueError(EXPERTS_AC_WITH_EP)
        if self.compile not in COMPILE:
            raise ValueError(f"--compile must be one of {', '.join(COMPILE)}, got {self.compile!r}")
        if self.cuda_graph not in CUDA_GRAPH:
            raise ValueError(f"--cuda-graph must be one of {', '.join(CUDA_GRAPH)}, got {self.cuda_graph!r}")
        if self.name is not None and (not self.name or "/" in self.name or self.name in (".", "..")):
            raise ValueError(f"--name must be a plain directory name, got {self.name!r}")

    def _check_types(self) -> None:
        """Each field against its annotation (``run.json`` is a file: its values may be of any JSON type)."""
        kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
        for f in dataclasses.fields(self):
            v, kind = getattr(self, f.name), str(f.type)
            want = kinds[kind.split(" | ")[0]]
            if (v is None and "None" in kind) or (isinstance(v, want) and (want is bool or not isinstance(v, bool))):
                continue
            raise ValueError(f"--{f.name.replace('_', '-')} must be of type {kind}, got {str(v)[:40]!r}")

    def _check_bounds(self) -> None:
        """Values past which a number cannot mean anything (each count fits int32; a micro-batch's token count
        too, since kernels index it in int32; threads up to the CPUs there are)."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            most = _MOST.get(f.name, MAX_INT)
            if isinstance(v, int) and not isinstance(v, bool) and v > most:
                raise ValueError(f"--{f.name.replace('_', '-')} must be <= {most:,}, got {v:,}")
        if self.batch_size * self.seq_len > MAX_INT:
            raise ValueError(f"--batch-size × --seq-len must be <= {MAX_INT:,} tokens, got "
                             f"{self.batch_size * self.seq_len:,}")
        cpus = os.cpu_count() or 1
        if self.threads > cpus:
            raise ValueError(f"--threads must be <= {cpus} (the CPUs of this machine), got {self.threads:,}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown training argument(s) {unknown}")
        return cls(**d)


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    losses: list[float] = field(default_factory=list)  # the losses of the steps this call ran
    val_loss: float | None = None
    val_accuracy: float | None = None
    sample: str | None = None


# --- setup ----------------------------------------------------------------------------------------------------------
def resolve_device(device: str) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; anything else is checked."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} asked for CUDA but no GPU is visible; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


def compute_dtype(config: K3Config, device: torch.device) -> torch.dtype | None:
    """The precision policy: fp32 master weights and optimizer state everywhere; on CUDA the forward and backward
    run on ``config.dtype`` (bf16) weights — on several GPUs copies that FSDP2 casts once per layer and step, on one
    the parameters themselves, their fp32 masters beside them (``parallelize_k3``) — with no autocast. On the CPU
    everything is fp32 (None)."""
    return config.torch_dtype if device.type == "cuda" and config.dtype != "float32" else None


def _fp32_model(config: K3Config) -> torch.nn.Module:
    return K3ForCausalLM(config).float()  # master weights


def default_lr(config: K3Config) -> float:
    """Peak lr when ``--lr`` is not given: 1e-2 for tiny-class models (best of 3e-3…3e-2 for the default run, with
    Muon and AdamW alike), 2e-3 for larger ones (a conservative start; tune it)."""
    return 1e-2 if config.hidden_size <= 512 else 2e-3


@contextlib.contextmanager
def cpu_threads(device: torch.device, hidden_size: int, requested: int = 0) -> Iterator[None]:
    """Set torch's CPU intra-op threads for the duration (restored after).

    Auto (``requested == 0``): one thread for tiny-class models (hidden ≤ 512). Their ops take microseconds, so
    OpenMP's fork/join costs more than it saves, and on a busy machine spinning threads made a tiny step ~10×
    slower (measured on 2 cores). Larger models keep torch's default.
    """
    before = torch.get_num_threads()
    n = requested or (1 if hidden_size <= 512 else before)
    if device.type == "cpu" and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _new_run_dir(args: TrainArgs) -> Path:
    """The directory a fresh run writes to; refuses one that already holds files."""
    if args.out is not None:
        run_dir = Path(args.out)
    elif args.name is not None:
        run_dir = Path("runs") / args.name
    else:  # runs/tiny, runs/tiny-2, …: a second plain `k3 train` never collides with the first
        base = (Path(args.config).stem if args.config else args.preset) + ("-recall" if args.task == "recall" else "")
        run_dir, n = Path("runs") / base, 1
        while run_dir.exists() and any(run_dir.iterdir()):
            n += 1
            run_dir = Path("runs") / f"{base}-{n}"
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir} exists and is not a directory; choose another --out")
    _check_fresh(run_dir)
    return run_dir


def _check_fresh(run_dir: Path, locked: bool = False) -> bool:
    """Whether ``run_dir`` holds a run stopped before its first checkpoint (restarted in place); ``ValueError`` when
    it holds anything else or another process trains it (``locked``: we hold its lock); False when new or empty."""
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return False
    if not locked:
        assert_unlocked(run_dir)  # a run being trained: say so, rather than "not empty"
    if only_bookkeeping(run_dir):
        return True
    raise ValueError(f"run directory {run_dir} already exists and is not empty; pass --resume {run_dir} to "
                     "continue it, or choose another --out/--name")


def _model_config(args: TrainArgs, tok: Tokenizer) -> K3Config:
    """The preset (or --config file), with the vocabulary adapted to a non-byte tokenizer."""
    if args.config is not None:
        if not Path(args.config).is_file():
            raise ValueError(f"--config {args.config} is not a file; pass a K3Config JSON file")
        config = K3Config.from_json(Path(args.config))
        if tok.vocab_size > config.vocab_size:
            raise ValueError(f"--config vocab_size {config.vocab_size} is smaller than the tokenizer's "
                             f"{tok.vocab_size}; raise vocab_size in {args.config}")
        return config
    config = K3Config.from_preset(args.preset)
    if tok.vocab_size > config.vocab_size or (args.tokenizer != "byte" and tok.vocab_size != config.vocab_size):
        vocab = -(-tok.vocab_size // 64) * 64  # a multiple of 64 keeps the embedding GEMMs aligned
        config = K3Config.from_dict({**config.to_dict(), "vocab_size": vocab, "bos_token_id": tok.bos_id,
                                     "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id})
    return config


@dataclass
class _Data:
    loader: WindowLoader | RecallLoader
    val: TokenStream | None  # text task
    task: RecallTask | None  # recall task


def build_data(args: TrainArgs, tok: Tokenizer, config: K3Config) -> _Data:
    """Loaders for ``args`` (raises ``ValueError`` for empty or too-small data, before anything is written).

    Every rank draws the global batch (``batch_size`` rows) and keeps its part (``local_batch``)."""
    if args.seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {config.max_seq_len}")
    if args.task == "recall":
        if args.data != EMBEDDED:
            raise ValueError("--task recall generates its own data; drop --data")
        task = RecallTask.for_seq_len(args.seq_len, config.vocab_size, tok.bos_id)
        return _Data(RecallLoader(task, args.batch_size, args.seed), None, task)
    train, val = text_streams(args.data, tok, args.seq_len, args.val_data, args.text_field, args.max_tokens or None)
    return _Data(WindowLoader(train, args.batch_size, args.seq_len, args.seed), val, None)


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, data: _Data, args: TrainArgs, device: torch.device,
                   d: Distributed | None = None) -> dict[str, float]:
    """Validation loss (text) or recall loss + accuracy (recall) over ``args.eval_batches`` fixed batches.

    The model is put in eval mode (so Quantile Balancing is not fed) and restored afterwards. In a parallel run
    every rank scores its part of each batch and the sums are reduced over the data ranks."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, targets, correct, scored
    try:
        if data.task is not None:
            batches = (data.task.batch(args.batch_size, RECALL_EVAL_SEED, i) for i in range(args.eval_batches))
        else:
            assert data.val is not None
            batches = eval_windows(data.val, args.batch_size, args.seq_len, args.eval_batches)
        for x, y in batches:
            if d is not None:
                x, y = local_batch(x, d), local_batch(y, d)
            x, y = x.to(device), y.to(device)
            out = model(x, targets=y)
            n = (y != IGNORE).sum()
            sums[0] += out.loss * n
            sums[1] += n
            if data.task is not None:
                mask = y != IGNORE
                sums[2] += (out.logits.argmax(-1)[mask] == y[mask]).sum()
                sums[3] += mask.sum()
    finally:
        model.train(was_training)
    if d is not None and d.mesh is not None and d.dims.dp_cp > 1:
        torch.distributed.all_reduce(sums, group=d.group("dp_cp"))
    loss_sum, count, correct, scored = sums.tolist()
    out: dict[str, float] = {"val_loss": loss_sum / max(count, 1), "val_tokens": int(count)}
    out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
    if data.task is not None:
        out["val_accuracy"] = correct / max(scored, 1)
    return out


# --- resume -----------------------------------------------------------------------------------------------------------
def prepare_args(overrides: dict[str, Any], resume: str | None = None) -> tuple[TrainArgs, Path | None]:
    """Merge CLI flags with defaults (fresh run) or with the run's own ``run.json`` (``resume`` = a run dir).

    Returns ``(args, checkpoint dir to resume from or None)``. On resume, flags outside ``RESUMABLE`` must keep
    the run's values — anything else would silently make the continuation differ from the original run.
    """
    if resume is None:
        args = TrainArgs.from_dict(overrides)
        args.validate()
        # Absolute data paths: `k3 eval` / `--resume` must find the same data from any working directory.
        for name in ("data", "val_data"):
            v = getattr(args, name)
            if v is not None and v != EMBEDDED and not v.startswith("hf:"):
                setattr(args, name, os.path.abspath(v))
        return args, None
    p = Path(resume)
    assert_unlocked(p.parent.parent if (p / MANIFEST).is_file() else p)  # before any work: a live run is not ours
    ckpt = find_checkpoint(resume)
    # Read, not yet verified: every byte is verified once, under the run's lock, when the checkpoint is loaded.
    try:
        step = read_json(ckpt / MANIFEST, f"checkpoint {ckpt}: {MANIFEST}").get("step")
        saved = read_json(ckpt / "run.json", f"checkpoint {ckpt}: run.json")
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
        args = TrainArgs.from_dict(saved)
    except (ValueError, TypeError, AttributeError) as e:
        verify_checkpoint(ckpt)  # a damaged file: name it
        raise CheckpointError(f"checkpoint {ckpt}: run.json is unreadable ({e}); cannot resume") from None
    for k in LAYOUT:  # the layout belongs to the launch, not to the run: the checkpoint reshards to any other
        setattr(args, k, getattr(TrainArgs(), k))
    if "threads" not in overrides:  # the run's thread count, as far as this machine has CPUs
        args.threads = min(args.threads, os.cpu_count() or 1) if isinstance(args.threads, int) else args.threads
    for k, v in overrides.items():
        if k not in RESUMABLE and v != getattr(args, k):
            raise ValueError(f"--{k.replace('_', '-')} cannot change on --resume (the run used "
                             f"{getattr(args, k)!r}); start a new run instead")
        setattr(args, k, v)
    args.out = str(Path(resume) if (Path(resume) / "checkpoints").is_dir() else ckpt.parent.parent)
    args.validate()
    if isinstance(step, int) and args.steps <= step:
        raise ValueError(f"--steps {args.steps} must exceed the checkpoint's step {step} to continue; "
                         f"pass e.g. --steps {step + args.steps}")
    return args, ckpt


def _rewind_metrics(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint we resume from (a killed run may have logged further)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except (ValueError, AttributeError, TypeError, RecursionError):  # a line torn by a kill: drop it
            continue
    atomic_write_text(path, "".join(l + "\n" for l in keep))


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except (ValueError, RecursionError):
                continue
    return rows


# --- the loop -------------------------------------------------------------------------------------------------------
def train(args: TrainArgs, resume_from: Path | None = None, stdout: TextIO | None = None) -> TrainResult:
    """Run (or continue) training as ``args`` says. Raises ``ValueError`` on bad input before touching the disk."""
    args.validate()
    device = resolve_device(args.device)
    d = init_distributed(device, parallel_dims(args))
    out = stdout if stdout is not None else sys.stdout
    try:
        with contextlib.ExitStack() as stack:  # holds the thread setting, entered once the model size is known
            if not d.is_main:  # only rank 0 prints and writes; the others compute
                out = stack.enter_context(open(os.devnull, "w"))
            return _train(args, d, resume_from, out, stack)
    finally:
        destroy_distributed(d)


def parallel_dims(args: TrainArgs) -> ParallelDims:
    """The run's degrees against ``WORLD_SIZE``: validated on every rank before any collective, so a bad flag is
    the same one-line error on every rank and nobody waits for anybody."""
    return ParallelDims(dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, cp=args.cp, ep=args.ep,
                        world_size=world_size_from_env())


@dataclass
class _Session:
    """Everything one training process works with."""

    model: torch.nn.Module
    config: K3Config
    tok: Tokenizer
    data: _Data
    run_dir: Path
    start: int
    state: dict[str, Any] | None  # trainer.pt of the checkpoint resumed from
    ckpt: Path | None = None


def _memory(args: TrainArgs, config: K3Config, dims: ParallelDims) -> Any:
    """The memory one rank needs (``k3.memory.training_footprint``): its shard of the weights, gradients and
    optimizer state, and the activations of its rows and sequence slice."""
    return training_footprint(config, max(args.batch_size // dims.dp, 1), max(args.seq_len // dims.cp, 1),
                              args.optimizer, args.activation_checkpointing != "none",
                              shards=dims.dp_shard * dims.cp)


def _check_prompt(args: TrainArgs, tok: Tokenizer, config: K3Config) -> None:
    """The end-of-run sample's prompt, checked before any work (not after hundreds of steps)."""
    if not args.sample_tokens or args.task != "text":
        return
    try:
        n = len(prompt_ids(tok, args.prompt))
    except ValueError as e:  # UnicodeEncodeError for undecodable bytes in argv is a ValueError
        raise ValueError(f"--prompt cannot be encoded by the {tok.kind} tokenizer ({e}); fix --prompt or pass "
                         "--sample-tokens 0") from None
    if n + args.sample_tokens > config.max_seq_len:
        raise ValueError(f"--prompt ({n} tokens) + --sample-tokens {args.sample_tokens} exceeds the model's "
                         f"max_seq_len {config.max_seq_len}")


def _resume_session(args: TrainArgs, ckpt: Path, d: Distributed) -> _Session:
    footprint = lambda c: _memory(args, c, d.dims)  # noqa: E731
    if is_distributed_checkpoint(ckpt):  # the weights are loaded once the model is parallelized
        verify_checkpoint(ckpt)
        loaded = load_checkpoint_config(ckpt)
        check_fits(footprint(loaded["config"]), d.device, args.force_memory, config=loaded["config"])
        with torch.device(d.device):
            loaded["model"] = _fp32_model(loaded["config"])
    else:
        loaded = load_checkpoint(ckpt, device=d.device, model_factory=_fp32_model, force_memory=args.force_memory,
                                 footprint=footprint)
    _check_prompt(args, loaded["tokenizer"], loaded["config"])
    state = load_trainer_state(ckpt, force_memory=args.force_memory)
    start = int(state["step"])
    if args.steps <= start:
        raise ValueError(f"--steps {args.steps} must exceed the checkpoint's step {start} to continue; "
                         f"pass e.g. --steps {start + args.steps}")
    data = build_data(args, loaded["tokenizer"], loaded["config"])
    data.loader.load_state_dict(state["data"])
    return _Session(loaded["model"], loaded["config"], loaded["tokenizer"], data, Path(args.out), start, state, ckpt)


def load_checkpoint_config(ckpt: Path) -> dict[str, Any]:
    """Config and tokenizer of a verified checkpoint directory (without its weights)."""
    try:
        config = K3Config.from_dict(read_json(ckpt / "config.json", f"checkpoint {ckpt}: config.json"))
        spec = read_json(ckpt / "tokenizer_spec.json", f"checkpoint {ckpt}: tokenizer_spec.json")
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: config.json / tokenizer_spec.json unreadable ({e})") from None
    return {"config": config, "tokenizer": tokenizer_from_dict(spec, root=ckpt)}


def _fresh_session(args: TrainArgs, d: Distributed) -> _Session:
    run_dir = _new_run_dir(args)
    tok = load_tokenizer(args.tokenizer)
    config = _model_config(args, tok)
    _check_prompt(args, tok, config)
    check_fits(_memory(args, config, d.dims), d.device, args.force_memory, config=config,
               extra={"batch_size": args.batch_size, "seq_len": args.seq_len})
    data = build_data(args, tok, config)
    with torch.device(d.device):
        model = _fp32_model(config)  # same seed on every rank: identical initial weights
    return _Session(model, config, tok, data, run_dir, 0, None)


def _setup(args: TrainArgs, d: Distributed, resume_from: Path | None, stack: contextlib.ExitStack
           ) -> tuple[_Session, torch.optim.Optimizer]:
    """Session, parallelized model and optimizer (restored when resuming). Raises on every rank or on none."""
    def session() -> _Session:
        if resume_from is not None and d.is_main:  # one writer per run directory, from before the checkpoint is read
            stack.enter_context(lock_run(args.out))
        s = _resume_session(args, resume_from, d) if resume_from is not None else _fresh_session(args, d)
        d.dims.check_run(n_experts=s.config.n_experts if s.config.num_layers > s.config.first_k_dense else None,
                         seq_len=s.data.task.seq_len if s.data.task else args.seq_len, batch_size=args.batch_size)
        return s

    s = agree(session, d)
    compile_ = args.compile == "on" or (args.compile == "auto" and d.device.type == "cuda"
                                        and s.config.hidden_size > 512)
    parallelize_k3(s.model, d.dims, d.mesh, compile=compile_, activation_checkpointing=args.activation_checkpointing,
                   mixed_precision=compute_dtype(s.config, d.device))
    s.model.train()
    opt = build_optimizer(s.model, args.optimizer, args.lr or default_lr(s.config), args.weight_decay,
                          capturable=use_cuda_graph(args, d, s.config))
    if s.state is not None:
        assert s.ckpt is not None
        if is_distributed_checkpoint(s.ckpt):
            load_distributed_checkpoint(s.ckpt, s.model, opt, d)
        else:
            opt.load_state_dict(s.state["optimizer"])
            shard_optimizer_state(opt)  # a single-process checkpoint resumed by a sharded layout
            set_rng_state(s.state["rng"])
    return s, opt


def _train(args: TrainArgs, d: Distributed, resume_from: Path | None, out: TextIO,
           stack: contextlib.ExitStack) -> TrainResult:
    torch.manual_seed(args.seed)
    s, opt = _setup(args, d, resume_from, stack)
    stack.enter_context(cpu_threads(d.device, s.config.hidden_size, args.threads))

    # Nothing was written until here: every ValueError above leaves the disk as it was.
    run_args = {**args.to_dict(), "out": str(s.run_dir)}
    metrics_path = s.run_dir / "metrics.jsonl" if d.is_main else Path(os.devnull)

    def claim() -> None:  # under agree: a refused lock is one error on every rank, not a hang
        if d.is_main:
            if resume_from is None:
                _claim(s.run_dir, stack, out)
            atomic_write_text(s.run_dir / "run.json", json.dumps(run_args, indent=2) + "\n")
            atomic_write_text(s.run_dir / "config.json", s.config.to_json() + "\n")
            _rewind_metrics(metrics_path, s.start)

    agree(claim, d)
    out.write(_headline(args, s.config, s.model, s.tok, s.run_dir, s.start, d) + "\n")
    out.flush()

    save = _saver(s.run_dir, s.model, s.config, s.tok, opt, s.data, run_args, args.keep, d)
    result = TrainResult(run_dir=s.run_dir, step=args.steps)
    final = _loop(s, opt, args, d, metrics_path, save, out, result)
    ckpt = save(args.steps)
    result.val_loss, result.val_accuracy = final["val_loss"], final.get("val_accuracy")
    acc = f", recall accuracy {final['val_accuracy']:.1%}" if "val_accuracy" in final else ""
    out.write(f"k3: validation loss {final['val_loss']:.4f} (perplexity {final['val_ppl']:.2f}){acc}\n")
    if args.plot and d.is_main:
        _plot(s.run_dir, metrics_path)
    run = shlex.quote(str(s.run_dir))
    if args.sample_tokens and args.task == "text":
        if d.world_size == 1:  # a GPU run samples from its checkpoint: a plain model, not the FSDP-wrapped one
            model = s.model if d.mesh is None else load_checkpoint(ckpt, device=d.device)["model"]
            result.sample = _sample(model, s.tok, args, d.device, out)
        else:  # the decode loop is a one-process affair: sample from the checkpoint instead
            out.write(f"k3: sample: k3 generate --run {run} (decoding runs in one process)\n")
    nxt = (f"k3 eval --run {run}" if args.task == "recall" else
           f"k3 generate --run {run} --prompt {shlex.quote(args.prompt.strip() or 'The')}")
    out.write(f"k3: checkpoint in {s.run_dir}/checkpoints/step-{args.steps:08d}/ — next: {nxt}\n")
    out.flush()
    return result


def _claim(run_dir: Path, stack: contextlib.ExitStack, out: TextIO) -> None:
    """Take the writer lock of a fresh run's directory (held until training ends) and check, under the lock, that
    it is still new, empty, or a run stopped before its first checkpoint (whose log and plot are then reset)."""
    stack.enter_context(lock_run(run_dir))
    if _check_fresh(run_dir, locked=True) and any((run_dir / n).exists() for n in ("metrics.jsonl", "run.json")):
        out.write(f"k3: note: {run_dir} held a run stopped before its first checkpoint; starting it afresh\n")
        for name in ("metrics.jsonl", "loss.png"):
            (run_dir / name).unlink(missing_ok=True)


def _loop(s: _Session, opt: torch.optim.Optimizer, args: TrainArgs, d: Distributed, metrics_path: Path,
          save: Any, out: TextIO, result: TrainResult) -> dict[str, Any]:
    """Steps ``s.start+1 … args.steps``: one metrics line each (the last with the validation numbers)."""
    progress = Progress(args.steps, args.log_every, out, start=s.start)
    stepper = Stepper(s.model, opt, s.data, args, d)
    tokens_per_step = args.batch_size * args.grad_accum * (s.data.task.seq_len if s.data.task else args.seq_len)
    m: dict[str, Any] = {}
    try:
        with open(metrics_path, "a") as log:
            t_last = time.perf_counter()
            for step in range(s.start, args.steps):
                m = stepper(step)
                m["tok_per_s"] = tokens_per_step / max(time.perf_counter() - t_last, 1e-9)
                m["tokens"] = tokens_per_step * (step + 1)
                result.losses.append(m["loss"])
                done = step + 1
                if done == args.steps or (args.eval_every and done % args.eval_every == 0):
                    m.update(evaluate_model(s.model, s.data, args, d.device, d))
                    stepper.eager_forwards_done()
                log.write(json.dumps(m) + "\n")
                log.flush()
                progress.update(done, m["loss"], m["tok_per_s"], m["lr"], m.get("load_imbalance"))
                if args.save_every and done % args.save_every == 0 and done < args.steps:
                    save(done)
                t_last = time.perf_counter()  # eval/save time is not training throughput
    finally:
        progress.close()
    return m


def _headline(args: TrainArgs, config: K3Config, model: torch.nn.Module, tok: Tokenizer, run_dir: Path, start: int,
              d: Distributed) -> str:
    """``k3: training in runs/tiny/ — 4-layer tiny model, 0.40M params (0.27M active), …``"""
    verb = f"resuming from step {start}" if start else "training"
    name = "custom" if args.config else args.preset
    if args.task == "recall":
        data = "synthetic recall"
    else:
        data = "embedded corpus" if args.data == EMBEDDED else args.data
    dtype = compute_dtype(config, d.device)
    precision = ""
    if dtype is not None:
        graph = ", the step as one CUDA graph" if use_cuda_graph(args, d, config) else ""
        precision = f" ({str(dtype).removeprefix('torch.')} compute, fp32 master{graph})"
    return (f"k3: {verb} in {run_dir}/ — {config.num_layers}-layer {name} model, "
            f"{model.num_parameters() / 1e6:.2f}M params ({model.num_parameters(active=True) / 1e6:.2f}M active), "
            f"{args.task} task, {data}, {tok.kind} tokenizer, {args.optimizer}, {d.device.type}{precision}"
            + (f" × {d.world_size} ranks ({d.dims.describe()})" if d.world_size > 1 else ""))


def _device_step(model: torch.nn.Module, opt: torch.optim.Optimizer, args: TrainArgs, d: Distributed, task: bool,
                 x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The device work of one optimizer step on this rank's micro-batches ``x, y [grad_accum, B, T]`` (on the
    device): forward, backward, gradient clipping, optimizer, Quantile Balancing. Returns ``(sums, grad_norm)``:
    fp64 ``[loss sum, targets, correct, scored]`` reduced over the data ranks and the fp32 norm before clipping.

    Nothing here reads a value back to the host, so :class:`k3.train.graph.StepGraph` can capture it.

    Each rank's loss is its summed cross entropy divided by the global batch's mean per-rank target count, so the
    FSDP gradient average over the ranks is the gradient of the global batch's mean loss (exact with padding
    targets too)."""
    ranks = d.dims.dp_cp
    sums = torch.zeros(4, dtype=torch.float64, device=x.device)  # loss sum, targets, correct, scored
    params = list(model.parameters())
    for i in range(x.shape[0]):
        xi, yi = x[i], y[i]
        out = model(xi, targets=yi)  # on CUDA the fused linear + cross entropy: no [tokens, vocab] logits
        mask = yi != IGNORE
        n = mask.sum()
        total = out.loss * n  # this rank's summed cross entropy
        if task:  # before the backward: FSDP reshards the head's weight after it
            with torch.no_grad():
                sums[2] += ((out.logits.argmax(-1) == yi) & mask).sum()
            sums[3] += n
        n_all = n.float()
        if ranks > 1:
            torch.distributed.all_reduce(n_all, group=d.group("dp_cp"))
        (total * (ranks / (n_all.clamp(min=1) * x.shape[0]))).backward()
        if x.shape[0] > 1:  # one GPU's bf16 gradients: summed over the micro-batches in fp32, on their masters
            accumulate_grads(params)
        sums[0] += total.detach()
        sums[1] += n
    sync_replicated_grads(model)
    grad_norm = clipped_step(opt, params, args.grad_clip)
    opt.zero_grad(set_to_none=True)
    # once per optimizer step, histograms pooled over the ranks that saw different tokens: the bias from the next step
    model.qb_step(group=d.group("dp_cp") if ranks > 1 else None)
    if ranks > 1:
        torch.distributed.all_reduce(sums, group=d.group("dp_cp"))
    return sums, grad_norm


def use_cuda_graph(args: TrainArgs, d: Distributed, config: K3Config) -> bool:
    """Whether the step runs as a CUDA graph: ``--cuda-graph on``, or ``auto`` on one GPU. Only with bf16 compute:
    an fp32 or fp16 model's experts run a per-expert loop that reads its group sizes on the host (no grouped-GEMM
    kernel for those dtypes), which a graph cannot hold — ``on`` then raises ``ValueError``."""
    if args.cuda_graph == "off":
        return False
    possible = d.device.type == "cuda" and compute_dtype(config, d.device) == torch.bfloat16
    if args.cuda_graph == "on" and not possible:
        raise ValueError(f"--cuda-graph on needs a CUDA device and bf16 compute (this run: {d.device.type}, "
                         f"dtype {config.dtype}); use --cuda-graph auto or off")
    return possible and (args.cuda_graph == "on" or d.world_size == 1)


class Stepper:
    """``stepper(step) -> metrics`` for 0-based ``step``: sets the lr, draws the micro-batches, runs the device
    step (replayed from a CUDA graph when ``use_cuda_graph``; see ``k3.train.graph``) and reads its metrics back
    once."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, data: _Data, args: TrainArgs,
                 d: Distributed) -> None:
        self.model, self.opt, self.data, self.args, self.d = model, opt, data, args, d
        fn = functools.partial(_device_step, model, opt, args, d, data.task is not None)
        self.graph = StepGraph(fn) if use_cuda_graph(args, d, model.config) else None
        self._run = self.graph if self.graph is not None else fn

    def __call__(self, step: int) -> dict[str, Any]:
        args, d = self.args, self.d
        lr = set_lr(self.opt, lr_factor(step, args.steps, args.warmup, args.schedule, args.min_lr_ratio))
        batches = [self.data.loader.next_batch() for _ in range(args.grad_accum)]  # every rank draws the global batch
        x = torch.stack([local_batch(b[0], d) for b in batches]).to(d.device, non_blocking=True)
        y = torch.stack([local_batch(b[1], d) for b in batches]).to(d.device, non_blocking=True)
        sums, grad_norm = self._run(x, y)
        loss_sum, count, correct, scored = sums.tolist()
        m: dict[str, Any] = {"step": step + 1, "loss": loss_sum / max(count, 1), "lr": lr,
                             "grad_norm": float(grad_norm), "load_imbalance": self.model.load_imbalance()}
        if self.data.task is not None:
            m["accuracy"] = correct / max(scored, 1e-9)
        if not math.isfinite(m["loss"]):
            raise FloatingPointError(f"loss became {m['loss']} at step {step + 1}; lower --lr or raise --warmup")
        return m

    def eager_forwards_done(self) -> None:
        """Call after forwards outside the step (evaluation): with a captured step, FSDP must regather next time."""
        if self.graph is not None and self.graph.captured and self.d.mesh is not None:
            reshard(self.model)


def _saver(run_dir: Path, model: torch.nn.Module, config: K3Config, tok: Tokenizer, opt: torch.optim.Optimizer,
           data: _Data, run_args: dict[str, Any], keep: int, d: Distributed):  # noqa: ANN202 - a closure
    def save(step: int) -> Path:
        state = {"step": step, "rng": rng_state(), "data": data.loader.state_dict(),
                 "torch_version": str(torch.__version__)}
        if d.mesh is not None:  # every rank writes its shards
            return save_distributed_checkpoint(run_dir, step, model, opt, config, tok, state, run_args, keep, d)
        return save_checkpoint(run_dir, step, model, config, tok, {**state, "optimizer": opt.state_dict()},
                               run_args, keep=keep)

    return save


def _plot(run_dir: Path, metrics_path: Path) -> None:
    rows = _read_metrics(metrics_path)
    steps = [int(r["step"]) for r in rows]
    losses = [float(r["loss"]) for r in rows]
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if "val_loss" in r]
    plot_loss(run_dir / "loss.png", steps, losses, val)


def _sample(model: torch.nn.Module, tok: Tokenizer, args: TrainArgs, device: torch.device, out: TextIO) -> str:
    out.write(f"k3: sample ({args.sample_tokens} tokens, temperature 0.8, seed {args.seed}):\n")
    out.flush()
    text = generate(model, tok, args.prompt, max_new_tokens=args.sample_tokens, temperature=0.8, top_k=None,
                    top_p=0.95, seed=args.seed, stream=out, device=device, report=None)
    out.write("\n")
    return text
