"""Say once, on stderr, when a fast path is unavailable and why, instead of falling back in silence.

The kernels are verified on one Triton release (``VERIFIED_TRITON``; ``pyproject.toml`` pins it). A fallback that a
user would otherwise never notice — the PyTorch references on a GPU because triton is missing, the Triton decode
because Gluon's experimental API moved — prints one line the first time it happens in the process, e.g.

    k3: Gluon decode needs triton 3.6.x, found 3.8.0: using the Triton kernels
"""

from __future__ import annotations

import functools
import os
import sys

__all__ = ["VERIFIED_TRITON", "triton_version", "fallback_notice", "forced_backend"]

VERIFIED_TRITON = (3, 6)  # the release every Triton and Gluon kernel here is tested on

_said: set[str] = set()


@functools.lru_cache(maxsize=1)
def triton_version() -> str | None:
    """The installed triton's version string, or None when it does not import."""
    try:
        import triton
    except Exception:  # noqa: BLE001 — absent, or broken by a CUDA/driver mismatch: either way not usable
        return None
    return str(triton.__version__)


def fallback_notice(path: str, why: str, instead: str) -> None:
    """``k3: {path} {why}: using {instead}`` on stderr, once per ``path`` and process."""
    if path in _said:
        return
    _said.add(path)
    sys.stderr.write(f"k3: {path} {why}: using {instead}\n")
    sys.stderr.flush()


def forced_backend(env: str) -> str | None:
    """'triton' or 'torch' when the environment variable ``env`` forces one (read at call time), None when it is
    unset or 'auto'; ``ValueError`` naming it for anything else."""
    forced = os.environ.get(env, "").strip().lower()
    if forced not in ("", "auto", "torch", "triton"):
        raise ValueError(f"{env} must be 'triton', 'torch' or unset, got {forced!r}")
    return forced if forced in ("torch", "triton") else None
