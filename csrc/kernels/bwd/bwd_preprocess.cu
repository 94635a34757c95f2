// Backward preprocess, one launch before the main backward kernel:
//   dPsum[b,h,s]   = sum_d dO[b,s,h,d] * O[b,s,h,d]   (fp32)
//   lse_log2[b,h,s] = lse[b,h,s] * log2(e)             (the main kernel uses exp2)
//   the accumulators and semaphores of the main kernel = 0 (one span)
// Rows s in [seqlen_q, seqlen_q_rounded) are padding for the main kernel's
// last Q tile and get dPsum 0, lse_log2 +inf (so P = 0 there). Packed
// documents (cu_seqlens_q): the outputs are (heads, padded total), each
// document's rows from its padded offset on, the rows between documents
// padding (common/seqlen_info.h).
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "common/constants.h"
#include "common/cuda_check.h"
#include "common/dtype.h"
#include "common/launch.h"
#include "common/seqlen_info.h"

namespace dash_fa3 {
namespace {

constexpr int kThreads = 256;
// Each thread loads 16 bytes (8 elements, a chunk) at a time; kLanesPerRow
// lanes share a row, so a warp covers 32 / kLanesPerRow rows and every head
// dim that is a multiple of 8 works. A lane issues the loads of up to
// kChunksPerLane chunks of O and of dO before it uses any: with one 16-byte
// pair in flight per lane the kernel was bound by load latency, not by HBM.
// Lanes per row: 2 up to hdim 64 (four chunks each), else 8. With 2 at hdim 64
// the O/dO reads are faster than with 8; 4 at hdim 128 read faster too, but the
// kernel, zeroing included, is slower (half as many blocks zero the same span;
// measured: docs/journal/code-comments.md).
constexpr int kVec = 8;
constexpr int kChunksPerLane = 4;
constexpr int lanes_per_row(int headdim) { return headdim <= 2 * kChunksPerLane * kVec ? 2 : 8; }

// The dot product of two 8-element chunks held in registers. Taking them by
// value matters: a reference into global memory let the compiler split each
// 16-byte load into eight 2-byte ones.
template <class Elem>
__device__ float dot_chunk(uint4 a, uint4 b) {
  const Elem* x = reinterpret_cast<const Elem*>(&a);
  const Elem* y = reinterpret_cast<const Elem*>(&b);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc += static_cast<float>(x[i]) * static_cast<float>(y[i]);
  return acc;
}

template <class Elem, int kLanesPerRow>
__global__ void __launch_bounds__(kThreads) bwd_preprocess_kernel(BwdPreprocessParams p) {
  constexpr int kRowsPerBlock = kThreads / kLanesPerRow;
  const int lane_in_row = threadIdx.x % kLanesPerRow;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanesPerRow;
  const int64_t num_rows = int64_t(tensor_batches(p.batch, p.cu_seqlens_q)) * p.heads * p.seqlen_q_rounded;

  // Rows are enumerated (b, h, s) with s fastest, the layout of dPsum and lse_log2.
  // Every lane of the warp joins the row sums' shuffles, those past the last row too.
  float acc = 0.f;
  float lse_log2 = INFINITY;
  if (row < num_rows) {
    const int r = static_cast<int>(row % p.seqlen_q_rounded);
    const int64_t bh = row / p.seqlen_q_rounded;
    const int h = static_cast<int>(bh % p.heads);
    const int b = static_cast<int>(bh / p.heads);
    // The input row (-1: padding); packed, in batch 0.
    const int s = stat_input_row(r, p.seqlen_q, p.cu_seqlens_q, p.batch, p.block_m);
    if (s >= 0) {
      const uint4* o = reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.o) + b * p.o_stride.batch +
                                                      s * p.o_stride.row + h * p.o_stride.head);
      const uint4* d = reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.dout) + b * p.dout_stride.batch +
                                                      s * p.dout_stride.row + h * p.dout_stride.head);
      const int chunks = p.headdim / kVec;
      for (int c0 = lane_in_row; c0 < chunks; c0 += kLanesPerRow * kChunksPerLane) {
        uint4 ov[kChunksPerLane], dv[kChunksPerLane];
#pragma unroll
        for (int i = 0; i < kChunksPerLane; ++i) {
          const int c = c0 + i * kLanesPerRow;
          if (c < chunks) ov[i] = __ldg(o + c), dv[i] = __ldg(d + c);
        }
#pragma unroll
        for (int i = 0; i < kChunksPerLane; ++i) {
          if (c0 + i * kLanesPerRow < chunks) acc += dot_chunk<Elem>(ov[i], dv[i]);
        }
      }
      const float lse = p.lse[(int64_t(b) * p.heads + h) * p.seqlen_q + s];  // packed: b = 0
      // A row that attends no key has lse = -inf and O = 0. +inf makes the main
      // kernel's P = exp2(S - lse) exactly 0 there instead of NaN.
      lse_log2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
    }
  }
#pragma unroll
  for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) {
    acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  }
  if (row < num_rows && lane_in_row == 0) {
    p.dpsum[row] = acc;
    p.lse_log2[row] = lse_log2;
  }

  // Zero the accumulators and semaphores (one span) with a grid-stride loop;
  // the main kernel only ever adds into them.
  const int64_t tid = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  uint4* zero = static_cast<uint4*>(p.zero_begin);
  for (int64_t i = tid; i < p.zero_vec16; i += stride) zero[i] = make_uint4(0u, 0u, 0u, 0u);
}

}  // namespace

void run_bwd_preprocess(const BwdPreprocessParams& params, DType dtype, cudaStream_t stream) {
  if (params.headdim % kVec != 0) throw std::invalid_argument("dash_fa3: preprocess needs headdim % 8 == 0");
  const int64_t num_rows =
      int64_t(tensor_batches(params.batch, params.cu_seqlens_q)) * params.heads * params.seqlen_q_rounded;
  dispatch_dtype(dtype, [&](auto tag) {
    using Elem = typename decltype(tag)::type;
    auto launch = [&](auto lanes) {
      constexpr int kRowsPerBlock = kThreads / decltype(lanes)::value;
      const int64_t blocks = (num_rows + kRowsPerBlock - 1) / kRowsPerBlock;
      if (blocks == 0) return;
      bwd_preprocess_kernel<Elem, decltype(lanes)::value><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
    };
    if (lanes_per_row(params.headdim) == 2) {
      launch(std::integral_constant<int, 2>{});
    } else {
      launch(std::integral_constant<int, 8>{});
    }
  });
  check_cuda(cudaGetLastError(), "bwd_preprocess launch");
}

}  // namespace dash_fa3
