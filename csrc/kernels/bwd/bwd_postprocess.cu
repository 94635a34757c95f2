// Backward postprocess: dQ[b,s,h,:] = softmax_scale * (row s of dQaccum[b,h]),
// cast to the input dtype and written in FA3's (batch, seqlen, heads, headdim)
// layout; with GQA, in the same launch, dK/dV summed over each group's query
// heads from their fp32 partials and cast.
//
// The accumulator holds each block_m-row Q tile in the main kernel's fragment
// order (common/dq_accum_layout.h), not row by row: rows m and m + 8 (m % 16
// < 8) x 8 columns are 16 consecutive floats there. One thread reads those 64
// bytes (4 x 16-byte loads, whole 32-byte sectors) and writes the two rows'
// 8 columns (2 x 16-byte stores); consecutive threads take consecutive column
// chunks, so a warp's stores cover whole output rows.
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "common/dq_accum_layout.h"
#include "common/dtype.h"
#include "common/launch.h"
#include "common/seqlen_info.h"

namespace dash_fa3 {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // 8 outputs per row and thread: one 16-byte store
constexpr int kRowPair = 8;  // a dQ thread writes rows m and m + kRowPair of a 16-row block

template <class Elem>
__device__ void store_vec(void* dst, const float (&vals)[kVec], float scale) {
  uint4 packed;
  Elem* out = reinterpret_cast<Elem*>(&packed);
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = static_cast<Elem>(vals[j] * scale);
  *reinterpret_cast<uint4*>(dst) = packed;
}

__device__ void load_vec(float (&vals)[kVec], const float* src) {
  const float4 lo = reinterpret_cast<const float4*>(src)[0], hi = reinterpret_cast<const float4*>(src)[1];
  vals[0] = lo.x, vals[1] = lo.y, vals[2] = lo.z, vals[3] = lo.w;
  vals[4] = hi.x, vals[5] = hi.y, vals[6] = hi.z, vals[7] = hi.w;
}

// The sum over a GQA group's query heads, in ascending head order (a fixed
// order: the result is the same bits in every mode and run).
__device__ void group_sum(float (&acc)[kVec], const float* src, int group, int64_t head_stride) {
  load_vec(acc, src);
  for (int g = 1; g < group; ++g) {
    float vals[kVec];
    load_vec(vals, src + g * head_stride);
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] += vals[j];
  }
}

// Row pairs (m, m + 8) of 16-row blocks: the dQ rows a thread writes are
// pair_row(pair) and pair_row(pair) + kRowPair.
__host__ __device__ constexpr int pair_row(int pair) {
  return (pair / kRowPair) * 2 * kRowPair + pair % kRowPair;
}

// Row pairs per (batch, head): every pair with a row below seqlen_q. Their rows
// stay below seqlen_q_rounded, a multiple of block_m and so of 16.
__host__ __device__ constexpr int row_pairs(int seqlen_q) {
  return (seqlen_q + 2 * kRowPair - 1) / (2 * kRowPair) * kRowPair;
}

// kVec-wide chunks of one GQA dK/dV row step: the wider of the two.
__host__ __device__ inline int kv_chunks_per_row(BwdPostprocessParams const& p) {
  return (p.headdim > p.headdim_v ? p.headdim : p.headdim_v) / kVec;
}

// One grid-stride loop over the dQ work (row pair, chunk) and then, with GQA,
// the dK/dV chunks (both tensors of a chunk in one step; with MLA's narrower
// dV the chunks past its width hold dK's only).
// Packed documents: the pairs of the padded accumulator rows, each row mapped
// to its document's packed row (common/seqlen_info.h), padding not written.
template <class Elem>
__global__ void __launch_bounds__(kThreads) bwd_postprocess_kernel(BwdPostprocessParams p) {
  const int tensor_batch = tensor_batches(p.batch, p.cu_seqlens_q);
  const int chunks_per_row = p.headdim / kVec;
  const int chunks_per_kv_row = kv_chunks_per_row(p);
  const int pairs = row_pairs(p.cu_seqlens_q != nullptr ? p.seqlen_q_rounded : p.seqlen_q);
  const int64_t total_q = int64_t(tensor_batch) * p.heads * pairs * chunks_per_row;
  const int64_t total_kv =
      p.dk_partial != nullptr ? int64_t(tensor_batch) * p.heads_kv * p.seqlen_k * chunks_per_kv_row : 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total_q + total_kv; i += stride) {
    // dQ: (b, h, row pair, chunk); dK/dV: (b, h_kv, s, chunk); chunk fastest.
    const bool is_q = i < total_q;
    const int64_t e = is_q ? i : i - total_q;
    const int rows = is_q ? pairs : p.seqlen_k;
    const int heads = is_q ? p.heads : p.heads_kv;
    const int chunks = is_q ? chunks_per_row : chunks_per_kv_row;
    const int c = static_cast<int>(e % chunks);
    int64_t rest = e / chunks;
    const int s = static_cast<int>(rest % rows);  // dQ: the row pair
    rest /= rows;
    const int h = static_cast<int>(rest % heads);
    const int b = static_cast<int>(rest / heads);
    float vals[kVec];
    if (is_q) {
      // Rows lo and lo + 8 of tile lo / block_m, columns 8c .. 8c + 7: 16
      // consecutive floats, float4 k = (lo, 8c+2k), (lo, 8c+2k+1), (hi, ...), (hi, ...).
      const int lo = pair_row(s);
      const int tile = lo / p.block_m;
      const float4* src = reinterpret_cast<const float4*>(
          p.dq_accum + ((int64_t(b) * p.heads + h) * p.seqlen_q_rounded + int64_t(tile) * p.block_m) * p.headdim +
          dq_frag_offset(p.block_m, p.headdim, lo - tile * p.block_m, c * kVec));
      float hi_vals[kVec];
#pragma unroll
      for (int k = 0; k < kVec / 2; ++k) {
        const float4 v = src[k];
        vals[2 * k] = v.x, vals[2 * k + 1] = v.y;
        hi_vals[2 * k] = v.z, hi_vals[2 * k + 1] = v.w;
      }
      // The output rows of accumulator rows lo and lo + 8 (-1: padding).
      const int out_lo = stat_input_row(lo, p.seqlen_q, p.cu_seqlens_q, p.batch, p.block_m);
      const int out_hi = stat_input_row(lo + kRowPair, p.seqlen_q, p.cu_seqlens_q, p.batch, p.block_m);
      Elem* dst = static_cast<Elem*>(p.dq) + b * p.dq_stride.batch + h * p.dq_stride.head + c * kVec;
      if (out_lo >= 0) store_vec<Elem>(dst + out_lo * p.dq_stride.row, vals, p.softmax_scale);
      if (out_hi >= 0) store_vec<Elem>(dst + out_hi * p.dq_stride.row, hi_vals, p.softmax_scale);
    } else {
      // Query heads h * group ... h * group + group - 1 share KV head h.
      const int group = p.heads / p.heads_kv;
      const int64_t row = (int64_t(b) * p.heads + int64_t(h) * group) * p.seqlen_k + s;
      if (c * kVec < p.headdim) {
        Elem* dk = static_cast<Elem*>(p.dk) + b * p.dk_stride.batch + s * p.dk_stride.row + h * p.dk_stride.head;
        group_sum(vals, p.dk_partial + row * p.headdim + c * kVec, group, int64_t(p.seqlen_k) * p.headdim);
        store_vec<Elem>(dk + c * kVec, vals, 1.f);
      }
      if (c * kVec < p.headdim_v) {
        Elem* dv = static_cast<Elem*>(p.dv) + b * p.dv_stride.batch + s * p.dv_stride.row + h * p.dv_stride.head;
        group_sum(vals, p.dv_partial + row * p.headdim_v + c * kVec, group, int64_t(p.seqlen_k) * p.headdim_v);
        store_vec<Elem>(dv + c * kVec, vals, 1.f);
      }
    }
  }
}

}  // namespace

void run_bwd_postprocess(const BwdPostprocessParams& params, DType dtype, cudaStream_t stream) {
  if (params.headdim % kVec != 0 || params.headdim_v % kVec != 0 || params.headdim_v < 1) {
    throw std::invalid_argument("dash_fa3: postprocess needs headdim and headdim_v multiples of 8");
  }
  if (!dq_frag_layout_ok(params.block_m, params.headdim) || params.seqlen_q_rounded % params.block_m != 0 ||
      params.seqlen_q > params.seqlen_q_rounded) {
    throw std::invalid_argument("dash_fa3: postprocess needs a dQ fragment order for (block_m, headdim) and "
                                "seqlen_q <= seqlen_q_rounded, a multiple of block_m");
  }
  const int tensor_batch = tensor_batches(params.batch, params.cu_seqlens_q);
  const int64_t total_kv = params.dk_partial != nullptr
                               ? int64_t(tensor_batch) * params.heads_kv * params.seqlen_k * kv_chunks_per_row(params)
                               : 0;
  const int64_t total = int64_t(tensor_batch) * params.heads *
                            row_pairs(params.cu_seqlens_q != nullptr ? params.seqlen_q_rounded : params.seqlen_q) *
                            (params.headdim / kVec) +
                        total_kv;
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
