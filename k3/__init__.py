"""k3: Kimi K3 in PyTorch + Triton."""

from k3.config import K3Config

__version__ = "0.1.0"
__all__ = ["K3Config", "K3ForCausalLM", "__version__"]


def __getattr__(name: str):  # lazy: keep `import k3` light and free of model import cycles
    if name == "K3ForCausalLM":
        from k3.model import K3ForCausalLM

        return K3ForCausalLM
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
