"""User data: text files (.txt, .jsonl, .parquet), pre-tokenized .bin shards, or a Hugging Face dataset name.

``.bin`` shard format (little-endian), written by ``write_bin_shard`` / ``k3 tokenize``::

    offset 0   8 bytes   magic b"K3TOKENS"
    offset 8   uint32    format version (1)
    offset 12  uint32    bytes per token: 2 (uint16) or 4 (uint32)
    offset 16  uint64    number of tokens N
    offset 24  uint64    vocabulary size the ids were made with (0 = unknown)
    offset 32  N tokens

The file size must be exactly ``32 + N * itemsize`` (a truncated shard is an error, never silently short).
Documents inside a shard are laid out as the trainer does for text: ``bos ids… eos`` per document.
"""

from __future__ import annotations

import glob as _glob
import json
import struct
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from k3.data.tokenizers import Tokenizer
from k3.utils import atomic_write_with

__all__ = [
    "BIN_MAGIC",
    "TEXT_SUFFIXES",
    "write_bin_shard",
    "read_bin_shard",
    "resolve_data_paths",
    "iter_documents",
    "tokenize_documents",
    "load_tokens",
]

BIN_MAGIC = b"K3TOKENS"
_HEADER = struct.Struct("<8sIIQQ")  # 32 bytes
TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
DATA_SUFFIXES = TEXT_SUFFIXES + (".bin",)


# --- .bin shards ------------------------------------------------------------------------------------------------
def write_bin_shard(path: str | Path, tokens: np.ndarray | list[int], vocab_size: int = 0) -> Path:
    """Write ``tokens`` (1-D ids) as a .bin shard (uint16 when every id fits, else uint32), atomically."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("tokens must be ids in [0, 2**32)")
    limit = max(int(vocab_size), int(arr.max()) + 1 if arr.size else 0)
    dtype = np.uint16 if limit <= 2**16 else np.uint32
    arr = arr.astype(dtype)
    header = _HEADER.pack(BIN_MAGIC, 1, arr.itemsize, arr.size, int(vocab_size))

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(arr.tobytes())

    atomic_write_with(path, write)
    return Path(path)


def read_bin_shard(path: str | Path) -> np.ndarray:
    """Memory-map a .bin shard; returns a read-only 1-D uint16/uint32 array (nothing is read until used)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        size = path.stat().st_size
    except OSError as e:
        raise ValueError(f"data file {path} cannot be read: {e.strerror}") from None
    if len(head) < _HEADER.size or head[:8] != BIN_MAGIC:
        raise ValueError(f"data file {path} is not a k3 .bin shard (no K3TOKENS header); "
                         "make one with `k3 tokenize FILES --out shard.bin`")
    _, version, itemsize, n, _vocab = _HEADER.unpack(head)
    if version != 1 or itemsize not in (2, 4):
        raise ValueError(f"data file {path}: unsupported .bin version {version} / token size {itemsize}")
    if size != _HEADER.size + n * itemsize:
        raise ValueError(f"data file {path} is truncated or padded: header says {n} tokens "
                         f"({_HEADER.size + n * itemsize} bytes), file has {size} bytes")
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=np.uint16 if itemsize == 2 else np.uint32, mode="r", offset=_HEADER.size, shape=(n,))


# --- text files -------------------------------------------------------------------------------------------------
def resolve_data_paths(spec: str | Path) -> list[Path]:
    """A file, a directory (every data file inside, recursively, sorted) or a glob pattern → sorted list of files."""
    s = str(spec)
    p = Path(s)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES)
        if not files:
            raise ValueError(f"data directory {p} holds no {'/'.join(DATA_SUFFIXES)} files")
        return files
    if any(c in s for c in "*?["):
        files = sorted(Path(f) for f in _glob.glob(s, recursive=True) if Path(f).is_file())
        if not files:
            raise ValueError(f"data pattern {s!r} matches no file")
        return files
    raise ValueError(f"data {s!r} is not a file, directory or glob pattern that exists")


def iter_documents(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """Documents of one text file: a .txt/.md file is one document; .jsonl and .parquet give one per row
    (field/column ``text_field``)."""
    path = Path(path)
    suffix = path.suffix
    if suffix in (".txt", ".md"):
        try:
            yield path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ValueError(f"data file {path} cannot be read: {e.strerror}") from None
    elif suffix == ".jsonl":
        yield from _iter_jsonl(path, text_field)
    elif suffix == ".parquet":
        yield from _iter_parquet(path, text_field)
    else:
        raise ValueError(f"data file {path}: unsupported suffix {suffix!r}; use .txt, .md, .jsonl, .parquet or .bin")


def _iter_jsonl(path: Path, field: str) -> Iterator[str]:
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"data file {path} cannot be read: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data file {path} line {n} is not JSON: {e.msg}") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise ValueError(f"data file {path} line {n} has no string field {field!r} (set --text-field)")
            yield row[field]


def _iter_parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: pip install 'k3[parquet]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types
        raise ValueError(f"data file {path} is not a readable parquet file: {e}") from None
    if field not in pf.schema_arrow.names:
        raise ValueError(f"data file {path} has no column {field!r} (columns: {pf.schema_arrow.names}); "
                         "set --text-field")
    for batch in pf.iter_batches(columns=[field]):
        for v in batch.column(0).to_pylist():
            if isinstance(v, str):
                yield v


def iter_hf_documents(name: str, split: str = "train", text_field: str = "text") -> Iterator[str]:
    """Documents of a Hugging Face dataset (``hf:NAME`` or ``hf:NAME:SPLIT``); needs the network and ``datasets``."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data 'hf:{name}' needs the datasets package: pip install 'k3[hf]'") from None
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
        for row in ds:
            v = row.get(text_field)
            if isinstance(v, str):
                yield v
    except Exception as e:  # network, unknown name, auth: the library raises many types
        raise ValueError(f"Hugging Face dataset {name!r} (split {split!r}) cannot be loaded: {e}") from None


_BATCH_CHARS = 8 << 20  # text handed to the tokenizer per batch: enough to keep every core busy
_BATCH_DOCS = 4096


def _batches(docs: Iterable[str]) -> Iterator[list[str]]:
    """Non-empty documents in batches of about ``_BATCH_CHARS`` characters (at most ``_BATCH_DOCS``)."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        if not doc.strip():
            continue
        batch.append(doc)
        chars += len(doc)
        if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_documents(docs: Iterable[str], tok: Tokenizer, max_tokens: int | None = None) -> np.ndarray:
    """``bos ids… eos`` per non-empty document, concatenated; uint16 when the vocabulary fits, else uint32.

    Documents are encoded in batches (``Tokenizer.encode_batch``: tiktoken and Hugging Face tokenizers use every
    core); the result equals encoding them one at a time, ``max_tokens`` included (stop after the document that
    reaches it).
    """
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    head = [tok.bos_id] if tok.bos_id is not None else []
    tail = [tok.eos_id] if tok.eos_id is not None else []
    chunks: list[np.ndarray] = []
    total = 0
    for batch in _batches(docs):
        for ids in tok.encode_batch(batch):
            chunks.append(np.asarray(head + ids + tail, dtype=dtype))
            total += chunks[-1].size
            if max_tokens is not None and total >= max_tokens:
                return np.concatenate(chunks)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def load_tokens(spec: str | Path, tok: Tokenizer, text_field: str = "text",
                max_tokens: int | None = None) -> list[np.ndarray]:
    """Token arrays for ``--data``: one per .bin shard (memory-mapped) and one for all text files together.

    ``spec``: a file, directory or glob, or ``hf:NAME[:SPLIT]``. Raises ``ValueError`` when nothing is there.
    """
    s = str(spec)
    if s.startswith("hf:"):
        name, _, split = s[3:].partition(":")
        parts = [tokenize_documents(iter_hf_documents(name, split or "train", text_field), tok, max_tokens)]
        what = f"Hugging Face dataset {name!r}"
    else:
        paths = resolve_data_paths(s)
        parts = []
        texts = [p for p in paths if p.suffix != ".bin"]
        for p in paths:
            if p.suffix == ".bin":
                arr = read_bin_shard(p)
                if arr.size and int(arr.max()) >= tok.vocab_size:  # max() reads the shard once; worth it
                    raise ValueError(f"data file {p} holds token id {int(arr.max())} >= the tokenizer's vocab "
                                     f"{tok.vocab_size}; pass the --tokenizer it was made with")
                parts.append(arr)
        if texts:
            docs = (d for p in texts for d in iter_documents(p, text_field))
            parts.append(tokenize_documents(docs, tok, max_tokens))
        what = f"data {s!r}" if len(paths) > 1 else f"data file {paths[0]}"
    parts = [p for p in parts if p.size]
    if not parts:
        raise ValueError(f"{what} is empty (no text or tokens); point --data at a non-empty file")
    return parts
