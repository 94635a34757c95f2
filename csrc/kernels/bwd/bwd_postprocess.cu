// Backward postprocess: dQ[b,s,h,:] = softmax_scale * (row s of dQaccum[b,h]),
// cast to the input dtype and written in FA3's (batch, seqlen, heads, headdim)
// layout; with GQA, in the same launch, dK/dV summed over each group's query
// heads from their fp32 partials and cast.
//
// The accumulator holds each block_m-row Q tile in the main kernel's fragment
// order (common/dq_accum_layout.h), not row by row: rows m and m + 8 (m % 16
// < 8) x 8 columns are 16 consecutive floats there. One thread reads those 64
// bytes (4 x 16-byte loads, whole 32-byte sectors) and writes the two rows'
// 8 columns (2 x 16-byte stores). A block is (column chunks) x (row pairs):
// threadIdx.x is the thread's chunk for the whole launch, so the column part
// of its accumulator offset is computed once, and a warp's stores cover whole
// output rows. (A flat index split by 64-bit divisions, and the general
// dq_frag_offset per element, make the kernel issue-bound; measured:
// docs/journal/code-comments.md.)
#include <cuda_runtime.h>

#include <algorithm>

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

// dK/dV rows: in the input dtype, or with p.dkv_fp32 as they are (two 16-byte stores).
template <class Elem>
__device__ void store_kv_vec(BwdPostprocessParams const& p, void* base, int64_t offset, const float (&vals)[kVec]) {
  if (p.dkv_fp32) {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(base) + offset);
    dst[0] = make_float4(vals[0], vals[1], vals[2], vals[3]);
    dst[1] = make_float4(vals[4], vals[5], vals[6], vals[7]);
  } else {
    store_vec<Elem>(static_cast<Elem*>(base) + offset, vals, 1.f);
  }
}

__device__ void load_vec(float (&vals)[kVec], const float* src) {
  const float4 lo = reinterpret_cast<const float4*>(src)[0], hi = reinterpret_cast<const float4*>(src)[1];
  vals[0] = lo.x, vals[1] = lo.y, vals[2] = lo.z, vals[3] = lo.w;
  vals[4] = hi.x, vals[5] = hi.y, vals[6] = hi.z, vals[7] = hi.w;
}

// The sum over a GQA group's query heads, in ascending head order (a fixed
// order: the result is the same bits in every mode and run). The loads go out
// kGroupLoads at a time before their adds, so a thread waits on the memory
// once per batch rather than once per head.
constexpr int kGroupLoads = 2;
__device__ void group_sum(float (&acc)[kVec], const float* src, int group, int64_t head_stride) {
  load_vec(acc, src);
  for (int g = 1; g < group; g += kGroupLoads) {
    float vals[kGroupLoads][kVec];
#pragma unroll
    for (int u = 0; u < kGroupLoads; ++u) {
      if (g + u < group) load_vec(vals[u], src + (g + u) * head_stride);
    }
#pragma unroll
    for (int u = 0; u < kGroupLoads; ++u) {
      if (g + u < group) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[j] += vals[u][j];
      }
    }
  }
}

// The 16 floats of a row pair at src (rows lo and lo + 8, 8 columns), summed
// over the dQ splits in ascending split order (a fixed order: the same bits in
// every run), into lo's and hi's 8 values. `sems`: the tile's counter in split
// 0 (BwdPostprocessParams::dq_semaphore), a split whose counter reads 0 left
// the tile unwritten and is skipped; nullptr: every split is read.
__device__ void sum_splits(BwdPostprocessParams const& p, const float4* src, const int* sems, float (&vals)[kVec],
                           float (&hi_vals)[kVec]) {
  float4 v[kVec / 2];
#pragma unroll
  for (int k = 0; k < kVec / 2; ++k) v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  bool first = true;
#pragma unroll 1
  for (int split = 0; split < p.num_dq_splits; ++split) {
    if (sems && __ldg(sems + split * p.dq_split_sems) == 0) continue;
    const float4* s = src + split * (p.dq_split_floats / 4);
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float4 w = __ldg(s + k);
      if (first) {
        v[k] = w;
      } else {
        v[k].x += w.x, v[k].y += w.y, v[k].z += w.z, v[k].w += w.w;
      }
    }
    first = false;
  }
#pragma unroll
  for (int k = 0; k < kVec / 2; ++k) {
    vals[2 * k] = v[k].x, vals[2 * k + 1] = v[k].y;
    hi_vals[2 * k] = v[k].z, hi_vals[2 * k + 1] = v[k].w;
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

// The launch's work (run_bwd_postprocess): dQ slabs, dK/dV slabs (GQA, else
// 0), the row pairs of a dQ slab, and the blocks each slab kind takes.
struct PostprocessWork {
  int q_slabs, kv_slabs, pairs;
  int q_blocks, kv_blocks;  // per slab: ceil(pairs or seqlen_k / rows per block)
  __host__ __device__ int64_t blocks() const { return int64_t(q_slabs) * q_blocks + int64_t(kv_slabs) * kv_blocks; }
};

// Work comes in slabs: the dQ rows of each (batch, head), then, with GQA, the
// dK/dV rows of each (batch, KV head). Each slab gets as many blocks as its
// own rows fill (dQ slabs of few queries beside dK/dV slabs of many keys take
// few blocks, not as many as the longest slab), one row (dQ: row pair) per
// threadIdx.y; blockIdx.x strides over all slabs' blocks. threadIdx.x is the
// 8-column chunk (dK/dV: both tensors of a chunk in one step; with MLA's
// narrower dV the chunks past its width hold dK's only).
// Packed documents: the pairs of the padded accumulator rows, each row mapped
// to its document's packed row (common/seqlen_info.h), padding not written.
template <class Elem>
__global__ void __launch_bounds__(kThreads) bwd_postprocess_kernel(BwdPostprocessParams p, PostprocessWork w) {
  const int c = threadIdx.x;
  const int64_t q_total = int64_t(w.q_slabs) * w.q_blocks, total = w.blocks();
  for (int64_t blk = blockIdx.x; blk < total; blk += gridDim.x) {
    if (blk < q_total) {
      const int slab = int(blk / w.q_blocks);
      const int pair = int(blk % w.q_blocks) * blockDim.y + threadIdx.y;
      if (c >= p.headdim / kVec || pair >= w.pairs) continue;
      const int h = slab % p.heads, b = slab / p.heads;
      // The fragment offset of (m, c) is that of (m, 0) plus that of (0, c)
      // (tests/test_contract_cpp.py checks it): the column part once per thread.
      const float* accum = p.dq_accum + int64_t(slab) * p.seqlen_q_rounded * p.headdim +
                           dq_frag_offset(p.block_m, p.headdim, 0, c * kVec);
      Elem* dst = static_cast<Elem*>(p.dq) + b * p.dq_stride.batch + h * p.dq_stride.head + c * kVec;
      // Deterministic: the slab's tile counters (dq_semaphore), tile t at sems[t].
      const int* sems = p.dq_semaphore ? p.dq_semaphore + int64_t(slab) * (p.seqlen_q_rounded / p.block_m) : nullptr;
      // Rows lo and lo + 8, columns 8c .. 8c + 7: 16 consecutive floats,
      // float4 k = (lo, 8c+2k), (lo, 8c+2k+1), (hi, ...), (hi, ...).
      const int lo = pair_row(pair);
      const int m = lo & (p.block_m - 1);  // block_m is 64 or 128 (dq_frag_layout_ok)
      const float4* src = reinterpret_cast<const float4*>(
          accum + int64_t(lo - m) * p.headdim + dq_frag_offset(p.block_m, p.headdim, m, 0));
      float vals[kVec], hi_vals[kVec];
      sum_splits(p, src, sems ? sems + lo / p.block_m : nullptr, vals, hi_vals);
      // The output rows of accumulator rows lo and lo + 8 (-1: padding).
      const int out_lo = stat_input_row(lo, p.seqlen_q, p.cu_seqlens_q, p.batch, p.block_m);
      const int out_hi = stat_input_row(lo + kRowPair, p.seqlen_q, p.cu_seqlens_q, p.batch, p.block_m);
      if (out_lo >= 0) store_vec<Elem>(dst + out_lo * p.dq_stride.row, vals, p.softmax_scale);
      if (out_hi >= 0) store_vec<Elem>(dst + out_hi * p.dq_stride.row, hi_vals, p.softmax_scale);
    } else {
      const int kv_slab = int((blk - q_total) / w.kv_blocks);
      const int s = int((blk - q_total) % w.kv_blocks) * blockDim.y + threadIdx.y;
      if (s >= p.seqlen_k) continue;
      const int h = kv_slab % p.heads_kv, b = kv_slab / p.heads_kv;
      // Query heads h * group ... h * group + group - 1 share KV head h: a slab
      // each, or one accumulator that they all added into (group 1 here).
      const int group = p.dkv_partial_group;
      const int64_t first_row = (int64_t(b) * p.heads_kv + h) * group * p.seqlen_k;
      float vals[kVec];
      if (c * kVec < p.headdim) {
        group_sum(vals, p.dk_partial + (first_row + s) * p.headdim + c * kVec, group,
                  int64_t(p.seqlen_k) * p.headdim);
        store_kv_vec<Elem>(p, p.dk, b * p.dk_stride.batch + s * p.dk_stride.row + h * p.dk_stride.head + c * kVec,
                           vals);
      }
      if (c * kVec < p.headdim_v) {
        group_sum(vals, p.dv_partial + (first_row + s) * p.headdim_v + c * kVec, group,
                  int64_t(p.seqlen_k) * p.headdim_v);
        store_kv_vec<Elem>(p, p.dv, b * p.dv_stride.batch + s * p.dv_stride.row + h * p.dv_stride.head + c * kVec,
                           vals);
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
  const bool gqa = params.dk_partial != nullptr;
  const int tensor_batch = tensor_batches(params.batch, params.cu_seqlens_q);
  PostprocessWork w{};
  w.pairs = row_pairs(params.cu_seqlens_q != nullptr ? params.seqlen_q_rounded : params.seqlen_q);
  w.q_slabs = tensor_batch * params.heads;
  w.kv_slabs = gqa ? tensor_batch * params.heads_kv : 0;
  const int chunks = gqa ? kv_chunks_per_row(params) : params.headdim / kVec;
  if (chunks > kThreads) {
    throw std::invalid_argument("dash_fa3: postprocess needs head dims of at most 8 * 256");
  }
  if (w.q_slabs + w.kv_slabs == 0 || (w.pairs == 0 && !gqa)) return;
  const int rows_per_block = kThreads / chunks;
  w.q_blocks = (w.pairs + rows_per_block - 1) / rows_per_block;
  w.kv_blocks = gqa ? (params.seqlen_k + rows_per_block - 1) / rows_per_block : 0;
  if (w.blocks() == 0) return;
  // One row (pair) per thread where the grid allows; blockIdx.x strides beyond it.
  const dim3 block(chunks, rows_per_block);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(w.blocks(), int64_t(1) << 30)));
  dispatch_dtype(dtype, [&](auto tag) {
    using Elem = typename decltype(tag)::type;
    bwd_postprocess_kernel<Elem><<<grid, block, 0, stream>>>(params, w);
  });
  check_cuda(cudaGetLastError(), "bwd_postprocess launch");
}

}  // namespace dash_fa3
