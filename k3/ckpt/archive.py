"""``torch.save`` archives checked before ``torch.load`` reads them: no record may inflate past its bytes.

A ``torch.save`` file is a zip archive of ``data.pkl`` (the object structure), one record ``data/<key>`` per tensor
storage, and a few small markers. torch writes every record uncompressed, but a hand-made archive can hold a 20 MB
deflated record that inflates to 20 GiB, or a pickle that declares storages far larger than their records. From
the zip central directory alone (nothing is inflated), ``check_torch_archive`` refuses:

- a compressed record (torch never writes one), or one whose sizes disagree;
- records that claim more bytes in all than the file holds;
- a ``data.pkl`` over 256 MiB;
- a storage whose declared size (element count × element size, read from ``data.pkl``'s persistent ids without
  running the pickle) differs from its record, or a record missing;
- storages needing more bytes in all than ``limit`` (the memory available).
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["check_torch_archive", "storage_sizes"]

PICKLE_MAX_BYTES = 256 << 20
MAX_RECORDS = 1 << 20
_ITEMSIZE = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8,
    "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
    "ComplexDoubleStorage": 16, "ComplexFloatStorage": 8, "UntypedStorage": 1, "QInt8Storage": 1,
    "QUInt8Storage": 1, "QInt32Storage": 4, "Float8_e4m3fnStorage": 1, "Float8_e5m2Storage": 1,
    "UInt16Storage": 2, "UInt32Storage": 4, "UInt64Storage": 8,
}
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_INTS = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"}


def storage_sizes(pickle_bytes: bytes) -> dict[str, int]:
    """``storage key → bytes`` declared by a torch ``data.pkl``, read by walking its opcodes (nothing is executed).

    torch pickles each storage as the persistent id ``("storage", <torch.XStorage>, key, location, numel)``; this
    tracks just enough of the pickle machine's stack and memo to read those tuples.
    """
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    found: dict[str, int] = {}
    try:
        for op, arg, _ in pickletools.genops(pickle_bytes):
            name = op.name
            if name == "MARK":
                marks.append(len(stack))
            elif name in _STRINGS or name in _INTS:
                stack.append(arg)
            elif name == "GLOBAL":
                stack.append(("global", str(arg)))
            elif name == "STACK_GLOBAL":
                qual, mod = stack.pop(), stack.pop()
                stack.append(("global", f"{mod} {qual}"))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo.get(int(arg)))
            elif name == "TUPLE":
                k = marks.pop()
                stack[k:] = [tuple(stack[k:])]
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                stack[-n:] = [tuple(stack[-n:])]
            elif name == "BINPERSID":
                _record(stack.pop(), found)
                stack.append(None)
            else:  # any other opcode: pop what it consumes, push placeholders for what it produces
                if pickletools.markobject in op.stack_before:
                    del stack[marks.pop():]
                    n_before = len(op.stack_before) - 2  # the mark and the slice
                else:
                    n_before = len(op.stack_before)
                if n_before:
                    del stack[-n_before:]
                stack.extend([None] * len(op.stack_after))
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise ValueError(f"data.pkl is not a torch pickle ({type(e).__name__})") from None
    return found


def _record(pid: Any, found: dict[str, int]) -> None:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise ValueError("data.pkl holds a persistent id that is not a torch storage")
    kind, key, numel = pid[1], pid[2], pid[4]
    cls = kind[1].split(" ")[-1] if isinstance(kind, tuple) and kind[:1] == ("global",) else None
    if cls not in _ITEMSIZE or not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
        raise ValueError("data.pkl declares a storage of an unknown type or size")
    if found.setdefault(key, numel * _ITEMSIZE[cls]) != numel * _ITEMSIZE[cls]:
        raise ValueError(f"data.pkl declares storage {key[:40]!r} twice with different sizes")


def check_torch_archive(path: str | Path, limit: int | None) -> None:
    """Refuse (``ValueError``, one line) a ``torch.save`` file whose records could inflate past their bytes or whose
    storages need more than ``limit`` bytes (``None``: no limit). Reads the central directory and ``data.pkl`` only."""
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError):
        raise ValueError(f"{path.name} is not a torch.save zip archive") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_RECORDS:
            raise ValueError(f"{path.name} holds {len(infos):,} records; refused")
        for i in infos:
            if i.compress_type != zipfile.ZIP_STORED or i.file_size != i.compress_size:
                raise ValueError(f"{path.name}: record {i.filename!r} is compressed ({i.compress_size:,} bytes "
                                 f"claiming {i.file_size:,}); torch.save never compresses, refused before inflating")
        size = path.stat().st_size
        total = sum(i.file_size for i in infos)
        if total > size:
            raise ValueError(f"{path.name}: records claim {total:,} bytes but the file holds {size:,}")
        by_name = {i.filename: i for i in infos}
        pkl = [i for i in infos if i.filename.endswith("data.pkl")]
        if len(pkl) != 1:
            raise ValueError(f"{path.name} has no single data.pkl record; not a torch.save archive")
        if pkl[0].file_size > PICKLE_MAX_BYTES:
            raise ValueError(f"{path.name}: data.pkl is {pkl[0].file_size:,} bytes, over {PICKLE_MAX_BYTES:,}")
        prefix = pkl[0].filename[: -len("data.pkl")]
        needs = storage_sizes(zf.read(pkl[0]))
    for key, nbytes in needs.items():
        rec = by_name.get(f"{prefix}data/{key}")
        if rec is None:
            raise ValueError(f"{path.name}: the record of storage {key[:40]!r} is missing")
        if rec.file_size != nbytes:
            raise ValueError(f"{path.name}: storage {key[:40]!r} needs {nbytes:,} bytes but its record holds "
                             f"{rec.file_size:,}")
    need = sum(needs.values())
    if limit is not None and need > limit:
        raise ValueError(f"{path.name} needs {need:,} bytes of memory, more than the {limit:,} available "
                         "(--force-memory to try anyway)")
