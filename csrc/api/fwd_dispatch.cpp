// The forward's one dispatch function: runtime arguments -> compiled variant.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <string>
#include <vector>

#include "api.h"
#include "message.h"
#include "common/launch.h"
#include "variant_table.h"

namespace dash_fa3 {
namespace {

using FwdLauncher = void (*)(const FwdParams&, cudaStream_t);

struct FwdVariant {
  int hdim;
  DType dtype;
  bool causal;
  const char* name;
  FwdLauncher launch;
};

#define DASH_FA3_FWD_ENTRY(HDIM, DTYPE, CAUSAL, NAME) \
  FwdVariant{HDIM, DType::DTYPE, CAUSAL, NAME, &run_fwd<HDIM, DType::DTYPE, CAUSAL>},
// A vector, not an array: a build may select no variant of this direction.
const std::vector<FwdVariant> kFwdVariants = {DASH_FA3_FOR_EACH_FWD_VARIANT(DASH_FA3_FWD_ENTRY)};
#undef DASH_FA3_FWD_ENTRY

constexpr float kLog2e = 1.4426950408889634f;

std::string built_list() {
  std::string names;
  for (const auto& v : kFwdVariants) names += (names.empty() ? "" : ", ") + std::string(v.name);
  return names;
}

}  // namespace

std::vector<std::string> built_fwd_variants() {
  std::vector<std::string> names;
  for (const auto& v : kFwdVariants) names.emplace_back(v.name);
  return names;
}

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       double softmax_scale, bool causal, int64_t num_sms) {
  const DType dtype = dtype_of(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "dash_fa3: q, k and v must share a dtype");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), "dash_fa3: q, k and v must be on one device");
  const TensorStrides q_stride = bshd_strides(q, "q");
  const TensorStrides k_stride = bshd_strides(k, "k");
  const TensorStrides v_stride = bshd_strides(v, "v");
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads = q.size(2), hdim = q.size(3);
  const int64_t seqlen_k = k.size(1), heads_kv = k.size(2);
  TORCH_CHECK(k.size(0) == batch && k.size(3) == hdim, msg("dash_fa3: k must be (", batch, ", seqlen_k, heads_kv, ",
              hdim, "), got ", k.sizes()));
  TORCH_CHECK(v.sizes() == k.sizes(), msg("dash_fa3: v must have k's shape ", k.sizes(), ", got ", v.sizes()));
  TORCH_CHECK(seqlen_q >= 1 && seqlen_k >= 1, "dash_fa3: sequence lengths must be >= 1");
  TORCH_CHECK(heads_kv >= 1 && heads % heads_kv == 0, msg("dash_fa3: heads (", heads,
              ") must be a multiple of heads_kv (", heads_kv, ")"));
  TORCH_CHECK(num_sms >= 1, "dash_fa3: num_sms must be >= 1");

  const FwdVariant* chosen = nullptr;
  for (const auto& var : kFwdVariants) {
    if (var.hdim == hdim && var.dtype == dtype && var.causal == causal) chosen = &var;
  }
  TORCH_CHECK(chosen != nullptr, msg("dash_fa3: no forward kernel for hdim", hdim, "-",
              dtype == DType::kBF16 ? "bf16" : "fp16", "-", causal ? "causal" : "full",
              " in this build (built: ", built_list(), "); rebuild with DASH_FA3_VARIANTS naming it"));

  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({batch, seqlen_q, heads, hdim}, q.options());
  at::Tensor lse = at::empty({batch, heads, seqlen_q}, q.options().dtype(at::kFloat));

  FwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_stride = q_stride;
  p.k_stride = k_stride;
  p.v_stride = v_stride;
  p.o_stride = bshd_strides(out, "out");
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.heads = static_cast<int>(heads);
  p.heads_kv = static_cast<int>(heads_kv);
  p.headdim = static_cast<int>(hdim);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.softmax_scale_log2 = static_cast<float>(softmax_scale) * kLog2e;
  p.num_sms = static_cast<int>(num_sms);
  p.tile_counter = nullptr;  // the forward's persistent scheduler is static
  chosen->launch(p, c10::cuda::getCurrentCUDAStream().stream());
  return {out, lse};
}

}  // namespace dash_fa3
