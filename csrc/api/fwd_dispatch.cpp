// The forward's one dispatch function: runtime arguments -> compiled variant.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>
#include <vector>

#include "api.h"
#include "common/constants.h"
#include "common/launch.h"
#include "common/packed_order.h"
#include "message.h"
#include "variant_registry.h"
#include "variant_table.h"

namespace dash_fa3 {
namespace {

#define DASH_FA3_FWD_ENTRY(HDIM, HDIM_V, DTYPE, MASK, PACKED, SOFTCAP, NAME)                        \
  KernelVariant<FwdParams>{HDIM, HDIM_V, DType::DTYPE, MaskKind::MASK, PACKED, SOFTCAP, NAME,                \
                           &run_fwd<HDIM, HDIM_V, DType::DTYPE, MaskKind::MASK, PACKED, SOFTCAP>},
// A vector, not an array: a build may select no variant of a direction.
const std::vector<KernelVariant<FwdParams>> kFwdKernels = {DASH_FA3_FOR_EACH_FWD_KERNEL(DASH_FA3_FWD_ENTRY)};
#undef DASH_FA3_FWD_ENTRY

}  // namespace

std::vector<std::string> built_fwd_variants(bool packed, bool softcap) {
  return variant_names(kFwdKernels, packed, softcap);
}

namespace {

// The forward's one dispatch: the window (left, right; -1 unbounded) picks the
// mask kind (mask_kind_of: full, causal or local), the shape and dtype the rest.
// Packed calls pass (1, total, heads, d) views of their (total, heads, d) tensors.
std::tuple<at::Tensor, at::Tensor> fwd_dispatch(const at::Tensor& q_in, const at::Tensor& k_in,
                                                const at::Tensor& v_in, double softmax_scale, double softcap,
                                                int64_t window_left,
                                                int64_t window_right, int64_t sm_margin, const PackedDocs* packed) {
  const at::Tensor q = kernel_view(q_in), k = kernel_view(k_in), v = kernel_view(v_in);
  const QkvShape sh = check_qkv(q, k, v);
  const int64_t num_sms = device_sm_count(q.device()) - sm_margin;
  TORCH_CHECK(sm_margin >= 0 && num_sms >= 1, msg("dash_fa3: sm_margin=", sm_margin, " must be >= 0 and leave at "
              "least one SM of the device's ", num_sms + sm_margin));
  TORCH_CHECK(window_left >= -1 && window_right >= -1 && window_left < (int64_t(1) << 30) &&
                  window_right < (int64_t(1) << 30),
              msg("dash_fa3: window (", window_left, ", ", window_right, ") entries must be in [-1, 2^30) "
                  "(-1: unbounded)"));
  const MaskKind mask = mask_kind_of(static_cast<int>(window_left), static_cast<int>(window_right));
  check_softcap(softcap);
  const auto& chosen =
      find_variant(kFwdKernels, "forward", sh.hdim, sh.hdim_v, sh.dtype, mask, packed != nullptr, softcap > 0);
  const int64_t batch = sh.batch, seqlen_q = sh.seqlen_q, heads = sh.heads, hdim = sh.hdim, hdim_v = sh.hdim_v;

  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({batch, seqlen_q, heads, hdim_v}, q.options());
  at::Tensor lse = packed ? at::empty({heads, seqlen_q}, q.options().dtype(at::kFloat))
                          : at::empty({batch, heads, seqlen_q}, q.options().dtype(at::kFloat));

  FwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_stride = sh.q_stride;
  p.k_stride = sh.k_stride;
  p.v_stride = sh.v_stride;
  p.o_stride = bshd_strides(out, "out");
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(sh.seqlen_k);
  if (packed) {
    const int64_t docs = check_packed_docs(*packed, seqlen_q, sh.seqlen_k, q.device());
    p.cu_seqlens_q = packed->cu_seqlens_q.data_ptr<int>();
    p.cu_seqlens_k = packed->cu_seqlens_k.data_ptr<int>();
    p.total_q = static_cast<int>(seqlen_q);
    p.total_k = static_cast<int>(sh.seqlen_k);
    p.batch = static_cast<int>(docs);
    p.seqlen_q = static_cast<int>(packed->max_seqlen_q);
    p.seqlen_k = static_cast<int>(packed->max_seqlen_k);
  }
  p.heads = static_cast<int>(heads);
  p.heads_kv = static_cast<int>(sh.heads_kv);
  p.headdim = static_cast<int>(hdim);
  p.headdim_v = static_cast<int>(hdim_v);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.softcap = static_cast<float>(softcap);
  p.window_left = static_cast<int>(window_left);
  p.window_right = static_cast<int>(window_right);
  p.num_sms = static_cast<int>(num_sms);
  at::Tensor order;  // packed: the documents' order, written by run_fwd's order kernel
  if (packed) {
    order = at::empty({packed_order_ints(p.batch)}, q.options().dtype(at::kInt));
    p.packed_order = order.data_ptr<int>();
  } else if (mask == MaskKind::kCausal) {
    order = at::empty({1}, q.options().dtype(at::kInt));  // the tile counter, zeroed by run_fwd
    p.tile_counter = order.data_ptr<int>();
  }
  chosen.launch(p, c10::cuda::getCurrentCUDAStream().stream());
  return {out, lse};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       double softmax_scale, bool causal, int64_t sm_margin) {
  return fwd_dispatch(q, k, v, softmax_scale, 0.0, -1, causal ? 0 : -1, sm_margin, nullptr);
}

std::tuple<at::Tensor, at::Tensor> fwd_window(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              double softmax_scale, int64_t window_left, int64_t window_right,
                                              double softcap, int64_t sm_margin) {
  return fwd_dispatch(q, k, v, softmax_scale, softcap, window_left, window_right, sm_margin, nullptr);
}

std::tuple<at::Tensor, at::Tensor> fwd_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                              int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                              int64_t window_left, int64_t window_right, double softcap,
                                              int64_t sm_margin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "dash_fa3: packed q, k, v must be (total_tokens, heads, headdim)");
  const PackedDocs packed{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  auto [out, lse] = fwd_dispatch(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale, softcap,
                                 window_left, window_right, sm_margin, &packed);
  return {out.squeeze(0), lse};
}

}  // namespace dash_fa3
