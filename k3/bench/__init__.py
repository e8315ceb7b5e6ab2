"""Benchmarks: ``python -m k3.bench <name> [args]`` runs ``k3.bench.<name>.main(args)``.

``kda``  KDA kernels vs fla (prefill, training fwd+bwd, decode) — ``k3.bench.kda``.
``moe``  Latent MoE layer vs plain PyTorch — ``k3.bench.moe``.
``conv``  the KDA short convolution vs the fp32 ``F.conv1d`` path — ``k3.bench.conv``.
``attnres``  AttnRes mix vs fla and eager, RMSNorm and the fused loss vs liger and eager — ``k3.bench.attnres``.
``gemv``  decode-sized linear kernels vs cuBLAS and the unfused ops; ``small``'s decode step with each —
          ``k3.bench.gemv``.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

import torch


class BenchParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr and exit 2 (argparse's own prints the usage block)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of ``a`` against ``b``, in fp64 (detached)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_line(res: dict) -> str:
    """A results page's line naming how it was made: the command and the library versions (``res["command"]``,
    ``res["versions"]``)."""
    return f"`{res['command']}` · " + ", ".join(f"{k} {v}" for k, v in res["versions"].items())
