// The torch-facing entry points; binding.cpp registers them as dash_fa3_C ops.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/params.h"

namespace dash_fa3 {

// Forward: (out, lse). sm_margin SMs of q's device are left free.
std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       double softmax_scale, bool causal, int64_t sm_margin);
// The same with a window (left, right; -1 unbounded; FA3's window_size with
// causal folded in): the full or causal kernel for (-1, -1) / (-1, 0), else the
// local one; and a softcap (> 0: the softcap kernels, common/softcap.h; 0: none).
std::tuple<at::Tensor, at::Tensor> fwd_window(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              double softmax_scale, int64_t window_left, int64_t window_right,
                                              double softcap, int64_t sm_margin);

// The forward over packed documents (FA3's varlen layout, common/seqlen_info.h):
// q (total_q, heads, d), k and v (total_k, heads_kv, d), cu_seqlens int32
// (batch + 1) on the device, max_seqlen the longest document (not checked
// against the device values, which would synchronize). (out (total_q, heads,
// d), lse (heads, total_q)).
std::tuple<at::Tensor, at::Tensor> fwd_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                              int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                              int64_t window_left, int64_t window_right, double softcap,
                                              int64_t sm_margin);

// The whole backward (preprocess, main kernel, postprocess): (dq, dk, dv).
// The window picks the mask kind and softcap the kernels as in fwd_window; the
// schedule must have been built for that kind and window.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                   const at::Tensor& schedule, const at::Tensor& schedule_header,
                                                   double softmax_scale, int64_t window_left, int64_t window_right,
                                                   double softcap, bool deterministic);

// The deterministic backward with dK and dV in fp32, not rounded (dQ in q's
// dtype): one call's partials that context parallelism adds to other calls'
// before rounding once (dash_fa3/distributed/superblocks.py). No softcap.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_dkv_fp32(const at::Tensor& dout, const at::Tensor& q,
                                                            const at::Tensor& k, const at::Tensor& v,
                                                            const at::Tensor& out, const at::Tensor& lse,
                                                            const at::Tensor& schedule,
                                                            const at::Tensor& schedule_header, double softmax_scale,
                                                            int64_t window_left, int64_t window_right);

// The backward over packed documents: dout, q, out (total_q, heads, d), k, v
// (total_k, heads_kv, d), lse (heads, total_q); the schedule built for the
// documents (dash_fa3.schedule.varlen). (dq, dk, dv) shaped like q, k, v.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_varlen(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const at::Tensor& schedule, const at::Tensor& schedule_header, double softmax_scale,
    int64_t window_left, int64_t window_right, double softcap, bool deterministic);

// The preprocess and postprocess steps alone (tests, benchmarks). The
// postprocess reads dq_accum as the main kernel leaves it: each
// bwd_block_m(headdim)-row Q tile in fragment order (common/dq_accum_layout.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_preprocess(
    const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse, int64_t block_m);
at::Tensor bwd_postprocess(const at::Tensor& dq_accum, int64_t seqlen_q, double softmax_scale,
                           at::ScalarType dtype);

// The variants compiled in one kernel family: dense or packed documents
// (DASH_FA3_LAYOUTS), plain or softcapped scores (DASH_FA3_SOFTCAP).
std::vector<std::string> built_fwd_variants(bool packed, bool softcap);
std::vector<std::string> built_bwd_variants(bool packed, bool softcap);

// Shared input checks (csrc/api/checks.cpp).
DType dtype_of(const at::Tensor& t, const char* name);
// softcap: finite and >= 0 (0: none).
void check_softcap(double softcap);
TensorStrides bshd_strides(const at::Tensor& t, const char* name);

// q (batch, seqlen_q, heads, d), k (batch, seqlen_k, heads_kv, d) and v
// (batch, seqlen_k, heads_kv, d_v): one dtype and device, kernel-addressable
// strides, heads % heads_kv == 0. (Which (d, d_v) pairs have kernels is the
// variant table's to say.)
struct QkvShape {
  DType dtype;
  TensorStrides q_stride, k_stride, v_stride;
  int64_t batch, seqlen_q, seqlen_k, heads, heads_kv, hdim, hdim_v;
};
QkvShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// The packed documents of a varlen call (FA3's cu_seqlens layout; common/seqlen_info.h).
struct PackedDocs {
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
};

// The arguments of a packed call: cu_seqlens_q / _k contiguous int32, 1-D, one
// length (batch + 1 >= 2), on device; max_seqlen_q / _k in [1, total_q] /
// [1, total_k]. Returns batch. The offsets' values stay on the device.
int64_t check_packed_docs(const PackedDocs& docs, int64_t total_q, int64_t total_k, const at::Device& device);

// The SM count of a CUDA device (queried once per device).
int64_t device_sm_count(const at::Device& device);

// t itself when the kernels can address it through TMA (16-byte aligned base
// and strides, contiguous last dim), else a contiguous copy.
at::Tensor kernel_view(const at::Tensor& t);

// Steps of the backward shared by bwd() and the step ops (bwd_pre_post.cpp).
struct BwdWorkspace;
void check_preprocess_inputs(const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse);
// Packed (docs != nullptr): out, dout (1, total_q, heads, d) views, lse (1, heads, total_q),
// seqlen_q_rounded the padded total for block_m-row tiles.
void launch_bwd_preprocess(const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                           const BwdWorkspace& ws, int64_t seqlen_q_rounded, cudaStream_t stream,
                           const PackedDocs* docs = nullptr, int64_t block_m = 0);
// GQA's dK/dV, summed by the postprocess from their per-head fp32 partials.
struct DkvCast {
  const float* dk_partial;  // (batch, heads, seqlen_k, headdim); accumulated: (batch, heads_kv, ...)
  const float* dv_partial;
  bool accumulated;  // BwdParams::dkv_accumulate or dkv_ordered: one accumulator per KV head
  at::Tensor dk, dv;  // (batch, seqlen_k, heads_kv, headdim)
  bool fp32 = false;  // dk, dv are fp32: the group sums, not rounded
};
// dq_accum: as the main kernel leaves it (fragment order, bwd_block_m(hdim)-row tiles).
// dq_semaphore: a deterministic call's counters (BwdPostprocessParams::dq_semaphore), else nullptr.
// Packed (docs != nullptr): batch is 1, seqlen_q total_q, seqlen_q_rounded the padded
// total; dq comes back (1, total_q, heads, d).
at::Tensor launch_bwd_postprocess(const float* dq_accum, int64_t batch, int64_t heads, int64_t seqlen_q,
                                  int64_t seqlen_q_rounded, int64_t hdim, double softmax_scale,
                                  at::ScalarType dtype, const at::Device& device, cudaStream_t stream,
                                  const DkvCast* dkv = nullptr, const PackedDocs* docs = nullptr,
                                  int64_t dq_splits = 1, int64_t dq_split_floats = 0,
                                  const int* dq_semaphore = nullptr, int64_t dq_split_sems = 0);

}  // namespace dash_fa3
