"""Benchmarks: ``python -m k3.bench <name> [args]`` runs ``k3.bench.<name>.main(args)``.

``kda``  KDA kernels vs fla (prefill, training fwd+bwd, decode) — ``k3.bench.kda``.
``moe``  Latent MoE layer vs plain PyTorch — ``k3.bench.moe``.
"""
