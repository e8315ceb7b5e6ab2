"""The embedded default corpus: English prose assembled at run time from documentation every CPython ships.

Two sources, both inside the interpreter, so ``k3 train`` needs no download:

1. ``pydoc_data.topics`` — the Language Reference sections that ``help()`` shows (~0.5 MB of English).
2. Docstrings of a fixed list of pure-Python standard-library modules, their public classes, functions and
   methods, cleaned with ``inspect.cleandoc``.

Documents come in a fixed order (sorted names), so the text is identical on every run of the same Python version.
Every 20th document (``VAL_FRACTION`` = 5 %) is the validation split.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings

__all__ = ["embedded_documents", "embedded_text", "embedded_split", "DOC_MODULES", "VAL_FRACTION"]

VAL_FRACTION = 0.05

# Pure-Python, side-effect-free modules with substantial English docstrings. (Never "this" or "antigravity".)
DOC_MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis",
    "email.message", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.client", "http.cookies", "imaplib",
    "inspect", "io", "ipaddress", "itertools", "json", "json.decoder", "json.encoder", "locale", "logging",
    "lzma", "mailbox", "mimetypes", "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pickle",
    "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint", "queue", "quopri", "random", "re",
    "reprlib", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "types", "typing", "unittest", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "wave", "xml.dom.minidom", "xml.etree.ElementTree",
    "zipfile", "zipimport",
)


def _topic_documents() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some stripped-down Pythons drop pydoc_data; the docstrings still suffice
        return []
    return [topics[k].strip() for k in sorted(topics) if topics[k].strip()]


def _member_docs(owner: object, prefix: str) -> list[str]:
    """Docstrings of the public classes/functions defined on ``owner`` (and of a class's methods), sorted by name."""
    docs = []
    for name in sorted(vars(owner)):
        if name.startswith("_"):
            continue
        obj = vars(owner)[name]
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != prefix.split(":")[0]:
            continue  # re-exported from elsewhere: documented once, where it is defined
        doc = obj.__doc__
        if isinstance(doc, str) and len(doc.split()) >= 5:
            docs.append(f"{prefix}{name}\n\n{inspect.cleandoc(doc)}")
        if inspect.isclass(obj):
            docs.extend(_member_docs(obj, f"{prefix}{name}."))
    return docs


def _module_documents(name: str) -> list[str]:
    try:
        mod = importlib.import_module(name)
    except Exception:  # a module missing from this build (e.g. no _lzma): skip it, deterministically
        return []
    docs = []
    if isinstance(mod.__doc__, str) and mod.__doc__.strip():
        docs.append(f"{name}\n\n{inspect.cleandoc(mod.__doc__)}")
    docs.extend(_member_docs(mod, f"{name}:"))
    return docs


@functools.lru_cache(maxsize=1)
def embedded_documents() -> tuple[str, ...]:
    """All documents of the embedded corpus, in their fixed order (topics first, then module docstrings)."""
    docs = _topic_documents()
    with warnings.catch_warnings():  # deprecated modules (typing.io, …) warn when their docs are read
        warnings.simplefilter("ignore")
        for name in DOC_MODULES:
            docs.extend(_module_documents(name))
    # Keep what reads as prose: docstrings that are mostly ASCII letters and spaces.
    return tuple(d for d in docs if sum(c.isascii() for c in d) >= 0.98 * len(d))


def embedded_split(split: str = "train") -> tuple[str, ...]:
    """``"val"``: every 20th document (so both splits mix topics and docstrings alike); ``"train"``: the rest."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    every = round(1 / VAL_FRACTION)
    docs = embedded_documents()
    return tuple(d for i, d in enumerate(docs) if (i % every == every - 1) == (split == "val"))


def embedded_text(split: str = "train") -> str:
    """The split as one string, documents separated by blank lines."""
    return "\n\n".join(embedded_split(split))
