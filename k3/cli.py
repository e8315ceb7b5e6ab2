"""The ``k3`` command: argument parsing only; each subcommand calls into ``k3.train``, ``k3.infer``, ``k3.ckpt``.

    k3 train      [--preset tiny] [--data embedded|PATH|hf:NAME] [--steps N] … (see ``k3 train --help``)
    k3 generate   --run DIR | --model PATH  [--prompt TEXT] [--max-new-tokens N] [--temperature T] …
    k3 eval       --run DIR [--batches N]
    k3 serve      --run DIR | --model PATH  [--host 127.0.0.1] [--port 8000] [--max-batch N] …
    k3 tokenize   FILES… --out shard.bin [--tokenizer SPEC]
    k3 plan       --gpus N [--preset k3] [--gpu-memory 141GB] [--dp-shard/--ep/--cp N] [--serve] …

A user mistake (bad flag value, missing or corrupt run directory, empty data, a model too large for the device, …)
prints ONE line ``k3: error: <what is wrong>; <what to do>`` on stderr and exits with status 2, before anything on
disk changes. Anything unexpected prints one line naming the exception and the file holding its full traceback,
and exits with status 1.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn, Sequence

import numpy as np
import torch
import torch.distributed as dist

from k3 import __version__
from k3.ckpt.released import load_pretrained
from k3.ckpt.run import load_checkpoint
from k3.data import k3_tokenizer
from k3.data.files import load_tokens, write_bin_shard
from k3.data.tokenizers import load_tokenizer
from k3.distributed.data_parallel import world_size_from_env
from k3.distributed.plan import run_plan
from k3.distributed.release import load_released_distributed
from k3.infer.evaluate import evaluate_run
from k3.infer.generate import generate
from k3.model import AC_POLICIES
from k3.train.trainer import cpu_threads, prepare_args, resolve_device, train

__all__ = ["main", "build_parser"]

EXIT_USAGE = 2
EXIT_FAILURE = 1
MAX_INT = 2**31 - 1  # no count k3 takes means anything past int32 (k3.config.MAX_INT; not imported: startup speed)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse's own prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _int(s: str, what: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s[:40]!r}") from None
    if v > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_INT:,}, got {s[:40]}")
    return v


def _positive_int(s: str) -> int:
    v = _int(s, "a positive integer")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def _nonneg_int(s: str) -> int:
    v = _int(s, "a non-negative integer")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _shard_degree(s: str) -> int:
    v = _int(s, "a positive integer or -1")
    if v <= 0 and v != -1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or -1 (fill the world), got {v}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s}")
    return v


_FORCE_HELP = ("build the model even when k3's memory estimate says it cannot fit the device (the estimate is a "
               "lower bound, so this rarely helps)")


def _add_train(sub: Any) -> None:
    p = sub.add_parser(
        "train", help="train a model (default: preset tiny on the embedded corpus, ~1 minute on a CPU)",
        description="Train K3 from scratch or continue a run. With no flags: preset 'tiny' on the embedded corpus "
        "(CPython's own documentation), on the GPU if there is one, else the CPU. Flags not given keep their "
        "defaults (or, with --resume, the run's own values).",
        argument_default=argparse.SUPPRESS)
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", help="model preset: tiny (default), small, k3, k3-linear")
    g.add_argument("--config", metavar="FILE.json", help="K3Config JSON file (instead of --preset)")
    g.add_argument("--task", choices=["text", "recall"], help="text (default) or the synthetic recall task")
    g.add_argument("--data", metavar="SRC", help="'embedded' (default), a .txt/.jsonl/.parquet/.bin file, a "
                   "directory or glob of them, or hf:NAME[:SPLIT] (needs the network and `pip install k3[hf]`)")
    g.add_argument("--val-data", metavar="SRC", help="held-out data (default: the last 1%% of --data)")
    g.add_argument("--text-field", metavar="NAME", help="field/column holding the text in .jsonl/.parquet "
                   "(default: text)")
    g.add_argument("--max-tokens", type=_nonneg_int, metavar="N", help="tokenize at most about N tokens of text "
                   "data (default: all; hf: datasets 10M)")
    g.add_argument("--tokenizer", metavar="SPEC", help="'byte' (default), a tiktoken BPE file (tiktoken.model), "
                   "a Hugging Face tokenizer.json, or a directory holding one")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=_positive_int, metavar="N", help="optimizer steps (default 400)")
    g.add_argument("--batch-size", type=_positive_int, metavar="N", help="sequences per micro-batch (default 8)")
    g.add_argument("--seq-len", type=_positive_int, metavar="N", help="tokens per sequence (default 64)")
    g.add_argument("--grad-accum", type=_positive_int, metavar="N", help="micro-batches per optimizer step (default 1)")
    g.add_argument("--lr", type=_positive_float, metavar="X", help="peak learning rate (default 1e-2 for tiny-class models, "
                   "2e-3 for larger ones)")
    g.add_argument("--min-lr-ratio", type=float, metavar="X", help="final lr / peak lr (default 0.1)")
    g.add_argument("--warmup", type=_nonneg_int, metavar="N", help="linear warmup steps (default 10)")
    g.add_argument("--schedule", choices=["cosine", "wsd", "constant"], help="lr schedule after warmup "
                   "(default cosine)")
    g.add_argument("--optimizer", choices=["adamw", "muon"], help="muon (default: Newton-Schulz orthogonalised "
                   "momentum for matrices, AdamW for the rest) or adamw")
    g.add_argument("--weight-decay", type=float, metavar="X", help="decoupled weight decay (default 0.1)")
    g.add_argument("--grad-clip", type=_positive_float, metavar="X", help="max gradient norm (default 1.0)")
    g.add_argument("--seed", type=_nonneg_int, metavar="N", help="seed of the initialisation and the data order (default 0)")
    g.add_argument("--device", help="auto (default: cuda if available), cpu, cuda, cuda:N")
    g.add_argument("--threads", type=_nonneg_int, metavar="N", help="CPU threads (default 0 = auto: 1 for tiny-class models, "
                   "whose ops are too small to split)")
    g.add_argument("--activation-checkpointing", nargs="?", const="full", choices=AC_POLICIES,
                   metavar="POLICY", help="recompute activations in the backward pass: full (the flag alone: each "
                   "whole layer), selective (all but matmul/attention outputs), experts (the MoE layers' routed "
                   "expert rows) or none (default)")
    g.add_argument("--compile", choices=["auto", "on", "off"], help="torch.compile each decoder layer (default auto: "
                   "on CUDA for models wider than tiny)")
    g.add_argument("--cuda-graph", choices=["auto", "on", "off"], help="capture the whole training step in one CUDA "
                   "graph and replay it (default auto: on one GPU; on: also under torchrun)")
    g.add_argument("--force-memory", action="store_true", help=_FORCE_HELP)
    g = p.add_argument_group("parallelism (under torchrun; see docs/training.md)")
    g.add_argument("--dp-replicate", type=_positive_int, metavar="N", help="data-parallel replicas (HSDP; default 1)")
    g.add_argument("--dp-shard", type=_shard_degree, metavar="N", help="ranks sharding parameters, gradients and "
                   "optimizer state (FSDP2; default -1: what the other degrees leave of the world)")
    g.add_argument("--cp", type=_positive_int, metavar="N", help="context-parallel ranks per sequence (default 1)")
    g.add_argument("--ep", type=_positive_int, metavar="N", help="expert-parallel ranks, taken from --dp-shard × --cp "
                   "(default 1)")
    g = p.add_argument_group("run directory")
    g.add_argument("--out", metavar="DIR", help="run directory (default runs/<name>/; must be new or empty)")
    g.add_argument("--name", help="run name: the directory runs/NAME (default: the preset, made unique)")
    g.add_argument("--resume", nargs="?", const=True, metavar="DIR",
                   help="continue the run in DIR (or in --out/--name) from its newest checkpoint")
    g.add_argument("--log-every", type=_positive_int, metavar="N", help="log a plain line every N steps when stdout is not "
                   "a terminal (default 10); metrics.jsonl gets every step")
    g.add_argument("--save-every", type=_nonneg_int, metavar="N", help="checkpoint every N steps (default 0: at the end)")
    g.add_argument("--keep", type=_positive_int, metavar="N", help="checkpoints to keep (default 2)")
    g.add_argument("--eval-every", type=_nonneg_int, metavar="N", help="validate every N steps (default 0: at the end)")
    g.add_argument("--eval-batches", type=_positive_int, metavar="N", help="validation batches (default 8)")
    g.add_argument("--sample-tokens", type=_nonneg_int, metavar="N", help="tokens sampled at the end (default 200; 0: none)")
    g.add_argument("--prompt", help="prompt of that sample (default 'The ')")
    g.add_argument("--no-plot", dest="plot", action="store_false", help="do not write loss.png")
    p.set_defaults(func=_cmd_train)


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="sample text from a run (or a released checkpoint), streaming",
                       description="Prefill the prompt once, then decode one token per step with the model's "
                       "fixed-size state; text is printed as it is produced, tokens/s goes to stderr.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory from `k3 train` (its newest checkpoint)")
    src.add_argument("--model", metavar="PATH", help="a released K3 checkpoint folder (safetensors + tiktoken.model)")
    p.add_argument("--prompt", default="", help="text to continue (default: empty, i.e. from bos)")
    p.add_argument("--max-new-tokens", type=_nonneg_int, metavar="N", default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, metavar="X", default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, metavar="X", default=None, help="nucleus sampling mass (default off)")
    p.add_argument("--top-k", type=_positive_int, metavar="N", default=None, help="sample among the k likeliest (default off)")
    p.add_argument("--seed", type=_nonneg_int, metavar="N", default=0, help="sampling seed (default 0): same seed, same text")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--chat", action="store_true", help="with --model: wrap the prompt as a user turn in K3's "
                   "chat format")
    p.add_argument("--system", default=None, help="with --chat: a system message")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="with --model: weight dtype (default: the checkpoint's)")
    p.add_argument("--force-memory", action="store_true", help=_FORCE_HELP)
    p.set_defaults(func=_cmd_generate)


def _add_eval(sub: Any) -> None:
    p = sub.add_parser("eval", help="validation loss / perplexity (and recall accuracy) of a run",
                       description="Evaluate the newest checkpoint of a run on its held-out data.")
    p.add_argument("--run", metavar="DIR", required=True, help="a run directory (or one of its checkpoints)")
    p.add_argument("--batches", type=_positive_int, metavar="N", default=None, help="validation batches (default: the run's)")
    p.add_argument("--batch-size", type=_positive_int, metavar="N", default=None, help="default: the run's")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--force-memory", action="store_true", help=_FORCE_HELP)
    p.set_defaults(func=_cmd_eval)


def _add_tokenize(sub: Any) -> None:
    p = sub.add_parser("tokenize", help="pre-tokenize text files into a .bin shard for --data",
                       description="Tokenize .txt/.md/.jsonl/.parquet files (or hf:NAME) into one k3 .bin shard "
                       "(documents as bos ids… eos, uint16 when the vocabulary fits).")
    p.add_argument("inputs", nargs="+", metavar="SRC", help="files, directories, globs or hf:NAME[:SPLIT]")
    p.add_argument("--out", required=True, metavar="FILE.bin", help="the shard to write (must not exist)")
    p.add_argument("--tokenizer", default="byte", help="as for k3 train (default: byte)")
    p.add_argument("--text-field", default="text", help="field/column of .jsonl/.parquet (default: text)")
    p.add_argument("--max-tokens", type=_positive_int, metavar="N", default=None, help="stop after about this many tokens")
    p.set_defaults(func=_cmd_tokenize)


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                       description="Serve a run (or a released checkpoint) over HTTP: /v1/models, /v1/completions, "
                       "/v1/chat/completions (streaming with stream: true), /health. Binds to 127.0.0.1 unless --host "
                       "says otherwise.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory from `k3 train` (its newest checkpoint)")
    src.add_argument("--model", metavar="PATH", help="a released K3 checkpoint folder (safetensors + tiktoken.model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_nonneg_int, metavar="N", default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--max-batch", type=_positive_int, metavar="N", default=8, help="sequences decoded together "
                   "(default 8); more requests wait in a queue")
    p.add_argument("--max-queue", type=_nonneg_int, metavar="N", default=64, help="requests that may wait for a "
                   "slot (default 64); beyond it: HTTP 429")
    p.add_argument("--max-seq-len", type=_positive_int, metavar="N", default=None, help="tokens per sequence, prompt "
                   "+ output (default: the model's max_seq_len, lowered to fit half the free GPU memory)")
    p.add_argument("--prefill-chunk", type=_positive_int, metavar="N", default=None, help="prompt tokens per prefill "
                   "forward (default: from free memory)")
    p.add_argument("--served-model-name", metavar="NAME", default=None, help="the model id clients pass (default: "
                   "the run's or checkpoint's folder name)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="with --model: weight dtype (default: the checkpoint's)")
    p.add_argument("--force-memory", action="store_true", help=_FORCE_HELP)
    p.set_defaults(func=_cmd_serve)


def _add_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="per-GPU memory, FLOPs, traffic and step time of a model on N GPUs",
                       description="Estimate training (FSDP2 x expert parallel x context parallel; searches the "
                       "layouts unless --dp-shard is given) or serving (--serve) of a model on N GPUs, from stated "
                       "assumptions (printed with the result).")
    p.add_argument("--preset", default="k3", help="model preset (default k3)")
    p.add_argument("--config", metavar="FILE.json", default=None, help="K3Config JSON file (instead of --preset)")
    p.add_argument("--gpus", type=_positive_int, required=True, metavar="N", help="number of GPUs")
    p.add_argument("--gpu-memory", default="141GB", metavar="SIZE", help="memory per GPU (default 141GB)")
    p.add_argument("--seq-len", type=_positive_int, default=8192, metavar="N", help="tokens per sequence (default 8192)")
    p.add_argument("--global-batch", type=_positive_int, default=2048, metavar="N",
                   help="sequences per optimizer step (default 2048)")
    p.add_argument("--micro-batch", type=_positive_int, default=1, metavar="N",
                   help="sequences per data rank per micro-batch (default 1)")
    for flag in ("--dp-replicate", "--dp-shard", "--cp", "--ep"):
        p.add_argument(flag, type=_positive_int, default=None, metavar="N", help="fix this degree (default: search)")
    p.add_argument("--activation-checkpointing", choices=["full", "none"], default="full",
                   help="per-layer recompute (default full)")
    p.add_argument("--optimizer", choices=["muon", "adamw"], default="muon", help="default muon")
    p.add_argument("--serve", action="store_true", help="serving the release instead of training")
    p.add_argument("--batch", type=_positive_int, default=1, metavar="N", help="with --serve: sequences decoded "
                   "together (default 1)")
    p.add_argument("--context", type=_positive_int, default=131072, metavar="N", help="with --serve: tokens per "
                   "sequence (default 131072)")
    p.add_argument("--peak-tflops", type=_positive_float, default=None, metavar="X", help="bf16 peak per GPU "
                   "(default 989, H200)")
    p.add_argument("--efficiency", type=_positive_float, default=None, metavar="X",
                   help="achieved fraction of the peak (default 0.40)")
    p.add_argument("--hbm-gbps", type=_positive_float, default=None, metavar="X", help="default 4800")
    p.add_argument("--nvlink-gbps", type=_positive_float, default=None, metavar="X", help="default 450")
    p.add_argument("--net-gbps", type=_positive_float, default=None, metavar="X", help="per GPU, default 50")
    p.add_argument("--gpus-per-node", type=_positive_int, default=None, metavar="N", help="default 8")
    p.add_argument("--top", type=_positive_int, default=10, metavar="N", help="layouts shown (default 10)")
    p.set_defaults(func=_cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="k3", description="Kimi K3 in PyTorch: train, sample, evaluate.")
    parser.add_argument("--version", action="version", version=f"k3 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in (_add_train, _add_generate, _add_eval, _add_tokenize, _add_serve, _add_plan):
        add(sub)
    return parser


# --- subcommands: translate flags, call the library ----------------------------------------------------------------
def _cmd_train(ns: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(ns).items() if k not in ("func", "command", "resume")}
    resume = getattr(ns, "resume", None)
    if resume is True:  # bare --resume: the run named by --out / --name
        if "out" in flags:
            resume = flags["out"]
        elif "name" in flags:
            resume = f"runs/{flags['name']}"
        else:
            raise ValueError("--resume needs the run directory: --resume DIR (or --out DIR / --name NAME)")
    args, ckpt = prepare_args(flags, resume)
    train(args, resume_from=ckpt)
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    device = resolve_device(ns.device)
    if ns.run is not None:
        if world_size_from_env() > 1:
            raise ValueError("under torchrun, k3 generate runs a released checkpoint expert-sharded (--model PATH); "
                             "generate from a run directory with one process")
        if ns.chat or ns.system is not None or ns.dtype is not None:
            raise ValueError("--chat, --system and --dtype apply to --model only; drop them with --run")
        ck = load_checkpoint(ns.run, device=device, force_memory=ns.force_memory)
        model, tok = ck["model"], ck["tokenizer"]
        prompt: Any = ns.prompt
    else:
        model, tok, prompt = _load_released(ns, device)
        device = model.lm_head.weight.device  # under torchrun: this rank's GPU
    main_rank = not dist.is_initialized() or dist.get_rank() == 0  # under torchrun every rank decodes, rank 0 prints
    out, report = (sys.stdout, sys.stderr) if main_rank else (io.StringIO(), io.StringIO())
    with cpu_threads(device, model.config.hidden_size):
        generate(model, tok, prompt, max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_k=ns.top_k,
                 top_p=ns.top_p, seed=ns.seed, stream=out, device=device, report=report)
    out.write("\n")
    return 0


def _load_released(ns: argparse.Namespace, device: Any) -> tuple[Any, Any, Any]:
    """A released checkpoint through ``k3.load_pretrained`` and K3's tokenizer."""
    tok = k3_tokenizer.load_k3_tokenizer(ns.model)
    dtype = getattr(torch, ns.dtype) if ns.dtype else None
    if world_size_from_env() > 1:  # torchrun: each rank loads only its share of the experts
        model = load_released_distributed(ns.model, device, dtype, force_memory=ns.force_memory)
    else:
        model = load_pretrained(ns.model, device=device, dtype=dtype, force_memory=ns.force_memory)
    if not ns.chat:
        if ns.system is not None:
            raise ValueError("--system needs --chat")
        return model, tok, ns.prompt
    messages = ([{"role": "system", "content": ns.system}] if ns.system else []) + [
        {"role": "user", "content": ns.prompt}]
    return model, tok, list(tok.chat_prompt(messages))


def _cmd_plan(ns: argparse.Namespace) -> int:
    return run_plan(ns, sys.stdout)


def _cmd_eval(ns: argparse.Namespace) -> int:
    evaluate_run(ns.run, device=ns.device, batches=ns.batches, batch_size=ns.batch_size, stream=sys.stdout,
                 as_json=ns.json, force_memory=ns.force_memory)
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    try:
        from k3.serve.server import serve
    except ImportError as e:  # the serve extra is not installed
        raise ValueError(f"k3 serve needs FastAPI and uvicorn ({e}): pip install 'k3[serve]'") from None

    return serve(ns.run, ns.model, host=ns.host, port=ns.port, max_batch=ns.max_batch, max_queue=ns.max_queue,
                 max_seq_len=ns.max_seq_len, prefill_chunk=ns.prefill_chunk, name=ns.served_model_name,
                 device=resolve_device(ns.device), dtype=ns.dtype, force_memory=ns.force_memory)


def _cmd_tokenize(ns: argparse.Namespace) -> int:
    out = Path(ns.out)
    if out.exists():
        raise ValueError(f"--out {out} already exists; choose a new file name")
    if out.suffix != ".bin":
        raise ValueError(f"--out must end in .bin, got {out}")
    tok = load_tokenizer(ns.tokenizer)
    parts = [p for src in ns.inputs for p in load_tokens(src, tok, ns.text_field, ns.max_tokens)]
    tokens = np.concatenate([np.asarray(p) for p in parts])
    write_bin_shard(out, tokens, tok.vocab_size)
    print(f"k3: wrote {out} ({tokens.size:,} tokens, {tok.kind} tokenizer, vocab {tok.vocab_size}); "
          f"train on it with: k3 train --data {out}" + (f" --tokenizer {ns.tokenizer}" if ns.tokenizer != "byte"
                                                         else ""))
    return 0


# --- entry point -----------------------------------------------------------------------------------------------------
def _fail(message: str) -> int:
    sys.stdout.flush()
    msg = " ".join(str(message).split())  # one line, whatever the exception text holds
    sys.stderr.write(f"k3: error: {msg}\n")
    sys.stderr.flush()
    return EXIT_USAGE


def _crash(e: BaseException) -> int:
    """One line for an exception nobody expected; the full traceback goes to a file the line names."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"k3-error-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"k3 {' '.join(sys.argv[1:])}\n\n")
            traceback.print_exception(e, file=f)
        where = f"full traceback in {path}"
    except OSError:
        where = "no traceback file could be written"
    _fail(f"unexpected {type(e).__name__}: {str(e)[:300]} ({where}; please report it)")
    return EXIT_FAILURE


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ()))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``k3`` command line; returns the exit status (0 ok, 2 user error, 1 failure, 130 interrupted)."""
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except _UsageError as e:
        return _fail(str(e))
    if getattr(ns, "func", None) is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(ns.func(ns) or 0)
    except _UsageError as e:
        return _fail(str(e))
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        return _fail(str(e))
    except FloatingPointError as e:  # training diverged: not a usage error, but still one clear line
        _fail(str(e))
        return 1
    except OSError as e:  # disk full, unreadable file, …
        return _fail(f"{e.strerror or e}{f': {e.filename}' if getattr(e, 'filename', None) else ''}")
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.write("\nk3: interrupted; the newest complete checkpoint is intact (continue with "
                         "k3 train --resume DIR)\n")
        return 130
    except Exception as e:  # noqa: BLE001 - the last resort: one line, the traceback in a file
        if _is_oom(e):
            _fail(f"out of memory ({type(e).__name__}) although k3's estimate said it would fit; lower "
                  "--batch-size / --seq-len, or use a smaller model")
            return EXIT_FAILURE
        return _crash(e)
