"""Inference: prefill + one-token decode with the fixed-size state, sampling, streaming; evaluation of runs."""

from k3.infer.generate import decode_one_token, generate, generate_ids, prefill, sample_next

__all__ = ["decode_one_token", "generate", "generate_ids", "prefill", "sample_next"]
