"""Small helpers shared across the package: atomic file writes, streamed file hashes, paths confined to a folder,
bounded JSON reading, scoped environment variables and attributes, Ctrl-C held back over a critical section."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Callable, Iterator

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_with", "env_var", "overridden_attrs",
           "interrupts_deferred", "sha256_file", "HashingWriter", "confined", "read_json", "parse_json",
           "JSON_MAX_BYTES", "JSON_MAX_DEPTH"]

JSON_MAX_BYTES = 16 << 20  # configs, manifests, specs: a few KiB in practice
JSON_MAX_DEPTH = 64  # the deepest file k3 reads nests 5 levels
_HASH_BLOCK = 8 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_with(path: str | Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` for a temporary file beside ``path``, fsync it, then rename it over ``path``.

    A kill at any moment leaves either the old file or the new one, never a torn one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the mode open() would have
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write_with(path, write)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C (SIGINT) during the block is held back and raised as ``KeyboardInterrupt`` when the block ends; a second
    one raises at once. A checkpoint being written is finished instead of abandoned: ``torch.save`` interrupted
    mid-write turns the ``KeyboardInterrupt`` into a ``RuntimeError`` of its own zip writer. Outside the main thread
    (where Python runs signal handlers), or when SIGINT has a handler other than Python's default, it does nothing."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file of any size, streamed through one reused 8 MiB buffer."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class HashingWriter:
    """A binary file wrapper that hashes what passes through ``write``: the digest of a file costs no second read.

    ``torch.save(obj, HashingWriter(f))`` works: torch only calls ``write`` and ``flush`` on a non-seekable sink.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f, self._h, self.size = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._h.update(view)
        self.size += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


# --- untrusted folders ----------------------------------------------------------------------------------------------
def confined(folder: str | Path, relpath: Any, what: str) -> Path:
    """``folder / relpath`` resolved, refused unless it stays inside ``folder`` (``ValueError`` naming ``what``).

    ``relpath`` comes from a file (an index, a manifest, a spec): absolute paths, ``..`` components and symlinks
    that resolve outside ``folder`` are refused. The message names the field and the path, never file content.
    """
    if not isinstance(relpath, str) or not relpath or "\x00" in relpath:
        raise ValueError(f"{what} must be a non-empty relative path string, got {str(relpath)[:60]!r}")
    shown = relpath if len(relpath) <= 200 else relpath[:200] + "…"
    p = Path(relpath)
    if p.is_absolute() or ".." in p.parts:
        raise ValueError(f"{what} names {shown!r}, a path outside {folder} (absolute or with '..'); refused")
    root = Path(folder).resolve()
    target = (root / p).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"{what} names {shown!r}, which resolves outside {folder} (a symlink out?); refused")
    return target


def _json_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting of JSON ``text`` (strings skipped), in C-speed passes."""
    import numpy as np

    brackets = re.sub(r"[^\[\]{}]", "", re.sub(r'"(?:[^"\\]|\\.)*"', "", text))
    if not brackets:
        return 0
    step = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    depth = np.cumsum(np.where((step == ord("[")) | (step == ord("{")), 1, -1), dtype=np.int64)
    return int(depth.max())


def parse_json(text: str | bytes, what: str, max_depth: int = JSON_MAX_DEPTH) -> Any:
    """``json.loads`` with a nesting limit: ``ValueError`` naming ``what`` instead of a ``RecursionError``."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what} is not UTF-8 text") from None
    if _json_depth(text) > max_depth:
        raise ValueError(f"{what} nests deeper than {max_depth} levels; not a k3 file")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def read_json(path: str | Path, what: str | None = None, max_bytes: int = JSON_MAX_BYTES,
              max_depth: int = JSON_MAX_DEPTH) -> Any:
    """Read a JSON file with a size limit (checked before reading) and a nesting limit; ``ValueError`` naming
    ``what`` (default: the path) for anything that is not a bounded, valid JSON document."""
    path = Path(path)
    what = what or str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise ValueError(f"{what} is {size:,} bytes, over the {max_bytes:,}-byte limit for this file")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"{what} cannot be read ({e.strerror or type(e).__name__})") from None
    if len(data) > max_bytes:  # a file that grew while read, or a pipe
        raise ValueError(f"{what} is over the {max_bytes:,}-byte limit for this file")
    return parse_json(data, what, max_depth)


@contextlib.contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or, with None, unset) environment variable ``name`` inside the block; restore it after."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def overridden_attrs(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes of ``obj`` (e.g. a class of launch knobs) inside the block; restore the old values after."""
    old = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(obj, name, value)
