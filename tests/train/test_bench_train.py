"""The training benchmark's kernel classes (the per-class split of its CUDA profile)."""

import pytest

from k3.bench.train import busy_us, classify_kernel, is_kernel


@pytest.mark.parametrize("name,cls", [
    ("attn_fwd_kernel", "attention"),
    ("attn_bwd_dkdv_kernel", "attention"),
    ("attn_bwd_delta_kernel", "attention"),
    ("attn_res_bwd_kernel", "attnres"),
    ("_kda_bwd_wy", "kda"),
    ("_kda_span_state", "kda"),
    ("void at::native::detail::chunk_cat_cuda_kernel<float, c10::BFloat16>(c10::BFloat16**, float*", "other"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("_situ_bwd_kernel", "moe"),
    ("ce_chunk_kernel", "loss"),
    ("short_conv_bwd_kernel", "kda"),
    ("_prep_solve", "kda"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<1>, at::native::LpNormFunctor<float, (at::native::NormType)1, float, 1, 1, 0>", "optimizer"),
    ("triton_poi_fused_add_rows_sum_0", "moe"),
    ("triton_poi_fused__to_copy__unsafe_view_mul_rms_norm_bwd_sigmoid_sigmoid_backward_view_0", "norms"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<adam>", "optimizer"),
    ("_rms_norm_fwd", "norms"),
])
def test_kernel_classes(name, cls) -> None:
    assert classify_kernel(name) == cls


@pytest.mark.parametrize("name,kernel", [
    ("Optimizer.step#AdamW.step", False),
    ("Optimizer.step#Muon.step", False),
    ("ProfilerStep#3", False),
    ("_kda_bwd_wy", True),
    ("Memcpy DtoD (Device -> Device)", True),
])
def test_ranges_are_not_kernels(name, kernel) -> None:
    assert is_kernel(name) is kernel


@pytest.mark.parametrize("spans,busy", [
    ([], 0.0),
    ([(0, 10)], 10.0),
    ([(0, 10), (5, 12)], 12.0),           # overlapping streams count once
    ([(20, 30), (0, 10)], 20.0),          # gaps are idle, order does not matter
    ([(0, 10), (2, 4), (10, 11)], 11.0),  # nested and touching
])
def test_device_busy_is_the_union_of_kernel_intervals(spans, busy) -> None:
    assert busy_us(spans) == busy
