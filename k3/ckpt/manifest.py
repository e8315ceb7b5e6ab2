"""Checkpoint manifests: the size and sha256 of every file of a checkpoint directory, written last and checked
before anything is loaded.

The mechanism is generic: ``write_manifest(folder, fields)`` hashes every regular file under ``folder`` (any depth,
any size: hashing streams through a fixed buffer) and writes ``checkpoint.json`` atomically; ``verify_manifest``
re-hashes them and refuses, in one line naming the file, anything missing, resized or changed. Run checkpoints
(``k3.ckpt.run``) use it, and so can any other step directory (e.g. ``torch.distributed.checkpoint`` shards).

Files written through ``k3.utils.HashingWriter`` can pass their digest in, so they are not read a second time.
Paths in a manifest are confined to its folder (``k3.utils.confined``): a manifest naming ``/etc/hostname`` or
``../x`` is refused, never stat'ed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from k3.utils import atomic_write_text, confined, read_json, sha256_file

__all__ = ["MANIFEST", "CheckpointError", "write_manifest", "verify_manifest", "file_entry"]

MANIFEST = "checkpoint.json"
MANIFEST_MAX_BYTES = 64 << 20  # a DCP directory of many shards stays far below


class CheckpointError(ValueError):
    """A run directory or checkpoint that cannot be used; the message says what to do."""


def file_entry(path: str | Path, digest: str | None = None) -> dict[str, Any]:
    """``{"size", "sha256"}`` of one file (``digest``: its sha256 when already known from writing it)."""
    path = Path(path)
    return {"size": path.stat().st_size, "sha256": digest or sha256_file(path)}


def write_manifest(folder: str | Path, fields: dict[str, Any], digests: dict[str, str] | None = None,
                   name: str = MANIFEST) -> dict[str, Any]:
    """Hash every regular file under ``folder`` and write the manifest ``name`` there (atomically, last).

    ``fields`` go into the manifest beside ``files`` (e.g. format, version, step); ``digests`` maps a relative
    path to its already-known sha256. A symlink in ``folder`` is an error: a checkpoint holds its own bytes.
    """
    folder = Path(folder)
    digests = digests or {}
    files: dict[str, Any] = {}
    for f in sorted(folder.rglob("*")):
        rel = f.relative_to(folder).as_posix()
        if f.is_symlink():
            raise CheckpointError(f"{folder}: {rel} is a symlink; a checkpoint must hold its own files")
        if f.is_file() and rel != name:
            files[rel] = file_entry(f, digests.get(rel))
    manifest = {**fields, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
    atomic_write_text(folder / name, _dumps(manifest))
    return manifest


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def verify_manifest(folder: str | Path, fmt: str, name: str = MANIFEST,
                    hint: str = "delete that directory to fall back to the previous checkpoint, or retrain"
                    ) -> dict[str, Any]:
    """Check every file listed in ``folder/name`` (format ``fmt``) against its size and sha256; return the manifest.

    Raises ``CheckpointError`` (one line naming the checkpoint, the file and ``hint``) on the first problem.
    """
    folder = Path(folder)
    where = f"checkpoint {folder}"
    try:
        manifest = read_json(folder / name, f"{where}: {name}", max_bytes=MANIFEST_MAX_BYTES)
    except ValueError as e:
        if not (folder / name).exists():
            raise CheckpointError(f"{where}: {name} is missing; {hint}") from None
        raise CheckpointError(f"{e} (corrupt, not JSON); {hint}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt or not isinstance(files, dict):
        raise CheckpointError(f"{where}: {name} is not a {fmt} manifest; {hint}")
    for rel, want in files.items():
        try:
            path = confined(folder, rel, f"{where}: {name} entry")
        except ValueError as e:
            raise CheckpointError(f"{e}; {hint}") from None
        size, digest = (want.get("size"), want.get("sha256")) if isinstance(want, dict) else (None, None)
        if not isinstance(size, int) or not isinstance(digest, str):
            raise CheckpointError(f"{where}: {name} gives no size and sha256 for {rel} (cannot verify it); {hint}")
        if not path.is_file():
            raise CheckpointError(f"{where}: {rel} is missing; {hint}")
        got = path.stat().st_size
        if got != size:
            raise CheckpointError(f"{where}: {rel} has {got} bytes, the manifest says {size} (truncated or "
                                  f"corrupt); {hint}")
        if sha256_file(path) != digest:
            raise CheckpointError(f"{where}: {rel} does not match its sha256 (corrupt); {hint}")
    return manifest
