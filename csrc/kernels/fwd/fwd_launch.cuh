// Host launcher of the forward kernel: defines dash_fa3::run_fwd (declared in
// common/launch.h). Each instantiation file includes this header once.
//
// Requirements on the inputs (checked here, cheaply, with a clear error):
//   - q, k, v, o 16-byte aligned; every stride (batch, row, head) a multiple of
//     8 elements (TMA needs 16-byte aligned global strides; o's only where it
//     leaves by TMA, else even); last dim contiguous;
//   - headdim == kHeadDim, headdim_v == kHeadDimV (v's and o's last dim),
//     seqlen_q, seqlen_k >= 1, heads % heads_kv == 0,
//     softmax_scale > 0; lse is (batch, heads, seqlen_q) contiguous fp32, or
//     (heads, total_q) with packed documents (cu_seqlens_q/k, whose values the
//     caller guarantees: monotonic, ending at total_q/k, no document longer
//     than seqlen_q/k);
//   - local kernels: window_left, window_right >= -1 (the full and causal
//     kernels do not read them).
// Packed documents also need packed_order (packed_order_ints(batch) int32 on
// the device), which this launcher fills before the main kernel; dense causal
// masks need tile_counter (one int32 on the device), which it zeroes.
#pragma once

// kBlockN = 176 / 112 / 80 need WGMMA N extents outside CuTe's default set. Defined
// before any CuTe header; the build may also pass it with -D.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cute/tensor.hpp>

#include "common/constants.h"
#include "common/cuda_check.h"
#include "common/dtype.h"
#include "common/launch.h"
#include "common/params.h"
#include "common/softcap.h"
#include "kernels/fwd/fwd_kernel.h"
#include "kernels/fwd/fwd_tile_scheduler.h"
#include "kernels/fwd/fwd_traits.h"

namespace dash_fa3 {

namespace fwd {

inline void require(bool ok, const char* what) {
  if (!ok) { throw std::invalid_argument(std::string("dash_fa3 fwd: ") + what); }
}

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

inline bool tma_strides_ok(TensorStrides const& s) {
  return s.batch % 8 == 0 && s.row % 8 == 0 && s.head % 8 == 0;
}

template <class Traits>
typename Traits::Params make_fwd_params(FwdParams const& a) {
  using Element = typename Traits::Element;
  using P = typename Traits::Params;
  P p{};
  // Packed documents: the tensors are one batch of total rows.
  constexpr bool packed = Traits::kPacked;
  int const rows_q = packed ? a.total_q : a.seqlen_q, rows_k = packed ? a.total_k : a.seqlen_k;
  int const tensor_batch = tensor_batches(a.batch, a.cu_seqlens_q);
  auto shape_q = make_shape(rows_q, a.headdim, a.heads, tensor_batch);
  auto shape_k = make_shape(rows_k, a.headdim, a.heads_kv, tensor_batch);
  auto shape_vt = make_shape(a.headdim_v, rows_k, a.heads_kv, tensor_batch);
  auto gQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.q)), shape_q,
                        make_stride(a.q_stride.row, _1{}, a.q_stride.head, a.q_stride.batch));
  auto gK = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.k)), shape_k,
                        make_stride(a.k_stride.row, _1{}, a.k_stride.head, a.k_stride.batch));
  auto gVt = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.v)), shape_vt,
                         make_stride(_1{}, a.v_stride.row, a.v_stride.head, a.v_stride.batch));
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gQ, typename Traits::SmemLayoutQLoad{},
                          Shape<Int<Traits::kQRowsPerLoad>, Int<Traits::kHeadDim>>{}, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gK, take<0, 2>(typename Traits::SmemLayoutK{}),
                          Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gVt, take<0, 2>(typename Traits::SmemLayoutVt{}),
                          Shape<Int<Traits::kHeadDimV>, Int<Traits::kBlockN>>{}, _1{});
  p.shape_q = shape_q;
  if constexpr (Traits::kTmaEpilogue) {
    auto gO = make_tensor(make_gmem_ptr(static_cast<Element*>(a.o)), Traits::shape_o(p),
                          make_stride(a.o_stride.row, _1{}, a.o_stride.head, a.o_stride.batch));
    p.tma_o = make_tma_copy(SM90_TMA_STORE{}, gO, take<0, 2>(typename Traits::SmemLayoutO{}),
                            Shape<_64, Int<Traits::kHeadDimV>>{}, _1{});
  }
  p.shape_k = shape_k;
  p.shape_vt = shape_vt;
  p.o = a.o;
  p.o_batch_stride = a.o_stride.batch;
  p.o_row_stride = a.o_stride.row;
  p.o_head_stride = a.o_stride.head;
  p.lse = a.lse;
  p.lse_batch_stride = packed ? 0 : int64_t(a.heads) * a.seqlen_q;
  p.lse_head_stride = packed ? a.total_q : a.seqlen_q;
  p.cu_seqlens_q = a.cu_seqlens_q;
  p.cu_seqlens_k = a.cu_seqlens_k;
  p.packed_order = a.packed_order;
  p.tile_counter = a.tile_counter;
  p.seqlen_q = a.seqlen_q;
  p.seqlen_k = a.seqlen_k;
  p.heads = a.heads;
  p.batch = a.batch;
  p.q_heads_per_kv_head = a.heads / a.heads_kv;
  p.score_scale = softmax_score_scale(a.softmax_scale, a.softcap);
  p.score_scale_log2 = p.score_scale * kLog2e;
  p.softcap_prescale = softcap_prescale(a.softmax_scale, a.softcap);
  // An unbounded side as a bound that hides nothing: a left bound >= seqlen_k - 1
  // and a right bound >= seqlen_q - 1 give the same block ranges and element
  // masks as -1 (common/block_range.h; tests/test_schedule_geometry.py checks
  // the ranges), and the device code then needs no -1 case. Packed, the
  // longest document's lengths bound every document's.
  p.window_left = a.window_left < 0 ? a.seqlen_k : a.window_left;
  p.window_right = a.window_right < 0 ? a.seqlen_q : a.window_right;
  p.num_m_blocks = (a.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  // Packed, a bound: no document has more query tiles than the longest.
  int64_t const units =
      int64_t(FwdTileScheduler<Traits>::units_per_head(p.num_m_blocks)) * a.heads * a.batch;
  require(units < (int64_t(1) << 30), "too many tiles (batch * heads * seqlen_q / 128 >= 2^30)");
  p.num_units = int(units);
  return p;
}

// Launches the forward of Traits on checked parameters (run_fwd).
template <class Traits>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  typename Traits::Params p = make_fwd_params<Traits>(params);

  int num_sms = params.num_sms;
  if (num_sms <= 0) {
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
               "cudaDeviceGetAttribute(multiProcessorCount)");
  }
  int const grid = p.num_units < num_sms ? p.num_units : num_sms;

  // Sections (fwd_tile_scheduler.h): the query heads of one KV head, or of as
  // many KV heads as the single causal tiles need to fill the grid once.
  int const kv_heads_per_section =
      Traits::kDynamicCausalTiles ? fwd_causal_section_kv_heads(p.num_m_blocks, grid) : 1;
  p.heads_per_section = kv_heads_per_section * p.q_heads_per_kv_head;
  if constexpr (Traits::kDynamicCausalTiles) {
    check_cuda(cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream), "cudaMemsetAsync(tile_counter)");
  }

  if constexpr (Traits::kPacked) {
    FwdPackedOrderParams order{};
    order.cu_seqlens_q = params.cu_seqlens_q;
    order.cu_seqlens_k = params.cu_seqlens_k;
    order.batch = params.batch;
    order.heads = params.heads;
    order.block_m = Traits::kBlockM;
    order.block_n = Traits::kBlockN;
    order.causal_pairs = Traits::kCausal;
    order.order = params.packed_order;
    run_fwd_packed_order(order, stream);
  }

  auto kernel = fwd_kernel<Traits>;
  constexpr int kSmemBytes = Traits::kSharedStorageBytes;
  set_max_dynamic_smem_once<fwd_kernel<Traits>>(
      kSmemBytes, "cudaFuncSetAttribute(fwd_kernel, max dynamic shared memory)");
  kernel<<<grid, Traits::kNumThreads, kSmemBytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "fwd_kernel launch");
}

}  // namespace fwd

// Dense causal attention at hdim 64 runs three MMA warpgroups (192-row tiles)
// from this many query rows on, two below: three pay off only from 2k rows;
// below, a 192-row tile's two diagonal blocks weigh more than the third
// warpgroup's overlap gains (measured: docs/journal/code-comments.md).
constexpr int kCausalThreeWarpgroupsFrom = 2048;

// A kernel whose two MMA warpgroups share one O slot (FwdTraits::kOutputSlots
// == 1: hdim 128 without a diagonal, and (192, 128)) runs below this many
// keys, one that writes each warpgroup's O through V's buffer (kOutputInV_)
// from here on. The shared slot's turn sits on the second warpgroup's path, so
// at hdim 128 O in V's buffer is the faster from 2k keys on, the shared slot
// below (measured: docs/journal/code-comments.md). (192, 128) takes the same
// switch, not measured there.
constexpr int kSharedOutputSlotBelowKeys = 2048;

template <int kHeadDim, int kHeadDimV, DType kDType, MaskKind kMask, bool kPacked, bool kSoftcap>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Traits = fwd::FwdTraits<kHeadDim, kHeadDimV, Element<kDType>, kMask, kPacked, kSoftcap>;
  using fwd::require;
  require(params.headdim == kHeadDim, "headdim does not match the instantiation");
  require(params.headdim_v == kHeadDimV, "headdim_v does not match the instantiation");
  require(params.batch >= 1 && params.heads >= 1 && params.heads_kv >= 1, "batch and heads must be >= 1");
  require(params.seqlen_q >= 1 && params.seqlen_k >= 1, "seqlen_q and seqlen_k must be >= 1");
  require(params.heads % params.heads_kv == 0, "heads must be a multiple of heads_kv");
  require(params.softmax_scale > 0.f, "softmax_scale must be > 0");
  require((params.softcap > 0.f) == kSoftcap,
          kSoftcap ? "the softcap instantiation needs softcap > 0" : "softcap > 0 needs the softcap instantiation");
  require(fwd::aligned16(params.q) && fwd::aligned16(params.k) && fwd::aligned16(params.v) &&
              fwd::aligned16(params.o),
          "q, k, v, o must be 16-byte aligned");
  require(fwd::tma_strides_ok(params.q_stride) && fwd::tma_strides_ok(params.k_stride) &&
              fwd::tma_strides_ok(params.v_stride),
          "q, k, v strides (batch, row, head) must be multiples of 8 elements");
  require(params.o_stride.row % 2 == 0 && params.o_stride.head % 2 == 0 && params.o_stride.batch % 2 == 0,
          "o strides must be even (O is written in 4-byte pairs)");
  require(!Traits::kTmaEpilogue || fwd::tma_strides_ok(params.o_stride),
          "o strides (batch, row, head) must be multiples of 8 elements (O leaves by TMA)");
  require(params.lse != nullptr, "lse must be given");
  require((params.cu_seqlens_q != nullptr) == kPacked && (params.cu_seqlens_k != nullptr) == kPacked,
          kPacked ? "the packed instantiation needs cu_seqlens_q and cu_seqlens_k"
                  : "the dense instantiation takes no cu_seqlens (packed documents have their own)");
  require(params.cu_seqlens_q == nullptr || (params.total_q >= 1 && params.total_k >= 1),
          "packed documents need total_q, total_k >= 1");
  require((params.packed_order != nullptr) == kPacked,
          kPacked ? "the packed instantiation needs packed_order" : "the dense instantiation takes no packed_order");
  constexpr bool kTileCounter = kMask == MaskKind::kCausal && !kPacked;
  require((params.tile_counter != nullptr) == kTileCounter,
          kTileCounter ? "the dense causal instantiation needs tile_counter"
                       : "only the dense causal instantiation takes a tile_counter");
  require(!Traits::kLocal || (params.window_left >= -1 && params.window_right >= -1),
          "window_left and window_right must be >= -1 (-1: unbounded)");

  if constexpr (kHeadDim == 64 && kMask == MaskKind::kCausal && !kPacked) {
    if (params.seqlen_q >= kCausalThreeWarpgroupsFrom) {
      fwd::launch_fwd<fwd::FwdTraits<kHeadDim, kHeadDimV, Element<kDType>, kMask, kPacked, kSoftcap, 3>>(params,
                                                                                                      stream);
      return;
    }
  }
  if constexpr (Traits::kOutputSlots == 1) {
    if (params.seqlen_k >= kSharedOutputSlotBelowKeys) {
      using TraitsOutputInV = fwd::FwdTraits<kHeadDim, kHeadDimV, Element<kDType>, kMask, kPacked, kSoftcap, 0, true>;
      fwd::launch_fwd<TraitsOutputInV>(params, stream);
      return;
    }
  }
  fwd::launch_fwd<Traits>(params, stream);
}

}  // namespace dash_fa3
