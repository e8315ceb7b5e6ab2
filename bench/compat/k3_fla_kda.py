"""pytest plugin: run fla's own KDA tests (``tests/ops/test_kda.py``) against k3's kernels.

Loaded with ``-p k3_fla_kda`` (``bench/compat`` on ``PYTHONPATH``) before fla's test module is imported, it rebinds
the names that module imports from fla:

- ``chunk_kda``, ``fused_recurrent_kda`` (``fla.ops.kda``) and ``fused_kda_gate`` (``fla.ops.kda.gate``) → k3's;
- ``fused_recurrent_kda_fwd`` (``fla.ops.kda.fused_recurrent``, fla's internal entry that vLLM calls with a state
  pool) → :func:`fused_recurrent_kda_fwd` below, a thin adapter onto k3's ``fused_recurrent_kda`` with
  ``ssm_state_indices``;
- ``naive_recurrent_kda`` / ``naive_chunk_kda`` → k3's in ``test_naive_chunk`` (the test OF the references); every
  other test keeps fla's own references (``naive_*``, ``naive_kda_gate``, ``naive_kda_lowerbound_gate``), so k3 is
  measured against fla's reference, not its own.

Off CUDA (a CPU check of the plumbing) fla's ``device`` is set to ``cpu``; k3 then runs its PyTorch backend (or the
Triton interpreter with ``K3_KDA_BACKEND=triton``). The tests expected to be excluded, and why: ``README.md`` here.
"""

from __future__ import annotations

import pytest
import torch

import fla.ops.kda
import fla.ops.kda.fused_recurrent
import fla.ops.kda.gate
import fla.utils
import k3.ops.kda as k3kda

if not torch.cuda.is_available():  # fla's CPU fallback still names "cuda" (its conftest synchronizes it)
    fla.utils.device, fla.utils.device_torch_lib = "cpu", torch.cpu


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                            output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                            ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                            lower_bound=None, out=None, **kwargs):
    """fla's ``fused_recurrent_kda_fwd`` on k3: with ``inplace_final_state`` the initial state (a pool when
    ``ssm_state_indices`` is given) is updated in place. Speculative decoding (``num_accepted_tokens``, 2-D
    indices) and a caller-provided ``out`` are fla features k3 does not serve: the test is skipped then."""
    if num_accepted_tokens is not None or out is not None or (
            ssm_state_indices is not None and ssm_state_indices.dim() != 1):
        pytest.skip("k3 has no speculative-decoding state indexing (num_accepted_tokens / 2-D indices) or out=")
    kw = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
              allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
              cu_seqlens=cu_seqlens)
    if inplace_final_state and ssm_state_indices is not None:
        return k3kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=initial_state,
                                         ssm_state_indices=ssm_state_indices, **kw)
    o, ht = k3kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state or inplace_final_state, **kw)
    if inplace_final_state:
        initial_state.copy_(ht)
        return o, initial_state
    return o, ht


fla.ops.kda.chunk_kda = k3kda.chunk_kda
fla.ops.kda.fused_recurrent_kda = k3kda.fused_recurrent_kda
fla.ops.kda.gate.fused_kda_gate = k3kda.fused_kda_gate
fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd = fused_recurrent_kda_fwd


@pytest.fixture(autouse=True)
def _k3_references_under_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``test_naive_chunk`` checks the references themselves: there they are k3's."""
    if getattr(request.node, "originalname", "") == "test_naive_chunk" and request.module is not None:
        monkeypatch.setattr(request.module, "naive_recurrent_kda", k3kda.naive_recurrent_kda)
        monkeypatch.setattr(request.module, "naive_chunk_kda", k3kda.naive_chunk_kda)
