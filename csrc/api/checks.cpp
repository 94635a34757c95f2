#include "api.h"
#include "message.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cmath>

#include "common/cuda_check.h"

namespace dash_fa3 {

void check_softcap(double softcap) {
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0,
              msg("dash_fa3: softcap must be a finite number >= 0 (0: none), got ", softcap));
}

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kFP16;
    default: TORCH_CHECK(false, msg("dash_fa3: ", name, " must be bfloat16 or float16, got ", t.scalar_type()));
  }
}

TensorStrides bshd_strides(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), msg("dash_fa3: ", name, " must be a CUDA tensor"));
  TORCH_CHECK(t.dim() == 4, msg("dash_fa3: ", name, " must be (batch, seqlen, heads, headdim), got ", t.sizes()));
  TORCH_CHECK(t.stride(-1) == 1, msg("dash_fa3: ", name, " must have a contiguous last dim"));
  // TMA addresses rows in 16-byte units.
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.stride(d) % 8 == 0 || t.size(d) == 1, msg("dash_fa3: ", name,
                " strides must be multiples of 8 elements (16 bytes), got ", t.strides()));
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, msg("dash_fa3: ", name,
              " must be 16-byte aligned"));
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

QkvShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  QkvShape s{};
  s.dtype = dtype_of(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "dash_fa3: q, k and v must share a dtype");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), "dash_fa3: q, k and v must be on one device");
  s.q_stride = bshd_strides(q, "q");
  s.k_stride = bshd_strides(k, "k");
  s.v_stride = bshd_strides(v, "v");
  s.batch = q.size(0), s.seqlen_q = q.size(1), s.heads = q.size(2), s.hdim = q.size(3);
  s.seqlen_k = k.size(1), s.heads_kv = k.size(2);
  TORCH_CHECK(k.size(0) == s.batch && k.size(3) == s.hdim,
              msg("dash_fa3: k must be (", s.batch, ", seqlen_k, heads_kv, ", s.hdim, "), got ", k.sizes()));
  s.hdim_v = v.size(3);
  TORCH_CHECK(v.size(0) == s.batch && v.size(1) == s.seqlen_k && v.size(2) == s.heads_kv,
              msg("dash_fa3: v must be (", s.batch, ", ", s.seqlen_k, ", ", s.heads_kv, ", headdim_v), got ",
                  v.sizes()));
  TORCH_CHECK(s.seqlen_q >= 1 && s.seqlen_k >= 1, "dash_fa3: sequence lengths must be >= 1");
  TORCH_CHECK(s.heads_kv >= 1 && s.heads % s.heads_kv == 0,
              msg("dash_fa3: heads (", s.heads, ") must be a multiple of heads_kv (", s.heads_kv, ")"));
  return s;
}

int64_t check_packed_docs(const PackedDocs& docs, int64_t total_q, int64_t total_k, const at::Device& device) {
  for (const at::Tensor* t : {&docs.cu_seqlens_q, &docs.cu_seqlens_k}) {
    TORCH_CHECK(t->device() == device && t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous() &&
                    t->numel() >= 2,
                msg("dash_fa3: cu_seqlens_q / cu_seqlens_k must be contiguous 1-D int32 tensors of batch + 1 >= 2 "
                    "entries on q's device ", device, ", got ", t->scalar_type(), " ", t->sizes(), " on ",
                    t->device()));
  }
  TORCH_CHECK(docs.cu_seqlens_q.numel() == docs.cu_seqlens_k.numel(),
              msg("dash_fa3: cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got ",
                  docs.cu_seqlens_q.numel(), " and ", docs.cu_seqlens_k.numel()));
  TORCH_CHECK(docs.max_seqlen_q >= 1 && docs.max_seqlen_k >= 1 && docs.max_seqlen_q <= total_q &&
                  docs.max_seqlen_k <= total_k,
              msg("dash_fa3: max_seqlen_q / max_seqlen_k must be in [1, total_q] / [1, total_k], got ",
                  docs.max_seqlen_q, " / ", docs.max_seqlen_k));
  return docs.cu_seqlens_q.numel() - 1;
}

int64_t device_sm_count(const at::Device& device) {
  TORCH_CHECK(device.is_cuda(), "dash_fa3: device_sm_count needs a CUDA device");
  int index = device.has_index() ? device.index() : -1;
  if (index < 0) check_cuda(cudaGetDevice(&index), "cudaGetDevice");
  // A device's SM count never changes: query it once per device.
  static std::array<std::atomic<int>, 64> cache{};
  if (index < 64) {
    if (const int cached = cache[index].load(std::memory_order_relaxed)) return cached;
  }
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, index),
             "cudaDeviceGetAttribute(multiProcessorCount)");
  if (index < 64) cache[index].store(sms, std::memory_order_relaxed);
  return sms;
}

at::Tensor kernel_view(const at::Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "dash_fa3: tensor arguments must have at least one dim");
  // TMA needs a 16-byte aligned base and 16-byte multiples for every stride.
  const int64_t elems = 16 / int64_t(t.element_size());
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; ok && d + 1 < t.dim(); ++d) ok = t.stride(d) % elems == 0 || t.size(d) == 1;
  return ok ? t : t.contiguous();
}

}  // namespace dash_fa3
