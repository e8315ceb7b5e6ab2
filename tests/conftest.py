"""Test-wide setup: with no GPU, Triton kernels run in the interpreter on CPU tensors (fp32/fp16 only).

This must happen before any module decorates a kernel with @triton.jit, hence here at collection start.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))
