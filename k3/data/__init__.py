"""Data: the embedded corpus, the recall task, file/.bin readers, tokenizers and resumable loaders."""

from __future__ import annotations

from pathlib import Path

from k3.data.corpus import embedded_split
from k3.data.files import load_tokens, tokenize_documents
from k3.data.loader import RecallLoader, TokenStream, WindowLoader, eval_windows
from k3.data.recall import IGNORE, RecallTask, recall_accuracy
from k3.data.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_from_dict

__all__ = [
    "EMBEDDED",
    "IGNORE",
    "ByteTokenizer",
    "RecallLoader",
    "RecallTask",
    "TokenStream",
    "Tokenizer",
    "WindowLoader",
    "eval_windows",
    "load_tokenizer",
    "recall_accuracy",
    "text_streams",
    "tokenizer_from_dict",
]

EMBEDDED = "embedded"  # the --data value meaning "the corpus built from CPython's own documentation"
VAL_FRACTION = 0.01  # held out of user data when no --val-data is given


HF_DEFAULT_MAX_TOKENS = 10_000_000  # a streamed Hugging Face dataset is read up to this unless told otherwise


def text_streams(data: str | Path, tok: Tokenizer, seq_len: int, val_data: str | Path | None = None,
                 text_field: str = "text", max_tokens: int | None = None) -> tuple[TokenStream, TokenStream]:
    """``(train, val)`` token streams for ``--data`` (``"embedded"``, a path, a glob or ``hf:NAME``).

    The embedded corpus has its own document-level split; user data holds out its last 1 % (at least two windows)
    unless ``val_data`` is given. ``max_tokens`` caps how much text is tokenized (``.bin`` shards are memory-mapped
    whole); ``hf:`` datasets default to ``HF_DEFAULT_MAX_TOKENS``.
    """
    if max_tokens is None and str(data).startswith("hf:"):
        max_tokens = HF_DEFAULT_MAX_TOKENS
    if str(data) == EMBEDDED:
        train = TokenStream([tokenize_documents(embedded_split("train"), tok)])
        val = TokenStream([tokenize_documents(embedded_split("val"), tok)])
    else:
        train = TokenStream(load_tokens(data, tok, text_field, max_tokens))
        if val_data is not None:
            val = TokenStream(load_tokens(val_data, tok, text_field))
        else:
            train, val = train.split(VAL_FRACTION, min_val=2 * (seq_len + 1))
    return train, val
