// The torch-facing entry points; binding.cpp registers them as dash_fa3_C ops.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/params.h"

namespace dash_fa3 {

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       double softmax_scale, bool causal, int64_t num_sms);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_preprocess(
    const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse, int64_t block_m);

at::Tensor bwd_postprocess(const at::Tensor& dq_accum, int64_t seqlen_q, double softmax_scale,
                           at::ScalarType dtype);

std::tuple<at::Tensor, at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dpsum, const at::Tensor& lse_log2,
                                       at::Tensor& dq_accum, at::Tensor& dq_semaphore, const at::Tensor& schedule,
                                       const at::Tensor& schedule_header, double softmax_scale, bool causal,
                                       bool deterministic);

std::vector<std::string> built_fwd_variants();
std::vector<std::string> built_bwd_variants();

// Shared input checks (csrc/api/checks.cpp).
DType dtype_of(const at::Tensor& t, const char* name);
TensorStrides bshd_strides(const at::Tensor& t, const char* name);

// q (batch, seqlen_q, heads, d), k and v (batch, seqlen_k, heads_kv, d): one
// dtype and device, kernel-addressable strides, heads % heads_kv == 0.
struct QkvShape {
  DType dtype;
  TensorStrides q_stride, k_stride, v_stride;
  int64_t batch, seqlen_q, seqlen_k, heads, heads_kv, hdim;
};
QkvShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace dash_fa3
