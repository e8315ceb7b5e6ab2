"""Tokenizers behind one small interface: byte-level (the default), a tiktoken BPE file, a Hugging Face tokenizer.json.

Every tokenizer has ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``, ``bos_id``, ``eos_id``,
``pad_id``, ``stop_ids`` (a set: generation stops on any of them) and ``to_dict()``; ``tokenizer_from_dict(d,
root)`` rebuilds one, so a run directory records which tokenizer it trained with (``tokenizer_spec.json``, with the
tokenizer file copied beside it).

``decode_bytes(ids)`` returns the raw UTF-8 bytes where a tokenizer knows them (byte-level, tiktoken): the streaming
decoder in ``k3.infer.generate`` uses it so a character split across tokens is printed only once it is complete.
"""

from __future__ import annotations

import base64
import binascii
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

from k3.utils import atomic_write_with, confined, sha256_file

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "TiktokenTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "tokenizer_from_dict",
    "read_tiktoken_ranks",
    "TOKENIZER_SPEC",
]

TOKENIZER_SPEC = "tokenizer_spec.json"
TOKENIZER_MAX_BYTES = 512 << 20  # real vocabularies: a few MB (tiktoken.model) to tens of MB (tokenizer.json)

# A GPT-style pre-tokenisation regex (contractions, letter runs, digit runs of ≤ 3, punctuation, whitespace).
# Used for tiktoken files that do not come with their own pattern.
DEFAULT_BPE_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class Tokenizer:
    """Common interface; subclasses fill in ``encode``/``decode`` and the ids."""

    kind: str = "base"
    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text; the BPE tokenizers spread a batch over the CPU cores."""
        return [self.encode(t) for t in texts]

    def decode_bytes(self, ids: Iterable[int]) -> bytes | None:
        """Raw bytes of ``ids`` (specials dropped), or ``None`` when the tokenizer cannot say."""
        return None

    @property
    def stop_ids(self) -> set[int]:
        return {self.eos_id} if self.eos_id is not None else set()

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, run_dir: str | Path) -> dict[str, Any]:
        """Copy what this tokenizer needs into ``run_dir`` and return the spec that ``tokenizer_from_dict`` reads."""
        return self.to_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


# --------------------------------------------------------------------------------------------------------------
class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0–255 plus specials bos=256, eos=257, (258 unused), pad=259: vocab 260, preset ``tiny``'s."""

    kind = "byte"

    def __init__(self) -> None:
        self.vocab_size = 260
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 259

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "byte"}


# --------------------------------------------------------------------------------------------------------------
def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one ``<base64 token> <rank>`` per line (Kimi ships it as ``tiktoken.model``).

    ``ValueError`` on a malformed line, ranks that are not exactly 0 … n−1, or a missing single-byte token.
    (tiktoken's own ``load_tiktoken_bpe`` checks none of that and caches files by path in a temp directory.)
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"tokenizer file {path} cannot be read: {e.strerror}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error):  # the line itself is not echoed: it may be any bytes
            raise ValueError(f"{path}:{lineno}: expected '<base64 token> <rank>'") from None
    if not ranks:
        raise ValueError(f"{path} holds no BPE ranks")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0 … {len(ranks) - 1} with no gaps or repeats")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # byte-level BPE must be able to fall back to single bytes (tiktoken panics otherwise)
        raise ValueError(f"{path} lacks {len(missing)} single-byte token(s) (e.g. byte {missing[0]}): not a "
                         "byte-level BPE file")
    return ranks


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file plus special tokens appended after the last rank.

    ``specials`` maps names to ids; by default ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` get ranks n, n+1, n+2.
    """

    kind = "tiktoken"

    def __init__(
        self,
        path: str | Path,
        specials: dict[str, int] | None = None,
        pattern: str = DEFAULT_BPE_PATTERN,
        bos: str | None = "<|bos|>",
        eos: str | None = "<|eos|>",
        pad: str | None = "<|pad|>",
    ) -> None:
        try:
            import tiktoken
        except ImportError:
            raise ValueError("a tiktoken tokenizer needs the 'tiktoken' package: pip install 'k3[tokenizers]'") \
                from None
        self.path = Path(path)
        ranks = read_tiktoken_ranks(self.path)
        n = len(ranks)
        if specials is None:
            specials = {name: n + i for i, name in enumerate(s for s in (bos, eos, pad) if s is not None)}
        self.specials = dict(specials)
        self.pattern = pattern
        self._enc = tiktoken.Encoding(
            name=f"k3-{self.path.stem}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=self.specials
        )
        self.vocab_size = max([n - 1, *self.specials.values()]) + 1
        self.bos_id = self.specials.get(bos) if bos else None
        self.eos_id = self.specials.get(eos) if eos else None
        self.pad_id = self.specials.get(pad) if pad else None
        self._n_ranks = n

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self._enc.encode_ordinary(text)  # special-token text in user data stays plain text

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        _check_texts(texts)
        return self._enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self._enc.decode_bytes([int(i) for i in ids if 0 <= int(i) < self._n_ranks])  # specials: not text

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "tiktoken", "path": str(self.path), "sha256": sha256_file(self.path), "specials": self.specials,
                "pattern": self.pattern, "bos": self._name(self.bos_id), "eos": self._name(self.eos_id),
                "pad": self._name(self.pad_id)}

    def _name(self, i: int | None) -> str | None:
        return next((k for k, v in self.specials.items() if v == i), None) if i is not None else None

    def save(self, run_dir: str | Path) -> dict[str, Any]:
        d = self.to_dict()
        dst = Path(run_dir) / "tokenizer_files" / self.path.name
        _copy_atomic(self.path, dst)
        d["path"] = str(dst.relative_to(run_dir))
        return d


# --------------------------------------------------------------------------------------------------------------
_BOS_NAMES = ("<|bos|>", "<s>", "<bos>", "[BOS]", "<|begin_of_text|>", "<|startoftext|>", "<|im_start|>")
_EOS_NAMES = ("<|eos|>", "</s>", "<eos>", "[EOS]", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (via the ``tokenizers`` package). bos/eos/pad are found by their usual
    names among the added tokens unless given."""

    kind = "hf"

    def __init__(self, path: str | Path, bos: str | None = None, eos: str | None = None,
                 pad: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise ValueError("a tokenizer.json needs the 'tokenizers' package: pip install 'k3[tokenizers]'") from None
        self.path = Path(path)
        try:
            self._tok = _HF.from_file(str(self.path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"tokenizer file {self.path} is not a valid Hugging Face tokenizer.json: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_name = bos or self._find(_BOS_NAMES)
        self.eos_name = eos or self._find(_EOS_NAMES)
        self.pad_name = pad or self._find(_PAD_NAMES)
        self.bos_id = self._id(self.bos_name, "bos")
        self.eos_id = self._id(self.eos_name, "eos")
        self.pad_id = self._id(self.pad_name, "pad")

    def _find(self, names: tuple[str, ...]) -> str | None:
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return next((n for n in names if n in vocab), None)

    def _id(self, name: str | None, what: str) -> int | None:
        if name is None:
            return None
        i = self._tok.token_to_id(name)
        if i is None:
            raise ValueError(f"{what} token {name!r} is not in tokenizer {self.path}")
        return int(i)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        _check_texts(texts)
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "hf", "path": str(self.path), "sha256": sha256_file(self.path), "bos": self.bos_name,
                "eos": self.eos_name, "pad": self.pad_name}

    def save(self, run_dir: str | Path) -> dict[str, Any]:
        d = self.to_dict()
        dst = Path(run_dir) / "tokenizer_files" / "tokenizer.json"
        _copy_atomic(self.path, dst)
        d["path"] = str(dst.relative_to(run_dir))
        return d


def _check_texts(texts: Sequence[str]) -> None:
    bad = next((t for t in texts if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"texts must be str, got {type(bad).__name__}")


def _copy_atomic(src: Path, dst: Path) -> None:
    atomic_write_with(dst, lambda tmp: shutil.copyfile(src, tmp))


# --------------------------------------------------------------------------------------------------------------
def load_tokenizer(spec: str | Path | None) -> Tokenizer:
    """``None``/``"byte"`` → byte-level; a ``.json`` file or a directory holding ``tokenizer.json`` → Hugging Face;
    any other file (``tiktoken.model``, ``*.tiktoken``) or a directory holding ``tiktoken.model`` → tiktoken."""
    if spec is None or str(spec) == "byte":
        return ByteTokenizer()
    p = Path(spec)
    if p.is_dir():
        for name, cls in (("tokenizer.json", HFTokenizer), ("tiktoken.model", TiktokenTokenizer)):
            if (p / name).is_file():
                return cls(bounded_tokenizer_file(confined(p, name, f"tokenizer directory {p}: {name}")))
        raise ValueError(f"tokenizer directory {p} holds neither tokenizer.json nor tiktoken.model")
    if not p.is_file():
        raise ValueError(f"tokenizer {str(spec)!r} is neither 'byte' nor an existing file or directory")
    bounded_tokenizer_file(p)
    return HFTokenizer(p) if p.suffix == ".json" else TiktokenTokenizer(p)


def bounded_tokenizer_file(path: Path) -> Path:
    """``path``, after checking it is no larger than a real vocabulary file can be (``TOKENIZER_MAX_BYTES``)."""
    size = path.stat().st_size
    if size > TOKENIZER_MAX_BYTES:
        raise ValueError(f"tokenizer file {path} is {size:,} bytes, over the {TOKENIZER_MAX_BYTES:,}-byte limit "
                         "(real vocabularies take a few MB)")
    return path


def tokenizer_from_dict(d: dict[str, Any], root: str | Path | None = None) -> Tokenizer:
    """Rebuild a tokenizer from ``to_dict()``/``save()`` output; relative paths are taken from ``root``."""
    if not isinstance(d, dict) or "kind" not in d:
        raise ValueError(f"tokenizer spec must be a dict with a 'kind', got {d!r}")
    kind = d["kind"]
    if kind == "byte":
        return ByteTokenizer()
    if kind not in ("tiktoken", "hf"):
        raise ValueError(f"tokenizer spec kind must be 'byte', 'tiktoken' or 'hf', got {kind!r}")
    if root is not None:  # a spec inside a checkpoint names a file of that checkpoint, nothing else
        path = confined(root, d.get("path"), f"{TOKENIZER_SPEC} path")
    else:
        path = Path(str(d.get("path")))
    if not path.is_file():
        raise ValueError(f"tokenizer file {path} named by the tokenizer spec is missing")
    bounded_tokenizer_file(path)
    specials = d.get("specials", {})
    if not isinstance(specials, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                                 for k, v in specials.items()):
        raise ValueError(f"{TOKENIZER_SPEC} specials must map token names to integer ids")
    if d.get("sha256") and sha256_file(path) != d["sha256"]:
        raise ValueError(f"tokenizer file {path} differs from the one the run trained with (sha256 mismatch)")
    if kind == "hf":
        return HFTokenizer(path, bos=d.get("bos"), eos=d.get("eos"), pad=d.get("pad"))
    return TiktokenTokenizer(path, specials=specials, pattern=d.get("pattern", DEFAULT_BPE_PATTERN),
                             bos=d.get("bos"), eos=d.get("eos"), pad=d.get("pad"))
