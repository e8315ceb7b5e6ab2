"""The Kimi K3 tokenizer: tiktoken BPE from a folder's ``tiktoken.model`` plus K3's 256 specials and chat format.

- ``tiktoken.model``: one ``<base64 token> <rank>`` per line; the release has 163,584 ranks.
- 256 reserved specials follow the BPE ranks (163,584 … 163,839 in the release, so vocab 163,840).  The named ones
  (``SPECIAL_NAMES``; a folder's ``tokenizer_config.json`` ``added_tokens_decoder`` overrides them) include
  ``[BOS]`` +0, ``[EOS]`` +1 (document end), ``<|end_of_msg|>`` +2 (ends a chat turn: the stop token, and the
  config's ``eos_token_id``), ``<|open|>`` +3, ``<|close|>`` +4, ``<|sep|>`` +5.  Unnamed slots are
  ``<|reserved_token_{id}|>``.
- Pre-tokenizer: K3's regex (the same as K2's), eight alternatives; its "letters but not Han" classes use the
  character-class intersection ``[…&&[^\\p{Han}]]``.  tiktoken's own Rust regex engine accepts that syntax (tested
  in ``tests/data/test_k3_tokenizer.py`` by a split that only intersection gets right), so the released pattern string
  is used unchanged and the Python ``regex`` package is not needed.
- ``encode(text)`` treats every special-looking string in ``text`` as ordinary text (user text can never inject a
  control token); ``chat_prompt`` emits the structural specials by id.

Chat format "XTML" (rendered in Python, no Jinja), per message::

    <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>

an assistant body is ``[<|open|>think<|sep|>REASONING<|close|>think<|sep|>]<|open|>response<|sep|>TEXT<|close|>response<|sep|>``
(the think channel only in thinking mode), and the generation prefix is
``<|open|>message role="assistant"<|sep|><|open|>response<|sep|>`` (``think`` in thinking mode).  Each literal piece
(tag name, `` role``, ``="``, the value, ``"``, the text) is BPE-encoded on its own, as the reference renderer does,
so token boundaries match it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

from k3.data.tokenizers import bounded_tokenizer_file, read_tiktoken_ranks
from k3.utils import confined, read_json

__all__ = ["K3Tokenizer", "load_k3_tokenizer", "K3_PAT_STR", "SPECIAL_NAMES", "NUM_SPECIALS"]

NUM_SPECIALS = 256
# offset from the first special id → name, as in the released tokenizer_config.json
SPECIAL_NAMES: dict[int, str] = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    65: "<osagent_mode>", 254: "[UNK]", 255: "[PAD]",
}

_AND = "&" * 2  # regex class intersection
_UPPER_NOT_HAN = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}" + _AND + r"[^\p{Han}]]"
_LOWER_NOT_HAN = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}" + _AND + r"[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
K3_PAT_STR = "|".join([
    r"[\p{Han}]+",                                                        # runs of Han characters
    r"[^\r\n\p{L}\p{N}]?" + _UPPER_NOT_HAN + "*" + _LOWER_NOT_HAN + "+" + _CONTRACTION,  # (Cap)lower words
    r"[^\r\n\p{L}\p{N}]?" + _UPPER_NOT_HAN + "+" + _LOWER_NOT_HAN + "*" + _CONTRACTION,  # UPPER words
    r"\p{N}{1,3}",                                                        # numbers, ≤ 3 digits a piece
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",                                         # punctuation runs
    r"\s*[\r\n]+",                                                        # newlines
    r"\s+(?!\S)",                                                         # trailing spaces
    r"\s+",
])

_MAX_CHARS = 400_000  # tiktoken is fed at most this many characters at a time …
_MAX_RUN = 25_000  # … and no longer runs of whitespace or of non-whitespace (its regex is slow on them)


def _special_names(folder: Path | None, n_base: int) -> dict[int, str]:
    """Absolute id → name for the 256 specials; ``tokenizer_config.json``'s ``added_tokens_decoder`` wins."""
    names = {n_base + off: name for off, name in SPECIAL_NAMES.items()}
    cfg = folder / "tokenizer_config.json" if folder is not None else None
    if cfg is not None and cfg.is_file():
        raw = read_json(confined(cfg.parent, cfg.name, "tokenizer_config.json"), str(cfg))
        decoder = (raw.get("added_tokens_decoder") if isinstance(raw, dict) else None) or {}
        if not isinstance(decoder, dict) or not all(k.isdigit() for k in decoder):
            raise ValueError(f"{cfg} added_tokens_decoder must map token ids to tokens")
        for k, v in decoder.items():
            i = int(k)
            content = v.get("content") if isinstance(v, dict) else v
            if n_base <= i < n_base + NUM_SPECIALS and isinstance(content, str):
                names[i] = content
    out = {i: names.get(i, f"<|reserved_token_{i}|>") for i in range(n_base, n_base + NUM_SPECIALS)}
    if len(set(out.values())) != NUM_SPECIALS:
        raise ValueError("special token names must be distinct")
    return out


def _pieces(text: str) -> Iterator[str]:
    """Cut text into ≤ 400k-character blocks, each cut again so no whitespace/non-whitespace run exceeds 25k."""
    for i in range(0, len(text), _MAX_CHARS):
        block = text[i:i + _MAX_CHARS]
        start, run, prev_space = 0, 0, None
        for j, ch in enumerate(block):
            space = ch.isspace()
            run = run + 1 if space == prev_space else 1
            prev_space = space
            if run > _MAX_RUN:
                yield block[start:j]
                start, run = j, 1
        yield block[start:]


class K3Tokenizer:
    """K3's BPE + specials.  Common interface (as ``k3.data.tokenizers``): ``encode``, ``decode``, ``decode_bytes``,
    ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``stop_ids``; plus ``chat_prompt`` and ``special_id``."""

    kind = "k3"

    def __init__(self, ranks: dict[bytes, int], special_names: dict[int, str] | None = None,
                 name: str = "k3") -> None:
        try:
            import tiktoken
        except ImportError:
            raise ValueError("the K3 tokenizer needs tiktoken: pip install tiktoken") from None
        n_base = len(ranks)
        names = special_names or {n_base + off: nm for off, nm in SPECIAL_NAMES.items()}
        names = {i: names.get(i, f"<|reserved_token_{i}|>") for i in range(n_base, n_base + NUM_SPECIALS)}
        self.specials: dict[str, int] = {nm: i for i, nm in names.items()}
        self._enc = tiktoken.Encoding(name=name, pat_str=K3_PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=self.specials)
        self.n_base = n_base
        self.vocab_size = n_base + NUM_SPECIALS
        self.bos_id = self.special_id("[BOS]")
        self.doc_eos_id = self.special_id("[EOS]")
        self.eos_id = self.special_id("<|end_of_msg|>")  # ends a turn; the config's eos_token_id
        self.pad_id = self.special_id("[PAD]")
        self.stop_ids: set[int] = {self.eos_id, self.doc_eos_id}  # generation stops on either
        self._open, self._close = self.special_id("<|open|>"), self.special_id("<|close|>")
        self._sep = self.special_id("<|sep|>")

    # --- ids ------------------------------------------------------------------------------------------------------
    def special_id(self, name: str) -> int:
        if name not in self.specials:
            raise ValueError(f"{name!r} is not a special token of this tokenizer")
        return self.specials[name]

    # --- text ↔ ids ------------------------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text → ids.  Special-token strings in ``text`` stay ordinary text unless ``allow_special``."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids: list[int] = []
        for piece in _pieces(text):
            if allow_special:
                ids.extend(self._enc.encode(piece, allowed_special="all"))
            else:
                ids.extend(self._enc.encode(piece, allowed_special=set(), disallowed_special=()))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text (invalid UTF-8 becomes U+FFFD).  ``ValueError`` on an id outside [0, vocab_size)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {bad[:8]}")
        return self._enc.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Raw bytes of ``ids`` with the special tokens dropped (for streaming a character split across tokens)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {bad[:8]}")
        return self._enc.decode_bytes([i for i in ids if i < self.n_base])

    def __repr__(self) -> str:
        return f"K3Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"

    # --- chat ---------------------------------------------------------------------------------------------------
    def _text(self, s: Any) -> list[int]:
        return self.encode(str(s)) if s not in (None, "") else []

    def _open_tag(self, tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[int]:
        ids = [self._open] + self._text(tag)
        for key, value in attrs:
            escaped = str(value).replace("&", "&amp;").replace('"', "&quot;")
            ids += self._text(f" {key}") + self._text('="') + self._text(escaped) + self._text('"')
        return ids + [self._sep]

    def _close_tag(self, tag: str) -> list[int]:
        return [self._close] + self._text(tag) + [self._sep]

    def _message(self, msg: dict[str, Any], thinking: bool, tool_index: int) -> list[int]:
        role = msg["role"]
        attrs: list[tuple[str, Any]] = [("role", role)]
        if role == "tool":
            tool = msg.get("tool", msg.get("name"))
            if not tool:
                raise ValueError("a tool message needs a 'tool' (or 'name') field naming the tool")
            attrs += [("tool", tool), ("index", tool_index)]
        elif msg.get("name"):
            attrs.append(("name", msg["name"]))
        ids = self._open_tag("message", attrs)
        if role == "assistant":
            if thinking:
                reasoning = msg.get("reasoning_content") or ""
                ids += self._open_tag("think") + self._text(reasoning if reasoning.strip() else "")
                ids += self._close_tag("think")
            ids += self._open_tag("response") + self._text(msg.get("content")) + self._close_tag("response")
        else:
            ids += self._text(msg.get("content"))
        return ids + self._close_tag("message") + [self.eos_id]

    def chat_prompt(self, messages: Sequence[dict[str, Any]], thinking: bool = False) -> list[int]:
        """Render ``messages`` ({"role": user|system|assistant|tool, "content": str, optional "name",
        "reasoning_content", "tool"}) and append the assistant generation prefix (instruct: ``response`` channel;
        thinking: ``think`` channel).  Message text is encoded with specials disallowed.  No [BOS] is prepended."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        ids: list[int] = []
        tool_index = 0
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or msg.get("role") not in ("user", "system", "assistant", "tool"):
                raise ValueError(f"messages[{i}] must be a dict with role user/system/assistant/tool, got {msg!r:.80}")
            content = msg.get("content")
            if content is not None and not isinstance(content, str):
                raise ValueError(f"messages[{i}]['content'] must be a str, got {type(content).__name__}")
            tool_index = tool_index + 1 if msg["role"] == "tool" else (0 if msg["role"] == "assistant" else tool_index)
            ids += self._message(msg, thinking, tool_index)
        ids += self._open_tag("message", [("role", "assistant")])
        return ids + self._open_tag("think" if thinking else "response")


def load_k3_tokenizer(path: str | Path) -> K3Tokenizer:
    """K3 tokenizer from a folder holding ``tiktoken.model`` (and optionally ``tokenizer_config.json``), or from the
    ``tiktoken.model`` file itself."""
    p = Path(path)
    model = p / "tiktoken.model" if p.is_dir() else p
    if not model.is_file():
        raise ValueError(f"no tiktoken.model at {p}: expected a K3 checkpoint folder or the tiktoken.model file")
    if p.is_dir():  # a folder's tokenizer is the folder's own file, not a symlink out of it
        model = confined(p, "tiktoken.model", "the tokenizer file")
    ranks = read_tiktoken_ranks(bounded_tokenizer_file(model))
    return K3Tokenizer(ranks, _special_names(model.parent, len(ranks)), name=model.name)
