"""Compile Triton (and Gluon) kernels to sm_90 code without a GPU — what the interpreter cannot check (the compiler's
type rules, register use, the instructions chosen) — for the CPU-only tests."""

from __future__ import annotations

import os
import subprocess
import sys


def compile_sm90(fn, types: dict, const: dict, warps: int, gluon: bool = False, maxnreg: int | None = None):
    """``fn`` (a ``@triton.jit`` / ``@gluon.jit`` function's ``.fn``) compiled for sm_90: ``types`` the argument types
    ("*bf16", "i32", "fp32", …; arguments missing are constexprs), ``const`` the constexpr values. Pointers (and an
    ``H``) are taken as 16-byte aligned, as the launcher's specialisation sees them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    # a tuple argument (e.g. ``("*bf16", "*bf16")``) is a tuple of pointers, taken without the alignment hint
    ptrs = [n for n in fn.arg_names if isinstance(types.get(n), str) and types[n].startswith("*")]
    ptrs += ["H"] if "H" in types else []
    src = source(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
                 attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs})
    opts = dict(num_warps=warps, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def run_script(script: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter without ``TRITON_INTERPRET`` (the test process has the interpreter on,
    which replaces the compiler), the repository importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
