// Epilogue role of the forward kernel: each MMA thread writes its rows of O
// (converted to the input type) and the LSE of its two rows.
//
// O goes straight from registers to global memory: each thread stores pairs
// of adjacent elements (4 bytes), and the four threads of a quad cover 16
// contiguous bytes of a row. Rows past the problem's seqlen_q are not written
// (with packed documents they belong to the next document). The epilogue
// needs no shared memory, so it never waits for the producer and the next
// tile's loads run underneath it.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "common/gemm_sm90.h"
#include "kernels/fwd/fwd_mainloop.h"
#include "kernels/fwd/fwd_tile_scheduler.h"
#include "kernels/fwd/fwd_traits.h"

namespace dash_fa3::fwd {

template <class Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  using Params = typename Traits::Params;
  using FragO = typename FwdMainloop<Traits>::FragO;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;

  CUTE_DEVICE static void store(Params const& p, FragO const& tOrO, float const (&lse)[2],
                                FwdTile const& t, SeqlenInfo const& sl, int mma_tid) {
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(mma_tid);
    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tOrOut = make_tensor<Element>(typename FragO::layout_type{});
    convert_fragment(tOrO, tOrOut);

    int const row0 = t.m_block * kBlockM;
    Element* o = static_cast<Element*>(p.o) + sl.tensor_batch * p.o_batch_stride + sl.offset_q * p.o_row_stride +
                 t.head * p.o_head_stride;
    constexpr int kV = decltype(size<0, 2>(tOrOut))::value;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      int const row = row0 + get<0>(tOcO(2 * r));
      if (row < sl.seqlen_q) {
        Element* o_row = o + row * p.o_row_stride;
        CUTE_UNROLL
        for (int v = 0; v < kV; ++v) {
          int const i = 4 * v + 2 * r;
          // Registers i and i + 1 hold columns col and col + 1.
          *reinterpret_cast<uint32_t*>(o_row + get<1>(tOcO(i))) =
              *reinterpret_cast<uint32_t const*>(&tOrOut(i));
        }
      }
    }
    // The quad thread that holds column 0 writes the LSE of the two rows.
    if (get<1>(tOcO(0)) == 0) {
      float* lse_bh = p.lse + sl.tensor_batch * p.lse_batch_stride + t.head * p.lse_head_stride + sl.offset_q;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        int const row = row0 + get<0>(tOcO(2 * r));
        if (row < sl.seqlen_q) { lse_bh[row] = lse[r]; }
      }
    }
  }

  // A tile whose rows attend no key (causal with seqlen_q > seqlen_k):
  // O = 0, LSE = -inf.
  CUTE_DEVICE static void store_empty(Params const& p, FwdTile const& t, SeqlenInfo const& sl, int mma_tid) {
    FragO zero;
    clear(zero);
    float const lse[2] = {-INFINITY, -INFINITY};
    store(p, zero, lse, t, sl, mma_tid);
  }
};

}  // namespace dash_fa3::fwd
