"""The embedded corpus: non-empty English prose from CPython's own docs, identical in every process."""

import hashlib
import subprocess
import sys

from k3.data.corpus import embedded_documents, embedded_split, embedded_text

COMMON = ("the", "of", "and", "to", "is", "a", "in", "that", "for", "be")


def test_corpus_is_large_and_split_disjointly():
    docs = embedded_documents()
    train, val = embedded_split("train"), embedded_split("val")
    assert len(docs) > 200 and sum(map(len, docs)) > 300_000
    assert len(train) + len(val) == len(docs) and len(val) >= 10
    assert not set(train) & set(val) or len(set(docs)) < len(docs)  # disjoint unless a docstring repeats
    assert len(embedded_text("val")) > 10_000


def test_corpus_is_english():
    text = embedded_text("train")
    words = text.lower().split()
    share = sum(w in COMMON for w in words) / len(words)
    assert share > 0.12, share  # English prose: the 10 commonest words are ~20% of tokens; code or noise is far less
    assert sum(c.isascii() for c in text) / len(text) > 0.99
    letters = sum(c.isalpha() for c in text) / len(text)
    assert 0.6 < letters < 0.9, letters


def test_corpus_is_deterministic_across_processes():
    here = hashlib.sha256(embedded_text("train").encode()).hexdigest()
    code = ("import hashlib; from k3.data.corpus import embedded_text;"
            "print(hashlib.sha256(embedded_text('train').encode()).hexdigest())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there
