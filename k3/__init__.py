"""k3: Kimi K3 in PyTorch + Triton."""

from k3.ckpt.released import load_pretrained, save_pretrained
from k3.config import K3Config
from k3.model import K3ForCausalLM

__version__ = "0.1.0"
__all__ = ["K3Config", "K3ForCausalLM", "load_pretrained", "save_pretrained", "__version__"]
