"""Run checkpoints: everything needed to continue a training run exactly, written so a kill never loses one.

Layout of a run directory::

    runs/<name>/
      run.json, config.json          the run's arguments and model config (for people; checkpoints hold copies)
      metrics.jsonl, loss.png        the log and its plot
      checkpoints/step-00000200/     one directory per checkpoint (the newest ``keep`` are kept)
        config.json                  K3Config
        model.safetensors            weights + persistent buffers (the Quantile Balancing biases are buffers)
        trainer.pt                   optimizer, RNG states (torch/cuda/numpy/python), data position, step
        (a run with a process group — any GPU run, torchrun on CPUs — writes instead, through
        ``k3.distributed.checkpoint``: dcp/ = model + optimizer as torch.distributed.checkpoint shards, loadable
        by any layout; trainer.pt without the optimizer; rng/rank-NNNNN.pt = each rank's RNG states)
        run.json                     the arguments the run was started with
        tokenizer_spec.json          which tokenizer (its file copied to tokenizer_files/ when it has one)
        checkpoint.json              manifest, written LAST: step, and size + sha256 of every other file

Why it survives a kill: each file goes through ``k3.utils.atomic_write_*`` (temp file, fsync, rename) inside a
hidden ``.tmp-step-…`` directory; the manifest is written last; only then is the directory renamed to
``step-…`` (one atomic rename). A reader only considers ``step-…`` directories with a manifest, and checks every
file against it, so a torn or truncated checkpoint is reported, never half-loaded. Older checkpoints are pruned
only after the new one is in place.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from k3.utils import atomic_write_text, atomic_write_with, sha256_file

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "stage_checkpoint",
    "publish_checkpoint",
    "find_checkpoint",
    "verify_checkpoint",
    "load_checkpoint",
    "load_trainer_state",
    "rng_state",
    "set_rng_state",
    "MANIFEST",
    "DCP_DIR",
]

MANIFEST = "checkpoint.json"
DCP_DIR = "dcp"  # a distributed run's model + optimizer, as torch.distributed.checkpoint wrote them
FORMAT = "k3-run-checkpoint"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_HASH_LIMIT = 1 << 30  # files above 1 GiB are checked by size only (hashing them on every load costs seconds)


class CheckpointError(ValueError):
    """A run directory or checkpoint that cannot be used; the message says what to do."""


# --- RNG ----------------------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every RNG the training loop may touch, as plain lists/tensors (loadable with ``weights_only=True``)."""
    py = random.getstate()
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    v, keys, gauss = state["python"]
    random.setstate((v, tuple(keys), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


# --- writing --------------------------------------------------------------------------------------------------------
def _file_entry(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    return {"size": size, "sha256": sha256_file(path) if size <= _HASH_LIMIT else None}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds (Windows): the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, config: Any, tokenizer: Any,
                    trainer_state: dict[str, Any], run_args: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` of ``run_dir`` (see the module docstring) and return its directory.

    ``config`` has ``to_dict()``; ``tokenizer`` has ``save(dir) -> spec``; ``trainer_state`` is saved with
    ``torch.save`` and must hold only tensors and plain Python values. ``keep``: checkpoints to keep (≥ 1).
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    from safetensors.torch import save_model

    tmp = stage_checkpoint(run_dir, step)
    # save_model (not save_file) drops aliases of shared tensors (tied embeddings) and records them.
    atomic_write_with(tmp / "model.safetensors", lambda p: save_model(model, p, metadata={"step": str(step)}))
    atomic_write_with(tmp / "trainer.pt", lambda p: torch.save(trainer_state, p))
    return publish_checkpoint(tmp, step, config, tokenizer, run_args, keep)


def stage_checkpoint(run_dir: str | Path, step: int, unique: bool = True) -> Path:
    """Create the hidden directory checkpoint ``step`` is written into (leftovers of killed saves removed first).

    ``unique=False``: a name every rank of a distributed save can compute on its own (one writer job per run)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):  # leftovers of a save that was killed: never a valid checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / (f".tmp-step-{step:08d}-{os.getpid()}" if unique else f".tmp-step-{step:08d}")
    tmp.mkdir()
    return tmp


def publish_checkpoint(tmp: Path, step: int, config: Any, tokenizer: Any, run_args: dict[str, Any],
                       keep: int) -> Path:
    """Add the shared files and the manifest (last) to staged directory ``tmp``, rename it to ``step-…`` in one
    atomic step, and prune all but the newest ``keep`` checkpoints. Returns the published directory."""
    root = tmp.parent
    atomic_write_text(tmp / "config.json", _json(config.to_dict()))
    atomic_write_text(tmp / "run.json", _json(run_args))
    atomic_write_text(tmp / "tokenizer_spec.json", _json(tokenizer.save(tmp)))
    files = {str(f.relative_to(tmp)): _file_entry(f) for f in sorted(tmp.rglob("*")) if f.is_file()}
    manifest = {"format": FORMAT, "version": 1, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "files": files}
    atomic_write_text(tmp / MANIFEST, _json(manifest))  # last: a directory without it is incomplete
    for d in sorted({f.parent for f in tmp.rglob("*") if f.is_file()}, key=lambda d: -len(d.parts)):
        _fsync_dir(d)

    final = root / f"step-{step:08d}"
    if final.exists():  # the same step saved again (e.g. the final save right after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in _step_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# --- reading --------------------------------------------------------------------------------------------------------
def _step_dirs(root: Path) -> list[Path]:
    """Complete checkpoint directories (with a manifest) under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / MANIFEST).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory for ``path``: itself when it holds a manifest, else the newest one of a run dir."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"run directory {p} does not exist; pass the directory that `k3 train` printed "
                              "(runs/<name>)")
    if not p.is_dir():
        raise CheckpointError(f"{p} is not a directory; pass a run directory (runs/<name>) or a checkpoint in it")
    if not os.access(p, os.R_OK | os.X_OK):
        raise CheckpointError(f"run directory {p} is not readable; check its permissions")
    if (p / MANIFEST).is_file():
        return p
    dirs = _step_dirs(p / "checkpoints")
    if not dirs:
        raise CheckpointError(f"{p} holds no complete checkpoint (no checkpoints/step-*/{MANIFEST}); "
                              "train first, or pass a run directory that `k3 train` wrote")
    return dirs[-1]


def verify_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """Check every file of checkpoint directory ``ckpt`` against its manifest; return the manifest."""
    ckpt = Path(ckpt)
    hint = "delete that directory to fall back to the previous checkpoint, or retrain"
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except OSError as e:
        raise CheckpointError(f"checkpoint {ckpt}: cannot read {MANIFEST} ({e.strerror}); {hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is corrupt (not JSON); {hint}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"),
                                                                                                dict):
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is not a k3 run-checkpoint manifest; {hint}")
    for name, want in manifest["files"].items():
        f = ckpt / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {ckpt}: {name} is missing; {hint}")
        size = f.stat().st_size
        if size != want.get("size"):
            raise CheckpointError(f"checkpoint {ckpt}: {name} has {size} bytes, the manifest says "
                                  f"{want.get('size')} (truncated or corrupt); {hint}")
        if want.get("sha256") and sha256_file(f) != want["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt}: {name} does not match its sha256 (corrupt); {hint}")
    return manifest


def _read_json(ckpt: Path, name: str) -> Any:
    try:
        return json.loads((ckpt / name).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: cannot read {name}: {e}") from None


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    model_factory: Callable[[Any], torch.nn.Module] | None = None) -> dict[str, Any]:
    """Verify and load the checkpoint at ``path`` (a run dir or a checkpoint dir).

    Returns ``{"dir", "step", "config", "model", "tokenizer", "run_args", "manifest"}``; the model is in eval
    mode on ``device``. ``model_factory(config)`` builds the module (default ``K3ForCausalLM``).
    """
    from safetensors.torch import load_model

    from k3.config import K3Config
    from k3.data.tokenizers import tokenizer_from_dict

    ckpt = find_checkpoint(path)
    manifest = verify_checkpoint(ckpt)
    try:
        config = K3Config.from_dict(_read_json(ckpt, "config.json"))
    except CheckpointError:
        raise
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: config.json is invalid: {e}") from None
    tokenizer = tokenizer_from_dict(_read_json(ckpt, "tokenizer_spec.json"), root=ckpt)
    if model_factory is None:
        from k3.model import K3ForCausalLM

        model_factory = K3ForCausalLM
    with torch.device(device):
        model = model_factory(config)
    if (ckpt / DCP_DIR / ".metadata").is_file():  # written by a distributed run: any layout loads here
        _load_dcp_weights(model, ckpt)
        missing = unexpected = []
    else:
        try:
            missing, unexpected = load_model(model, str(ckpt / "model.safetensors"), strict=False,
                                             device=str(device))
        except Exception as e:  # safetensors raises its own error types for malformed files
            raise CheckpointError(f"checkpoint {ckpt}: model.safetensors cannot be loaded: {e}") from None
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {ckpt}: weights do not match the model (missing {sorted(missing)[:3]}, "
                              f"unexpected {sorted(unexpected)[:3]}); was it written by another k3 version?")
    model.eval()
    return {"dir": ckpt, "step": int(manifest["step"]), "config": config, "model": model, "tokenizer": tokenizer,
            "run_args": _read_json(ckpt, "run.json"), "manifest": manifest}


def _load_dcp_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Read the model part of a ``torch.distributed.checkpoint`` directory into ``model`` in one process (DCP
    reassembles every saved shard layout into the full tensors)."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=str(ckpt / DCP_DIR), no_dist=True)
    except Exception as e:  # DCP reports missing keys and unreadable shards with several exception types
        raise CheckpointError(f"checkpoint {ckpt}: {DCP_DIR}/ cannot be loaded into this model "
                              f"({type(e).__name__}: {str(e)[:200]})") from None


def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
    """``trainer.pt`` of a (verified) checkpoint directory, loaded with ``weights_only=True`` on the CPU."""
    ckpt = Path(ckpt)
    try:
        return torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/zip errors of a damaged file come in many types
        raise CheckpointError(f"checkpoint {ckpt}: trainer.pt cannot be loaded ({type(e).__name__}); "
                              "delete that directory to fall back to the previous checkpoint") from None
