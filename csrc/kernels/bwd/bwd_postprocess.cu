// Backward postprocess: dQ[b,s,h,:] = softmax_scale * dQaccum[b,h,s,:], cast to
// the input dtype and written in FA3's (batch, seqlen, heads, headdim) layout.
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "common/dtype.h"
#include "common/launch.h"

namespace dash_fa3 {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // 8 outputs per thread: two float4 loads, one 16-byte store

template <class Elem>
__global__ void __launch_bounds__(kThreads) bwd_postprocess_kernel(BwdPostprocessParams p) {
  const int chunks_per_row = p.headdim / kVec;
  const int64_t total = int64_t(p.batch) * p.heads * p.seqlen_q * chunks_per_row;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride) {
    // (b, h, s, chunk) with chunk fastest: consecutive threads read consecutive accumulator bytes.
    const int c = static_cast<int>(i % chunks_per_row);
    int64_t rest = i / chunks_per_row;
    const int s = static_cast<int>(rest % p.seqlen_q);
    rest /= p.seqlen_q;
    const int h = static_cast<int>(rest % p.heads);
    const int b = static_cast<int>(rest / p.heads);
    const float4* src = reinterpret_cast<const float4*>(
        p.dq_accum + ((int64_t(b) * p.heads + h) * p.seqlen_q_rounded + s) * p.headdim + c * kVec);
    const float4 lo = src[0], hi = src[1];
    const float vals[kVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint4 packed;
    Elem* out = reinterpret_cast<Elem*>(&packed);
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = static_cast<Elem>(vals[j] * p.softmax_scale);
    Elem* dst = static_cast<Elem*>(p.dq) + b * p.dq_stride.batch + s * p.dq_stride.row + h * p.dq_stride.head;
    reinterpret_cast<uint4*>(dst)[c] = packed;
  }
}

}  // namespace

void run_bwd_postprocess(const BwdPostprocessParams& params, DType dtype, cudaStream_t stream) {
  if (params.headdim % kVec != 0) throw std::invalid_argument("dash_fa3: postprocess needs headdim % 8 == 0");
  const int64_t total = int64_t(params.batch) * params.heads * params.seqlen_q * (params.headdim / kVec);
  if (total == 0) return;
  int device = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  // A few waves of the grid-stride loop: enough blocks in flight to saturate HBM.
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t(sms) * 8);
  dispatch_dtype(dtype, [&](auto tag) {
    using Elem = typename decltype(tag)::type;
    bwd_postprocess_kernel<Elem><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  });
  check_cuda(cudaGetLastError(), "bwd_postprocess launch");
}

}  // namespace dash_fa3
