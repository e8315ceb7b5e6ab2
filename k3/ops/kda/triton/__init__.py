"""The Triton backend of KDA (CUDA; CPU through ``TRITON_INTERPRET=1``), same functions as ``k3.ops.kda.reference``.

``chunk_kda``            chunked forward + backward (autograd): training (``training.py``) or the windowed,
                         constant-memory inference prefill (``inference.py``).
``chunk_kda_states``     the forward with the state entering every chunk (fla's ``return_intermediate_states``).
``fused_recurrent_kda``  decode, forward only, optionally over a state pool updated in place (``decode.py``).
``span_summaries``       per-sequence affine summaries (M, S_ext) (``span.py``).
``split_prefill``        the one-card split prefill (``split.py``).
``cp_chunk_kda_train``   context parallel's training step (``cp.py``).
``train_forward`` / ``train_backward`` / ``saved_like``: the training halves for the registered op
(``k3.ops.kda.library``).
Every function takes the tensors, then a ``KDAArgs``. The file map by pipeline stage: ``docs/kda-kernels.md``.
"""

from k3.ops.kda.triton._common import sm_count
from k3.ops.kda.triton.chunk import chunk_kda_triton as chunk_kda
from k3.ops.kda.triton.chunk import chunk_kda_states, saved_like, train_backward, train_forward
from k3.ops.kda.triton.cp import cp_chunk_kda_train
from k3.ops.kda.triton.decode import fused_recurrent_kda_triton as fused_recurrent_kda
from k3.ops.kda.triton.inference import unsplit_windows
from k3.ops.kda.triton.span import span_summaries_triton as span_summaries
from k3.ops.kda.triton.split import split_prefill_triton as split_prefill

__all__ = ["chunk_kda", "chunk_kda_states", "fused_recurrent_kda", "span_summaries", "split_prefill", "cp_chunk_kda_train", "sm_count",
           "unsplit_windows", "train_forward", "train_backward", "saved_like"]
