"""The KDA arguments, declared once: checks, the validated flags object every backend receives, the in-kernel
activations in plain torch, and the backend registry.

Every entry point (``chunk_kda``, ``fused_recurrent_kda``, the split prefill, context parallel) builds one
:class:`KDAArgs` with :func:`kda_args` from its public arguments; the backends take the tensors plus that object.
An argument fla accepts and k3 does not yet is added here (a field, its check) and in the public signatures.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch

from k3.ops._fastpath import forced_backend
from k3.ops.kda.gate import check_lower_bound, kda_gate_fused

__all__ = ["KDAArgs", "kda_args", "check_kda_inputs", "expand_gva", "preprocess", "select_backend", "get_backend",
           "FlaOptions", "fla_options", "neg_eigval_beta", "check_state_v_first", "KDAAssertionError"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class KDAArgs(NamedTuple):
    """The validated, immutable flags of one KDA call (a tuple: built in ~1 µs, which a decode step notices).

    ``lower_bound`` is what the kernels may rely on: with the in-kernel gate it selects the bounded form
    lb·σ(e^A (f + dt)) (None: the softplus form); with a precomputed g it is set only under ``safe_gate`` (the
    caller's promise that every log-decay is ≥ it, −5 if not given), else None — any log-decay ≤ 0 is then computed
    exactly. ``N``: the number of sequences (B, or len(cu_seqlens) − 1)."""

    scale: float
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    lower_bound: float | None
    cu_seqlens: torch.Tensor | None
    N: int
    cu_seqlens_cpu: torch.Tensor | None = None  # the caller's host copy of cu_seqlens (fla's hint), if any

    @property
    def cu_host(self) -> torch.Tensor | None:
        """cu_seqlens for the host-side tables: the caller's CPU copy when given (no device round trip)."""
        return self.cu_seqlens_cpu if self.cu_seqlens_cpu is not None else self.cu_seqlens

    @property
    def flags(self) -> dict:
        """The kernels' compile-time switches."""
        return dict(l2norm=self.use_qk_l2norm_in_kernel, use_gate=self.use_gate_in_kernel,
                    beta_sigmoid=self.use_beta_sigmoid_in_kernel, exact_diag=self.lower_bound is None)


def _need(cond: bool, msg: str | Callable[[], str]) -> None:
    """Raise ``ValueError(msg)`` unless ``cond``. Messages that format shapes are passed as lambdas: building ~20
    f-strings per call cost ~20 µs, a fifth of a decode step, for calls that pass."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def _common_call_dims(
    q: object, k: object, v: object, g: object, beta: object, initial_state: object
) -> tuple[int, int, int, int, int] | None:
    """``(B, T, H, K, V)`` when the call is plainly valid (no cu_seqlens: the caller's condition), else None.

    The same conditions as the detailed checks below, as one short-circuit expression: an eager decode step has
    ~60 µs of host time to spare beside its 71 µs kernel, and the detailed checks took 20 µs of it on an H200
    machine's CPU, this 8.5 µs. A None sends the call through the detailed checks, which pass it or name what is
    wrong."""
    T_ = torch.Tensor
    if not (isinstance(q, T_) and isinstance(k, T_) and isinstance(v, T_) and isinstance(g, T_)
            and isinstance(beta, T_) and q.dim() == 4 and v.dim() == 4):
        return None
    qs, vs = q.shape, v.shape
    B, T, H, K = qs
    V = vs[3]
    dev, dt = q.device, q.dtype
    ok = (dt in _FLOAT and k.dtype == dt and v.dtype in _FLOAT and g.dtype in _FLOAT and beta.dtype in _FLOAT
          and k.shape == qs and g.shape == qs and vs[0] == B and vs[1] == T and vs[2] == H
          and beta.shape == (B, T, H) and K > 0 and V > 0 and H > 0
          and k.device == dev and v.device == dev and g.device == dev and beta.device == dev)
    if ok and initial_state is not None:
        s = initial_state
        ok = (isinstance(s, T_) and s.shape == (B, H, K, V) and s.device == dev
              and (s.dtype == torch.float32 or (s.dtype == torch.float64 and dt == torch.float64)))
    return (B, T, H, K, V) if ok else None


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[int, int, int, int, int]:
    """Validate fla-shaped KDA inputs; return ``(B, T, H, K, V)``. ``cu_seqlens_cpu``: a host copy of
    ``cu_seqlens`` whose values are checked instead (no device copy)."""
    dims = _common_call_dims(q, k, v, g, beta, initial_state) if cu_seqlens is None else None
    return dims if dims is not None else _checked_dims(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu)


def _checked_dims(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[int, int, int, int, int]:
    """``check_kda_inputs`` one condition at a time, each failure named."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _need(isinstance(x, torch.Tensor), lambda: f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _need(x.dtype in _FLOAT, lambda: f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")
        _need(x.device == q.device,
              lambda: f"{name} is on {x.device} but q is on {q.device}: all inputs must share a device")
    _need(q.dim() == 4, lambda: f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    _need(k.shape == q.shape, lambda: f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    _need(k.dtype == q.dtype, lambda: f"k must have q's dtype {q.dtype} (the kernels multiply them as one operand "
          f"type), got {k.dtype}")
    _need(v.dim() == 4 and v.shape[:2] == q.shape[:2],
          lambda: f"v must be [B, T, H, V] with q's B={B}, T={T}, got {tuple(v.shape)}")
    _need(v.shape[2] == H, lambda: f"v has {v.shape[2]} heads but q/k have H={H}: heads must match here (the public "
          "entry points expand q/k for grouped value attention first)")
    V = v.shape[-1]
    _need(g.shape == q.shape, lambda: f"g must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(g.shape)}")
    _need(beta.shape == (B, T, H), lambda: f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    _need(K > 0 and V > 0 and H > 0, lambda: f"head dims must be positive, got H={H}, K={K}, V={V}")
    N = B
    if cu_seqlens is not None:
        _need(isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2
              and not cu_seqlens.is_floating_point(),
              "cu_seqlens must be a 1-D integer tensor [N+1] of cumulative sequence lengths")
        _need(B == 1, lambda: f"cu_seqlens requires batch size B == 1 (sequences packed along T), got B={B}")
        N = cu_seqlens.numel() - 1
        if not torch.compiler.is_compiling():  # its values: a host sync, which a compiled graph cannot hold
            cs = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.detach().cpu()
            _need(int(cs[0]) == 0 and int(cs[-1]) == T and bool((cs[1:] >= cs[:-1]).all()),
                  lambda: f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, got {cs.tolist()}")
    if initial_state is not None:
        _need(isinstance(initial_state, torch.Tensor), "initial_state must be a tensor [N, H, K, V]")
        _need(initial_state.shape == (N, H, K, V),
              lambda: f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}], got {tuple(initial_state.shape)}")
        _need(initial_state.device == q.device, lambda: f"initial_state is on {initial_state.device}, q on {q.device}")
        ok = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        _need(initial_state.dtype in ok,
              lambda: f"initial_state must be fp32 (states are kept in fp32; fp64 only with fp64 inputs), "
              f"got {initial_state.dtype}")
    return B, T, H, K, V


def kda_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    safe_gate: bool,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    check_cu_seqlens: bool = True,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> KDAArgs:
    """Check one KDA call (``ValueError`` naming the argument) and build its :class:`KDAArgs`. q, k already have
    v's head count (:func:`expand_gva`). ``check_cu_seqlens=False``: ``cu_seqlens`` are not this tensor's lengths
    (context parallel's global ones, which its context checks)."""
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state,
                                     cu_seqlens=cu_seqlens if check_cu_seqlens else None,
                                     cu_seqlens_cpu=cu_seqlens_cpu if check_cu_seqlens else None)
    if scale is None:
        scale = K**-0.5
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a positive float, got {scale!r}") from None
    _need(scale > 0 and scale != float("inf"), lambda: f"scale must be a positive finite float, got {scale}")
    lb = None if lower_bound is None else check_lower_bound(lower_bound)
    if use_gate_in_kernel:
        _need(lb is not None or A_log is not None,
              "A_log must be given when use_gate_in_kernel=True and lower_bound is None (softplus gate)")
        _need(not safe_gate or lb is not None,
              "lower_bound must be set when safe_gate=True and use_gate_in_kernel=True")
        for name, x, n in (("A_log", A_log, H), ("dt_bias", dt_bias, H * K)):
            if x is None or (isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() == n
                             and x.device == q.device):
                continue  # valid: skip the three _need calls below (host time, as in _common_call_dims)
            _need(isinstance(x, torch.Tensor) and x.is_floating_point(), lambda: f"{name} must be a floating tensor")
            _need(x.numel() == n, lambda: f"{name} must have {n} elements ([{'H' if n == H else 'H*K'}]), "
                                  f"got shape {tuple(x.shape)}")
            _need(x.device == q.device, lambda: f"{name} is on {x.device} but q is on {q.device}")
    else:
        # With a precomputed g the kernels read the bound as "every log-decay is ≥ this": their 16-row diagonal
        # blocks rely on it (e^{−g} over a block must stay finite). Only safe_gate makes that promise; a lower_bound
        # alone does not clamp g (fla ignores it there too), so it must not reach them.
        lb = (lb if lb is not None else -5.0) if safe_gate else None
    N = B if cu_seqlens is None or not check_cu_seqlens else cu_seqlens.numel() - 1
    return KDAArgs(scale, bool(output_final_state), bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel),
                   bool(use_beta_sigmoid_in_kernel), lb, cu_seqlens, N,
                   cu_seqlens_cpu if check_cu_seqlens and cu_seqlens is not None else None)


class KDAAssertionError(ValueError, AssertionError):
    """A bad argument that fla rejects with ``assert``: a ``ValueError`` (k3's type for bad input) that is also an
    ``AssertionError`` (fla's), so callers written against either keep working."""


class FlaOptions(NamedTuple):
    """fla's arguments that k3 serves at the API boundary (the kernels never see them).

    ``beta_scale``: 2 with ``allow_neg_eigval`` (β = 2·σ(logit) ∈ (0, 2)), else 1. ``state_v_first``: states are
    ``[N, H, V, K]`` at the boundary. ``intermediate``: also return the per-chunk entry states. ``chunk_size``: the
    chunk length of those states (the kernels' own chunking is independent of it: same results for 32 and 64)."""

    beta_scale: float
    state_v_first: bool
    intermediate: bool
    chunk_size: int


def fla_options(
    *,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    transpose_state_layout: bool | None,
    chunk_size: int = 64,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    cp_context: object = None,
) -> FlaOptions:
    """Check fla's extra arguments as fla does (same exception types, messages naming the argument) and fold them
    into :class:`FlaOptions`. ``transpose_state_layout`` is fla's deprecated name of ``state_v_first``."""
    if transpose_state_layout is not None:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        state_v_first = bool(transpose_state_layout)
    if isinstance(chunk_size, bool) or chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if return_intermediate_states:
        if not torch.is_inference_mode_enabled():
            raise KDAAssertionError("return_intermediate_states is only allowed in inference mode "
                                    "(inside torch.inference_mode(): the states bypass autograd)")
        if disable_recompute:
            raise KDAAssertionError("return_intermediate_states must be used with disable_recompute=False")
        if cp_context is not None:
            raise ValueError("return_intermediate_states is not supported with cp_context")
    if cu_seqlens_cpu is not None:
        _need(isinstance(cu_seqlens_cpu, torch.Tensor) and cu_seqlens_cpu.device.type == "cpu"
              and cu_seqlens_cpu.dim() == 1 and not cu_seqlens_cpu.is_floating_point(),
              "cu_seqlens_cpu must be a 1-D integer CPU tensor (a host copy of cu_seqlens)")
        n = None if cu_seqlens is None else cu_seqlens.numel()
        _need(n == cu_seqlens_cpu.numel(),
              lambda: f"cu_seqlens_cpu must be the host copy of cu_seqlens ({n} entries), got "
              f"{cu_seqlens_cpu.numel()} entries")
    if use_graph and cu_seqlens is not None:
        if max_num_seqs is None:
            max_num_seqs = cu_seqlens.shape[0] - 1
        if cu_seqlens.shape[0] - 1 != max_num_seqs:
            raise KDAAssertionError(
                f"use_graph requires cu_seqlens padded with zero-length tail sequences to exactly max_num_seqs + 1 "
                f"entries, got {cu_seqlens.shape[0] - 1} sequences with max_num_seqs={max_num_seqs}")
    if use_graph and disable_recompute:
        raise ValueError("disable_recompute=True is not supported with use_graph=True")
    return FlaOptions(2.0 if allow_neg_eigval else 1.0, bool(state_v_first), bool(return_intermediate_states),
                      int(chunk_size))


def neg_eigval_beta(beta: torch.Tensor) -> torch.Tensor:
    """β = 2·σ(logit) in fp32 (fp64 for fp64 logits): fla's ``allow_neg_eigval``. Computed here, differentiable,
    and handed to the kernels as a post-sigmoid β (they read fp32 β as it is)."""
    acc = torch.float64 if beta.dtype == torch.float64 else torch.float32
    return 2.0 * torch.sigmoid(beta.to(acc))


def check_state_v_first(initial_state: object, q: torch.Tensor, v: torch.Tensor) -> None:
    """With ``state_v_first`` the initial state is ``[N, H, V, K]``: named here before it is transposed."""
    if isinstance(initial_state, torch.Tensor) and isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor):
        K, V = q.shape[-1], v.shape[-1]
        _need(initial_state.dim() == 4 and tuple(initial_state.shape[-2:]) == (V, K),
              lambda: f"initial_state must be [N, H, V, K] = [N, {v.shape[2]}, {V}, {K}] with state_v_first=True, "
              f"got {tuple(initial_state.shape)}")


def expand_gva(q: object, k: object, v: object) -> tuple[object, object]:
    """fla's grouped value attention (GVA): v, g, β, A_log, dt_bias and the states have HV = G·H heads, q and k
    have H; value head j reads query/key head j // G. The entry points expand q and k here (``repeat_interleave``,
    whose backward sums each group's gradients), so every backend and path sees HV heads. K3 itself has HV = H, for
    which this is one shape comparison. Anything malformed is left to the checks, which name it."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and q.dim() == 4 and v.dim() == 4 and k.shape == q.shape and v.shape[:2] == q.shape[:2]):
        return q, k
    H, HV = q.shape[2], v.shape[2]
    if HV == H:
        return q, k
    if H == 0 or HV % H:
        raise ValueError(f"v has {HV} heads but q/k have H={H}: v's heads must equal H or be a multiple of it "
                         "(grouped value attention)")
    return q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last dim (fla's in-kernel L2 norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def preprocess(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor | None,
               dt_bias: torch.Tensor | None, args: KDAArgs
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-kernel activations in fp32 (fp64 for fp64 inputs): L2-norm q/k, gate, β sigmoid."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, g, beta = (x.to(acc) for x in (q, k, g, beta))
    if args.use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if args.use_gate_in_kernel:
        g = kda_gate_fused(g, A_log, dt_bias, args.lower_bound).to(acc)
    if args.use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    return q, k, g, beta


# ------------------------------------------------------------------------------------------------ backends

# Each backend is a module with the same functions (``chunk_kda``, ``fused_recurrent_kda``, ``span_summaries``:
# tensors, then a KDAArgs). The Triton one, an optional dependency, is imported on first use.
_BACKENDS = {"torch": "k3.ops.kda.reference", "triton": "k3.ops.kda.triton"}
_LOADED: dict[str, ModuleType] = {}
_ENV = "K3_KDA_BACKEND"


def get_backend(name: str) -> ModuleType:
    """The backend module ``name`` ('torch' or 'triton'); RuntimeError if the Triton one cannot be imported."""
    mod = _LOADED.get(name)
    if mod is None:
        try:
            mod = _LOADED[name] = importlib.import_module(_BACKENDS[name])
        except ImportError as e:
            raise RuntimeError(f"{_ENV}={name}: the {name} KDA backend cannot be imported: {e}") from e
    return mod


def select_backend(device: torch.device) -> str:
    """'triton' for CUDA tensors, 'torch' otherwise; ``K3_KDA_BACKEND=triton|torch`` (read at call time) forces
    one."""
    forced = forced_backend(_ENV)
    if forced is not None:
        if forced == "triton":
            get_backend("triton")
        return forced
    if device.type != "cuda":
        return "torch"
    try:
        get_backend("triton")
    except RuntimeError:
        return "torch"
    return "triton"
