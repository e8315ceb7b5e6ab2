"""Shared pieces of the KDA Triton kernels: chunk tables, dtype/precision choices, small @triton.jit helpers.

Conventions (all kernels): chunk size BT = 64 split into BC = 16-row sub-blocks; gate cumsums are fp32 in log2 units
(``exp2(G)`` = e^{G_nat}); intermediates live in chunk-major, head-major buffers ``[H, NC, BT, ...]`` padded to
power-of-two head dims (BK, BV) so the sequential state pass needs no masks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import triton
import triton.language as tl

_SM_COUNT: dict[int, int] = {}
_NOTED: set[str] = set()


def note_once(msg: str) -> None:
    """``k3: note: msg`` on stderr, once per process and message (a fast path that is unavailable here, and why)."""
    if msg not in _NOTED:
        _NOTED.add(msg)
        print(f"k3: note: {msg}", file=sys.stderr, flush=True)


# Gluon's API is experimental and changes between Triton releases: the kernel is used only with the release it is
# tested on (3.6.x); any other Triton, or a failed import, leaves their work to the Triton kernels
TESTED_TRITON = (3, 6)
try:
    from triton.experimental import gluon  # noqa: F401

    HAVE_GLUON = tuple(int(p) for p in triton.__version__.split(".")[:2]) == TESTED_TRITON
except Exception:  # noqa: BLE001 — no Gluon, or an unparsable version string
    HAVE_GLUON = False


def gluon_enabled() -> bool:
    """``K3_KDA_GLUON`` (read at call time): unset or 1 uses the Gluon kernels where they apply, 0 turns them off."""
    flag = os.environ.get("K3_KDA_GLUON", "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"K3_KDA_GLUON must be 0 or 1, got {flag!r}")
    return flag == "1"


def gluon_unavailable(what: str) -> bool:
    """True (after a note on stderr, once) when the Gluon kernels cannot run here: another Triton release than the
    tested one, or no Gluon in it."""
    if HAVE_GLUON:
        return False
    tested = ".".join(map(str, TESTED_TRITON)) + ".x"
    found = getattr(triton, "__version__", "?")
    if found.startswith(tested[:-1]):
        note_once(f"Gluon {what} is unavailable in triton {found}: using the Triton fallback")
    else:
        note_once(f"Gluon {what} needs triton {tested}, found {found}: using the Triton fallback")
    return True


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs microseconds per decode step); 2 for
    the interpreter, so that its programs still loop over several tiles."""
    if device.type != "cuda":
        return 2
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def _spec_key(a: object) -> object:
    """What Triton's launch specialises an argument on: a tensor's dtype and 16-byte alignment; an int's type
    (i32 / i64 / u64), whether it is 1 (a constant) and whether it divides by 16; a float or bool by type only.
    Anything else raises TypeError (the caller then takes Triton's own path)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "u1"
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -(2**31) <= a < 2**31, -(2**63) <= a < 2**63
    if isinstance(a, float):
        return "fp32"
    if a is None:
        return None
    raise TypeError(type(a).__name__)


def _hook_free(hook: object) -> bool:
    """No launch hook set: None, or Triton 3.6's empty ``HookChain`` (which its launcher would call per launch)."""
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


class LaunchCache:
    """``fn[(grid,)](*args, **consts, **options)`` with Triton's per-call binding skipped on repeats.

    ``JITFunction.run`` binds and specialises every argument, hashes the options and looks the kernel up on each
    call: ~25 µs of host time per launch on the H200 machines' CPUs, where an eager decode step has ~60 µs of host
    time to spare beside its 71 µs kernel. Here the first launch of each specialisation goes through Triton
    and its compiled kernel is kept under a key of what Triton specialises on (``_spec_key`` of each runtime
    argument, the constexprs, the options, the current device); later launches with the same key call the
    compiled kernel's launcher directly. Runtime arguments are positional and come before every constexpr in the
    kernel's signature. A launch hook (profilers such as proton), an argument of another kind or a Triton without
    these internals sends the call through ``fn[grid]`` as before. (With no hook set, Triton 3.6 still calls its
    empty hook chain and builds launch metadata on every launch; the direct call passes None for both.)"""

    def __init__(self, fn: triton.runtime.JITFunction) -> None:
        self.fn = fn
        self.kernels: dict[tuple, tuple] = {}

    def __call__(self, grid: int, args: tuple, consts: dict, options: dict) -> None:
        try:
            key = (torch.cuda.current_device(), tuple(consts.items()), tuple(options.items()),
                   tuple(map(_spec_key, args)))
            hit = self.kernels.get(key)
            hooks = triton.knobs.runtime
            direct = _hook_free(hooks.launch_enter_hook) and _hook_free(hooks.launch_exit_hook)
        except (TypeError, AttributeError):  # an argument Triton specialises otherwise; a Triton without knobs
            hit, direct = None, False
            key = None
        if hit is not None and direct:
            run, function, metadata, tail, stream = hit
            run(grid, 1, 1, stream(key[0]), function, metadata, None, None, None, *args, *tail)
            return
        kernel = self.fn[(grid,)](*args, **consts, **options)
        if key is not None and direct:
            self._keep(key, kernel, len(args), consts)

    def _keep(self, key: tuple, kernel: object, n_args: int, consts: dict) -> None:
        """Remember a compiled kernel's launcher, and the constexpr values its launcher takes after the runtime
        arguments (in signature order: given, else the default)."""
        try:
            from triton.runtime import driver

            params = self.fn.params[n_args:]
            tail = tuple(consts[p.name] if p.name in consts else p.default for p in params)
            self.kernels[key] = (kernel.run, kernel.function, kernel.packed_metadata, tail,
                                 driver.active.get_current_stream)
        except AttributeError:  # another Triton's internals: keep launching through fn[grid]
            pass


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and converts them with ``int(array)``, which
    numpy ≥ 2.x rejects; loops with run-time bounds (``for c in range(lo, hi)``) then fail under
    ``TRITON_INTERPRET=1``. Patch that one conversion (interpreter only)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    from triton.runtime import interpreter as it

    if getattr(it, "_k3_scalar_index_fix", False):
        return
    original = it._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    it._patch_lang_tensor = patched
    it._k3_scalar_index_fix = True


_fix_interpreter_scalar_index()

BT = 64  # chunk length
BC = 16  # sub-block length: the bounded gate (|g| ≤ 5) keeps e^{±5·15} inside fp32/bf16 range
RCP_LN2 = 1.4426950408889634


def next_pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


# Head dims above 128 (fla allows K, V ≤ 256; K3's 128 is the tuned case, whose launches these rules leave as they
# are). A state pass's shared memory is its pipeline stages, each holding the chunk's [BT, BK] tiles (W, KG, QG: 3 ×
# 64·BK·2 B in bf16/fp16, twice that in fp32), plus the [BK, BV] state tile staged as a dot operand and for layout
# conversions (fp32: BK·BV·4 B). Measured anchor: the forward state pass at K = 128, bf16, 3 stages fits; fp32 at 3
# stages needs 256 KiB > the 227 KiB a block may take on an H100/H200 (228 KiB per SM), hence 2 there. At BK = 256 a
# stage doubles (bf16: 96 KiB of tiles), so the stages that fit at 128 are scaled by 128/BK (bf16: 3 → 1, c16 state
# pass 8 → 4, span rows 4 → 2) and the state tile's V-block halves (BV 64 → 32: 32 KiB fp32 instead of 64), e.g.
# the forward state pass at K = 256 bf16: 96 KiB tiles + 16 KiB bf16 operand + ≤ 32 KiB conversions ≈ 150 KiB.
# fp32 inputs at K = 256 (192 KiB of tiles in one stage) are the tightest case.


def state_stages(stages: int, dtype: torch.dtype, BK: int = 128) -> int:
    """Pipeline depth of a kernel whose stages hold chunk-buffer tiles (state passes, span passes, the WY backward):
    fp32 buffers (the fp32 path) take twice the shared memory per stage, so at K = V = 128 more than 2 stages
    exceed the 227 KiB of an H200 SM (the forward state pass at 3 stages: 256 KiB, a launch failure); above
    BK = 128 the stages scale down with the tiles (see above)."""
    s = min(stages, 2) if dtype == torch.float32 else stages
    return s if BK <= 128 else max(1, s * 128 // BK)


def state_bv(bv: int, BK: int) -> int:
    """The V-block of a state tile [BK, BV] kept in registers (and staged through shared memory): halved to 32 above
    BK = 128 (see above)."""
    return bv if BK <= 128 else min(bv, 32)


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of chunk intermediates and of tensor-core operands: the input's half type, or fp32 for fp32 inputs."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32-operand dots: exact ('ieee') for fp32 inputs (tests demand 1e-4), tf32 for half inputs."""
    return "ieee" if store_dtype(dtype) == torch.float32 else "tf32"


@dataclass
class ChunkTable:
    """How the packed token axis splits into sequences and 64-token chunks.

    Dense batches (no cu_seqlens) are a packed batch of B equal sequences of length ``T``; kernels then derive
    indices arithmetically (``varlen=False``) and the tensors below are dummies.
    """

    N: int  # sequences
    NC: int  # chunks over all sequences
    T: int  # per-sequence length (dense) — unused when varlen
    NT: int  # chunks per sequence (dense)
    varlen: bool
    cu: torch.Tensor  # int32 [N+1] token offsets
    chunk_seq: torch.Tensor  # int32 [NC] sequence of each chunk
    chunk_off: torch.Tensor  # int32 [N+1] first chunk of each sequence
    cu_cpu: list[int]
    chunk_off_cpu: list[int]


def make_chunk_table(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> ChunkTable:
    if cu_seqlens is None:
        NT = triton.cdiv(T, BT)
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        cu_cpu = [b * T for b in range(B + 1)]
        return ChunkTable(B, B * NT, T, NT, False, dummy, dummy, dummy, cu_cpu, [b * NT for b in range(B + 1)])
    cu_cpu = [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    N = len(cu_cpu) - 1
    nts = [triton.cdiv(cu_cpu[i + 1] - cu_cpu[i], BT) for i in range(N)]
    off = [0]
    for n in nts:
        off.append(off[-1] + n)
    seq = [i for i, n in enumerate(nts) for _ in range(n)] or [0]
    to = dict(dtype=torch.int32, device=device)
    return ChunkTable(N, off[-1], 0, 0, True, torch.tensor(cu_cpu, **to), torch.tensor(seq, **to),
                      torch.tensor(off, **to), cu_cpu, off)


# ----------------------------------------------------------------------------------------------------------------
# @triton.jit helpers
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _seq_bounds(i_n, cu, T, IS_VARLEN: tl.constexpr):
    """Token range [bos, eos) of sequence i_n."""
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def _chunk_range(i_n, chunk_off, NT, IS_VARLEN: tl.constexpr):
    """Global chunk range [cs, ce) of sequence i_n."""
    if IS_VARLEN:
        cs = tl.load(chunk_off + i_n)
        ce = tl.load(chunk_off + i_n + 1)
    else:
        cs = i_n * NT
        ce = cs + NT
    return cs, ce


@triton.jit
def _eye(N: tl.constexpr):
    """The [N, N] fp32 identity."""
    o_i = tl.arange(0, N)
    return tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)


@triton.jit
def _state_program(cu, chunk_off, c0, c1, T, NT, H, IS_VARLEN: tl.constexpr):
    """A state pass program on grid (V-blocks, N·H) over the window of chunks [c0, c1): its V-block, sequence and
    head, the sequence's first chunk and token range, and its chunk range inside the window [lo, hi)."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    cs, ce = _chunk_range(i_n, chunk_off, NT, IS_VARLEN)
    bos, eos = _seq_bounds(i_n, cu, T, IS_VARLEN)
    return i_v, i_n, i_h, cs, bos, eos, tl.maximum(cs, c0), tl.minimum(ce, c1)


@triton.jit
def _span_row_program(row_cs, row_ce, row_m, H, BV: tl.constexpr, BVP: tl.constexpr):
    """A span-pass program on grid (column blocks of [S_ext | M], rows·H): its column block, row, head, the row's
    chunk range [cs, ce), and whether it has work (a non-empty range; M's blocks, from BVP on, only where
    ``row_m[row]`` is set)."""
    i_b = tl.program_id(0)
    i_rh = tl.program_id(1)
    i_r = i_rh // H
    i_h = i_rh % H
    cs = tl.load(row_cs + i_r)
    ce = tl.load(row_ce + i_r)
    live = (cs < ce) & ((tl.load(row_m + i_r) != 0) | (i_b * BV < BVP))
    return i_b, i_r, i_h, cs, ce, live


@triton.jit
def _chunk_pos(c, cu, chunk_seq, chunk_off, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Global chunk c → (first token, end of its sequence)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_seq + c)
        j = c - tl.load(chunk_off + i_n)
        bos = tl.load(cu + i_n).to(tl.int64) + j.to(tl.int64) * BT
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        i_n = c // NT
        j = c % NT
        bos = i_n.to(tl.int64) * T + j.to(tl.int64) * BT
        eos = (i_n.to(tl.int64) + 1) * T
    return bos, eos


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _sigmoid_fast(x):
    """σ(x) as ((1 + 2^{−x·log2 e})^{−1/2})²: one MUFU op for the reciprocal square root, where 1/(1 + e^{−x})
    lowers to div.full (range test, scaling, rcp, multiply), and tl.exp2 (ex2.approx.ftz) instead of tl.exp
    (ex2.approx with a range test and two predicated multiplies for subnormal results). Within a few ulp of σ, not
    bitwise it."""
    r = tl.math.rsqrt(1.0 + tl.exp2(x * -1.4426950408889634))  # exp2: ex2.approx.ftz, no subnormal fix-ups
    return r * r


@triton.jit
def _softplus(x):
    # torch's threshold=20: linear above it (also avoids exp overflow)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _gate_fwd(b_f, i_h, A_log, dt_bias, lb, o_k, m_k, K,
              USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
              ROWS: tl.constexpr = True):
    """Natural-log decay g from raw f (fp32) — ``[R, BK]`` rows, or one ``[BK]`` vector with ``ROWS=False`` (decode:
    a [1, BK] row there costs three layout conversions through shared memory per token): bounded
    lb·σ(e^{A}(f+dt)) or unbounded −e^{A}·softplus(f+dt)."""
    if USE_GATE:
        x = b_f
        if HAS_DT:
            dt = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
            if ROWS:
                x = x + dt[None, :]
            else:
                x = x + dt
        if HAS_LB:
            if HAS_A:
                x = x * tl.exp(tl.load(A_log + i_h).to(tl.float32))
            g = lb * _sigmoid(x)
        else:
            a = 1.0
            if HAS_A:
                a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
            g = -a * _softplus(x)
    else:
        g = b_f
    return g


@triton.jit
def _l2norm(x, ENABLE: tl.constexpr):
    """Row-wise x / sqrt(Σx² + 1e-6) of a [R, BK] fp32 block; returns (y, rstd)."""
    if ENABLE:
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)
        y = x * r[:, None]
    else:
        r = tl.full([x.shape[0]], 1.0, tl.float32)
        y = x
    return y, r


@triton.jit
def _chunk_tile(x, i_h, bos, eos, H, K, BT: tl.constexpr, BK: tl.constexpr):
    """Raw [BT, BK] chunk of x [T, H, K] (zeros outside)."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m = ((bos + o_t) < eos)[:, None] & (o_k < K)[None, :]
    return tl.load(x + (bos + o_t)[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m, other=0.)


@triton.jit
def _rows_gate(g, A_log, dt_bias, i_h, t0, eos, H, K, lb, BC: tl.constexpr, BK: tl.constexpr,
               USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
               FAST: tl.constexpr = False):
    """Activated log2 decay of tokens [t0, t0 + BC), fp32 [BC, BK]; zero past ``eos`` and past K.
    ``FAST`` (bounded gate only): ``_sigmoid_fast`` with the gate scale folded into
    its constant, σ(a·x) = (1 + 2^{c·x})^{-1} with c = −a·log2 e computed once per head, the inverse as rsqrt(·)²;
    a few ulp off the plain σ, not bitwise it."""
    return _gate_of(_chunk_tile(g, i_h, t0, eos, H, K, BC, BK), A_log, dt_bias, i_h, t0, eos, K, lb, BC, BK,
                    USE_GATE, HAS_LB, HAS_A, HAS_DT, FAST)


@triton.jit
def _gate_of(raw, A_log, dt_bias, i_h, t0, eos, K, lb, BC: tl.constexpr, BK: tl.constexpr,
             USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
             FAST: tl.constexpr = False):
    """``_rows_gate`` of rows already loaded (``_chunk_tile``): apart so a kernel can issue all its loads first."""
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    t = t0 + o_s
    m_k = o_k < K
    m = (t < eos)[:, None] & m_k[None, :]
    b_f = raw.to(tl.float32)
    if FAST and USE_GATE and HAS_LB:
        if HAS_DT:
            b_f = b_f + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)[None, :]
        c = -1.4426950408889634
        if HAS_A:
            c = c * tl.exp(tl.load(A_log + i_h).to(tl.float32))
        r = tl.math.rsqrt(1.0 + tl.exp2(b_f * c))
        out = tl.where(m, r * r * (lb * 1.4426950408889634), 0.)
    else:
        b_g = _gate_fwd(b_f, i_h, A_log, dt_bias, lb, o_k, m_k, K, USE_GATE, HAS_LB, HAS_A, HAS_DT)
        out = tl.where(m, b_g, 0.) * 1.4426950408889634
    return out


@triton.jit
def _rows_beta(beta, i_h, t0, eos, H, BC: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """β of tokens [t0, t0 + BC) (sigmoid of the logits if asked), fp32 [BC], zero past ``eos``."""
    t = t0 + tl.arange(0, BC)
    m_t = t < eos
    b_b = tl.load(beta + t * H + i_h, mask=m_t, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        b_b = _sigmoid(b_b)
    return tl.where(m_t, b_b, 0.)


@triton.jit
def _op(x, AB_BF16: tl.constexpr):
    """Tensor-core operand: bf16 (fp32 accumulation) for bf16 inputs when asked; bf16 keeps fp32's exponent range,
    so a diagonal block's right factor (≤ e^{5·16}) stays finite."""
    if AB_BF16:
        return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def _chunk_beta(beta, i_h, bos, eos, H, BT: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    o_t = tl.arange(0, BT)
    m_t = (bos + o_t) < eos
    b_b = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        b_b = _sigmoid(b_b)
    return tl.where(m_t, b_b, 0.)


@triton.jit
def _merge_T(D0, D1, D2, D3, L10, L20, L21, L30, L31, L32, PREC: tl.constexpr):
    """Off-diagonal blocks of T = (I + L)^{-1}: T_IJ = −D_I Σ_{J≤M<I} L_IM T_MJ (T_JJ = D_J)."""
    T10 = -tl.dot(D1, tl.dot(L10, D0, input_precision=PREC), input_precision=PREC)
    T21 = -tl.dot(D2, tl.dot(L21, D1, input_precision=PREC), input_precision=PREC)
    T32 = -tl.dot(D3, tl.dot(L32, D2, input_precision=PREC), input_precision=PREC)
    T20 = -tl.dot(D2, tl.dot(L20, D0, input_precision=PREC) + tl.dot(L21, T10, input_precision=PREC),
                  input_precision=PREC)
    T31 = -tl.dot(D3, tl.dot(L31, D1, input_precision=PREC) + tl.dot(L32, T21, input_precision=PREC),
                  input_precision=PREC)
    T30 = -tl.dot(D3, tl.dot(L30, D0, input_precision=PREC) + tl.dot(L31, T10, input_precision=PREC)
                  + tl.dot(L32, T20, input_precision=PREC), input_precision=PREC)
    return T10, T20, T21, T30, T31, T32


# ----------------------------------------------------------------------------------------------------------------
# host helpers shared by the forward flows
# ----------------------------------------------------------------------------------------------------------------


def alloc_output_state(q, v, initial_state, tab: ChunkTable) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's output ``o [B, T, H, V]`` (q's dtype, to be written) and the running states ``ht [N, H, K, V]``
    fp32: a copy of ``initial_state`` (the passes update it in place into the final states), else zeros."""
    B, Tq, H, K = q.shape
    o = torch.empty(B, Tq, H, v.shape[-1], dtype=q.dtype, device=q.device)
    if initial_state is not None:
        return o, initial_state.detach().to(torch.float32).clone()
    return o, torch.zeros(tab.N, H, K, v.shape[-1], dtype=torch.float32, device=q.device)


def pipelined(items: list, bufs: list[dict], prep: Callable[[Any, dict], None], serial: Callable[[Any, dict], None],
              device: torch.device) -> None:
    """``prep(item, buf)`` of each item on a side stream, up to len(bufs) − 1 items ahead of ``serial(item, buf)``
    on a high-priority stream joined back into the caller's at the end, the buffers taking turns: the prep of item i
    waits until the serial work that last read its buffer (item i − len(bufs)) is done, the serial work of item i
    waits for its prep. The priority stream makes the block scheduler place the serial work's few programs before
    the prep's many take every free slot. Every side-stream launch is ordered before later work on the caller's
    stream, so the buffers may be freed (reused by the caching allocator) when this returns, and a CUDA-graph
    capture sees every forked stream joined back. (The windowed inference forward and the split prefill.)"""
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(main)  # the inputs, the buffers and the outputs were produced on the main stream
    run = torch.cuda.Stream(device, priority=-1)
    run.wait_stream(main)
    freed: list[torch.cuda.Event | None] = [None] * len(bufs)
    for i, item in enumerate(items):
        b = i % len(bufs)
        with torch.cuda.stream(side):
            if freed[b] is not None:
                side.wait_event(freed[b])
            prep(item, bufs[b])
            ready = torch.cuda.Event()
            ready.record(side)
        run.wait_event(ready)
        with torch.cuda.stream(run):
            serial(item, bufs[b])
        freed[b] = torch.cuda.Event()
        freed[b].record(run)
    main.wait_stream(run)  # later main-stream work (and reuse of the buffers' memory) follows both streams
