"""Decode-sized linear layers: one token's row (or two) times a weight, with the op before it fused in.

``linear``            ``x · Wᵀ (+ add)``
``situ_linear``       ``SiTU-GLU(gate, up) · Wᵀ (+ add)``: an MLP's down projection
``gate_linear``       ``(o ⊙ σ(g)) · Wᵀ``: a gated MLA layer's output projection
``norm_gate_linear``  ``(RMSNorm_head(o) ⊙ σ(g)) · Wᵀ``: a KDA layer's output stage and o_proj
Each runs one Triton kernel (``gemv_triton.py``) for CUDA rows up to ``MAX_ROWS`` without autograd, and the unfused
ops (cuBLAS and the existing fused elementwise kernels) otherwise — which are also the references.
"""

from k3.ops.gemv.gemv import MAX_ROWS, gate_linear, linear, norm_gate_linear, situ_linear, use_gemv

__all__ = ["MAX_ROWS", "gate_linear", "linear", "norm_gate_linear", "situ_linear", "use_gemv"]
