"""Run checkpoints: everything needed to continue a training run exactly, written so a kill never loses one.

Layout of a run directory::

    runs/<name>/
      run.json, config.json          the run's arguments and model config (for people; checkpoints hold copies)
      metrics.jsonl, loss.png        the log and its plot
      .lock                          locked (flock) by the one process training the run
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
hidden ``.tmp-step-…-<pid>`` directory; the manifest (``k3.ckpt.manifest``: every file hashed, whatever its size) is
written last; only then is the directory renamed to ``step-…`` (one atomic rename). A reader only considers
``step-…`` directories with a manifest, and checks every byte against it, so a torn or corrupt checkpoint is
reported, never half-loaded. Older checkpoints are pruned only after the new one is in place, by renaming them
out of sight first, so a reader sees a checkpoint whole or not at all; ``load_checkpoint`` then retries with the
newest complete one.

One writer: ``lock_run`` takes an exclusive ``flock`` on ``.lock`` for the life of a training (the OS drops it when
the process dies, even by ``kill -9``); a second writer is refused in one line. Only the lock holder removes
leftovers of killed saves, so a save never touches another process's temporary directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_model, save_model

from k3.ckpt.archive import check_torch_archive
from k3.ckpt.manifest import MANIFEST, CheckpointError, verify_manifest, write_manifest
from k3.config import K3Config
from k3.data.tokenizers import tokenizer_from_dict
from k3.memory import available_memory, check_fits, model_footprint
from k3.model import K3ForCausalLM
from k3.utils import HashingWriter, atomic_write_text, atomic_write_with, interrupts_deferred, read_json

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "stage_checkpoint",
    "publish_checkpoint",
    "find_checkpoint",
    "verify_checkpoint",
    "load_checkpoint",
    "load_tokenizer",
    "load_trainer_state",
    "lock_run",
    "assert_unlocked",
    "only_bookkeeping",
    "rng_state",
    "set_rng_state",
    "MANIFEST",
    "LOCK",
    "DCP_DIR",
]

FORMAT = "k3-run-checkpoint"
LOCK = ".lock"
DCP_DIR = "dcp"  # a distributed run's model + optimizer, as torch.distributed.checkpoint wrote them
_STEP_DIR = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.(tmp|old)-step-")  # a killed save's or prune's directory
# What a run directory holds before its first checkpoint: a run killed then can be started afresh in place.
_BOOKKEEPING = {"run.json", "config.json", "metrics.jsonl", "loss.png", LOCK}
_LOAD_RETRIES = 5


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


# --- the run lock --------------------------------------------------------------------------------------------------
def _holder(lock: Path) -> str:
    """The pid holding ``flock`` on ``lock``, from ``/proc/locks`` (Linux); the lock file itself is never written, so
    a refused run leaves it as it was."""
    try:
        st = lock.stat()
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key:
                return parts[4]
    except (OSError, ValueError):
        pass
    return "unknown"


def _busy(run_dir: Path) -> CheckpointError:
    return CheckpointError(f"{run_dir} is being trained by another process (pid {_holder(run_dir / LOCK)}); wait "
                           "for it to finish (or stop it) before training or resuming this run")


@contextlib.contextmanager
def lock_run(run_dir: str | Path) -> Iterator[Path]:
    """Hold the exclusive writer lock of ``run_dir`` (created if needed) for the block.

    A second holder gets ``CheckpointError`` at once (``… is being trained by another process (pid N)``). The lock
    is an ``flock`` on ``run_dir/.lock``: released on exit and by the OS when the process dies. With the lock held,
    leftovers of killed saves and prunes (``checkpoints/.tmp-step-*``, ``.old-step-*``) belong to no live writer
    and are removed.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _busy(run_dir) from None
        _remove_leftovers(run_dir / "checkpoints")
        yield run_dir
    finally:
        os.close(fd)  # drops the flock


def assert_unlocked(run_dir: str | Path) -> None:
    """Refuse (``CheckpointError``) at once when another process holds ``run_dir``'s lock; creates nothing."""
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        raise _busy(Path(run_dir)) from None
    finally:
        os.close(fd)


def _remove_leftovers(root: Path) -> None:
    if root.is_dir():
        for d in root.iterdir():
            if _LEFTOVER.match(d.name):
                shutil.rmtree(d, ignore_errors=True)


def only_bookkeeping(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a run killed before its first checkpoint: its own bookkeeping files (``run.json``,
    ``config.json``, ``metrics.jsonl``, ``loss.png``, ``.lock``) and at most leftovers of an unfinished save."""
    run_dir = Path(run_dir)
    names = {p.name for p in run_dir.iterdir()}
    ckpts = run_dir / "checkpoints"
    if "checkpoints" in names:
        if not ckpts.is_dir() or any(not _LEFTOVER.match(p.name) for p in ckpts.iterdir()):
            return False
        names.discard("checkpoints")
    return names <= _BOOKKEEPING and ("run.json" in names or names <= {LOCK})


# --- writing --------------------------------------------------------------------------------------------------------
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


def _write_text(path: Path, text: str) -> str:
    """Atomic write; returns the sha256 of the bytes written."""
    data = text.encode("utf-8")
    atomic_write_text(path, text)
    return hashlib.sha256(data).hexdigest()


def torch_save_hashed(path: Path, obj: Any) -> str:
    """``torch.save`` of ``obj`` to ``path``, atomically, through a hashing writer; returns the file's sha256 (a
    checkpoint's files are hashed as they are written, not read again for the manifest)."""
    digest: list[str] = []

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            w = HashingWriter(f)
            try:
                torch.save(obj, w)
            except RuntimeError as e:  # an interrupt mid-write comes back as the zip writer's own error
                if isinstance(e.__context__, KeyboardInterrupt):
                    raise e.__context__ from None
                raise
            digest.append(w.hexdigest())

    atomic_write_with(path, write)
    return digest[0]


def _discard(d: Path) -> None:
    """Remove checkpoint directory ``d``: renamed out of sight first (readers see it whole or not at all)."""
    gone = d.with_name(f".old-{d.name}-{os.getpid()}")
    try:
        os.replace(d, gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, config: Any, tokenizer: Any,
                    trainer_state: dict[str, Any], run_args: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` of ``run_dir`` (see the module docstring) and return its directory.

    ``config`` has ``to_dict()``; ``tokenizer`` has ``save(dir) -> spec``; ``trainer_state`` is saved with
    ``torch.save`` and must hold only tensors and plain Python values. ``keep``: checkpoints to keep (≥ 1).
    The caller holds ``lock_run(run_dir)``; this removes only its own temporary directory.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    with interrupts_deferred():  # a Ctrl-C during the save stops the run after it, with this checkpoint complete
        tmp = stage_checkpoint(run_dir, step)
        try:
            # save_model (not save_file) drops aliases of shared tensors (tied embeddings) and records them.
            atomic_write_with(tmp / "model.safetensors",
                              lambda p: save_model(model, p, metadata={"step": str(step)}))
            digests = {"trainer.pt": torch_save_hashed(tmp / "trainer.pt", trainer_state)}
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return publish_checkpoint(tmp, step, config, tokenizer, run_args, keep, digests)


def stage_checkpoint(run_dir: str | Path, step: int, owner: str | None = None) -> Path:
    """The hidden directory checkpoint ``step`` is written into, created empty. ``owner`` names the writer
    (default: this process); a distributed save passes one name every rank can compute."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step:08d}-{owner or os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # ours: a save of this step by this writer that raised or was killed
    tmp.mkdir()
    return tmp


def publish_checkpoint(tmp: Path, step: int, config: Any, tokenizer: Any, run_args: dict[str, Any], keep: int,
                       digests: dict[str, str] | None = None) -> Path:
    """Add the shared files and the manifest (last) to the staged directory ``tmp``, rename it to ``step-…`` in one
    step, and prune all but the newest ``keep`` checkpoints. ``digests``: sha256 of files already hashed as they
    were written (the others are read once by the manifest). Returns the published directory."""
    root = tmp.parent
    final = root / f"step-{step:08d}"
    try:
        digests = {**(digests or {}), "config.json": _write_text(tmp / "config.json", _json(config.to_dict())),
                   "run.json": _write_text(tmp / "run.json", _json(run_args))}
        digests["tokenizer_spec.json"] = _write_text(tmp / "tokenizer_spec.json", _json(tokenizer.save(tmp)))
        write_manifest(tmp, {"format": FORMAT, "version": 1, "step": step}, digests)  # last
        for d in sorted({f.parent for f in tmp.rglob("*") if f.is_file()}, key=lambda d: -len(d.parts)):
            _fsync_dir(d)
        if final.exists():  # the same step saved again (e.g. the final save right after a periodic one)
            _discard(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    for old in _step_dirs(root)[:-keep]:
        _discard(old)
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
        if (p / "run.json").is_file() and only_bookkeeping(p):
            raise CheckpointError(f"{p} holds no checkpoint yet (its training stopped before the first save); "
                                  f"start it afresh with k3 train --out {p}")
        raise CheckpointError(f"{p} holds no complete checkpoint (no checkpoints/step-*/{MANIFEST}); "
                              "train first, or pass a run directory that `k3 train` wrote")
    return dirs[-1]


def verify_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """Check every byte of checkpoint directory ``ckpt`` against its manifest; return the manifest."""
    return verify_manifest(ckpt, FORMAT)


def _read_json(ckpt: Path, name: str) -> Any:
    try:
        return read_json(ckpt / name, f"checkpoint {ckpt}: {name}")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the checkpoint at ``path`` (a run dir: its newest checkpoint), without the model."""
    ckpt = find_checkpoint(path)
    return tokenizer_from_dict(_read_json(ckpt, "tokenizer_spec.json"), root=ckpt)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    model_factory: Callable[[Any], torch.nn.Module] | None = None, force_memory: bool = False,
                    footprint: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Verify and load the checkpoint at ``path`` (a run dir or a checkpoint dir).

    Returns ``{"dir", "step", "config", "model", "tokenizer", "run_args", "manifest"}``; the model is in eval
    mode on ``device``. ``model_factory(config)`` builds the module (default ``K3ForCausalLM``). Before it is
    built, ``footprint(config)`` (default: ``k3.memory.model_footprint``) must fit ``device`` unless
    ``force_memory``. For a run dir, a checkpoint pruned by the training between listing and loading is
    skipped: the newest complete one is loaded instead.
    """
    for attempt in range(_LOAD_RETRIES):
        ckpt = find_checkpoint(path)
        try:
            return _load(ckpt, device, model_factory, force_memory, footprint)
        except (ValueError, OSError):
            if ckpt.exists() or ckpt == Path(path) or attempt == _LOAD_RETRIES - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _load(ckpt: Path, device: str | torch.device, model_factory: Callable[[Any], torch.nn.Module] | None,
          force_memory: bool, footprint: Callable[[Any], Any] | None) -> dict[str, Any]:
    manifest = verify_checkpoint(ckpt)
    try:
        config = K3Config.from_dict(_read_json(ckpt, "config.json"))
    except CheckpointError:
        raise
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: config.json is invalid: {e}") from None
    run_args = _read_json(ckpt, "run.json")
    if not isinstance(run_args, dict) or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"checkpoint {ckpt}: run.json or the manifest's step is malformed; delete that "
                              "directory to fall back to the previous checkpoint")
    check_fits((footprint or model_footprint)(config), device, force_memory, config=config)
    tokenizer = tokenizer_from_dict(_read_json(ckpt, "tokenizer_spec.json"), root=ckpt)
    if model_factory is None:
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
    return {"dir": ckpt, "step": manifest["step"], "config": config, "model": model, "tokenizer": tokenizer,
            "run_args": run_args, "manifest": manifest}


def _load_dcp_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Read the model part of a ``torch.distributed.checkpoint`` directory into ``model`` in one process (DCP
    reassembles every saved shard layout into the full tensors)."""
    state = model.state_dict()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=str(ckpt / DCP_DIR), no_dist=True)
    except Exception as e:  # DCP reports missing keys and unreadable shards with several exception types
        raise CheckpointError(f"checkpoint {ckpt}: {DCP_DIR}/ cannot be loaded into this model "
                              f"({type(e).__name__}: {str(e)[:200]})") from None


def load_trainer_state(ckpt: str | Path, force_memory: bool = False) -> dict[str, Any]:
    """``trainer.pt`` of a (verified) checkpoint directory, loaded with ``weights_only=True`` on the CPU, after its
    archive records are checked against the bytes their tensors need (``k3.ckpt.archive``)."""
    ckpt = Path(ckpt)
    path = ckpt / "trainer.pt"
    hint = "delete that directory to fall back to the previous checkpoint"
    try:
        check_torch_archive(path, None if force_memory else available_memory("cpu"))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {ckpt}: {e}; {hint}") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/zip errors of a damaged file come in many types
        raise CheckpointError(f"checkpoint {ckpt}: trainer.pt cannot be loaded ({type(e).__name__}); {hint}") \
            from None
