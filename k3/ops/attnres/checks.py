"""Input checks shared by every AttnRes entry: bad input is a ``ValueError`` naming the argument."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["check_inputs"]

_NAMES = ("query", "sources", "norm_weight", "out_norm_weight", "eps")


def _check_vector(t: object, name: str, D: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (D,):
        raise ValueError(f"{name} must be a [D] = [{D}] tensor, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} lives on {t.device} but the sources on {device}")


def check_inputs(
    query: torch.Tensor, sources: Sequence[torch.Tensor] | torch.Tensor, norm_weight: torch.Tensor | None,
    out_norm_weight: torch.Tensor | None, eps: float, names: tuple[str, ...] = _NAMES,
) -> list[torch.Tensor]:
    """Validate and return the sources as a list (a stacked ``[N, ..., D]`` tensor is split along dim 0).

    All sources must share one shape ``[..., D]``, one floating dtype and one device; ``query``, ``norm_weight`` and
    ``out_norm_weight`` are ``[D]`` on that device; ``eps > 0``. ``names`` are the caller's argument names."""
    n_query, n_src, n_w, n_ow, n_eps = names
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2:
            raise ValueError(f"{n_src} as a tensor must be [N, ..., D], got shape {tuple(sources.shape)}")
        sources = list(sources.unbind(0))
    elif not isinstance(sources, (list, tuple)):
        raise ValueError(f"{n_src} must be a list of tensors, got {type(sources).__name__}")
    if len(sources) == 0:
        raise ValueError(f"{n_src} must hold at least one tensor")
    first = sources[0]
    if not isinstance(first, torch.Tensor) or first.dim() < 1 or not first.dtype.is_floating_point:
        raise ValueError(f"{n_src}[0] must be a floating-point [..., D] tensor, got "
                         f"{getattr(first, 'dtype', type(first).__name__)} {tuple(getattr(first, 'shape', ()))}")
    for i, s in enumerate(sources):
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"{n_src}[{i}] must be a tensor, got {type(s).__name__}")
        if s.shape != first.shape:
            raise ValueError(f"{n_src}[{i}] has shape {tuple(s.shape)}, expected {tuple(first.shape)} like "
                             f"{n_src}[0]")
        if s.dtype != first.dtype:
            raise ValueError(f"{n_src}[{i}] has dtype {s.dtype}, expected {first.dtype} like {n_src}[0]")
        if s.device != first.device:
            raise ValueError(f"{n_src}[{i}] lives on {s.device}, expected {first.device} like {n_src}[0]")
    D = first.shape[-1]
    _check_vector(query, n_query, D, first.device)
    for t, name in ((norm_weight, n_w), (out_norm_weight, n_ow)):
        if t is not None:
            _check_vector(t, name, D, first.device)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"{n_eps} must be a positive number, got {eps!r}")
    return list(sources)
