"""Inference: the model runner (slot pool, chunked prefill, CUDA-graph decode, device sampling), text generation
with streaming, evaluation of runs."""

from k3.infer.generate import generate, generate_ids
from k3.infer.runner import ModelRunner
from k3.infer.sampling import SamplingParams

__all__ = ["generate", "generate_ids", "ModelRunner", "SamplingParams"]
