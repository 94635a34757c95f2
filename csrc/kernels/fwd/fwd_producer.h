// Producer role of the forward kernel: one warp issues the TMA loads of Q, K
// and V for every tile this CTA processes.
//
// Per tile with key blocks n = end-1 ... 0 (visited from the last block down,
// which puts the masked blocks first), the load order is
//   K[end-1], Q, K[end-2], V[end-1], K[end-3], V[end-2], ..., V[0]
// which is the order in which the MMA warpgroups consume them with
// intra-warpgroup overlap (S = Q K[n]^T is issued before O += P V[n+1]).
// Q has its own kQStages-deep pipeline, so with kQStages = 2 the next tile's
// Q lands while the current tile still runs; with FwdTraits::kQPerWarpgroup
// Q is one load per MMA warpgroup's 64 rows, each a stage of that pipeline.
// K and V have their own kStages-deep pipelines; the i-th K block and the
// i-th V block of the CTA use the same stage index and phase. Where O leaves
// through V's buffer (FwdTraits::kOutputInV), a tile's first V load waits
// until the previous tile's O has been read out of it (o_read).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/block_range.h"
#include "common/problem_view.h"
#include "kernels/fwd/fwd_tile_scheduler.h"
#include "kernels/fwd/fwd_traits.h"

namespace dash_fa3::fwd {

template <class Traits>
struct FwdProducer {
  using Params = typename Traits::Params;
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = typename Traits::PipelineState;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }

  // Run by all 32 lanes of the producer warp; lane 0 issues the copies and
  // the expect-tx arrivals (it is the pipelines' leader thread).
  CUTE_DEVICE static void run(Params const& p, SharedStorage& smem, PipelineQ& pipeline_q,
                              PipelineKV& pipeline_k, PipelineKV& pipeline_v) {
    bool const leader = (threadIdx.x % 32) == 0;
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});

    auto tma_q = p.tma_q.get_slice(_0{});
    auto tma_k = p.tma_k.get_slice(_0{});
    auto tma_v = p.tma_v.get_slice(_0{});
    constexpr int kQLoads = Traits::kQLoadsPerTile;
    constexpr int kQRows = Traits::kQRowsPerLoad;
    Tensor tKsK = tma_k.partition_D(sK);    // (TMA, TMA_N, TMA_D, stage)
    Tensor tVsV = tma_v.partition_D(sVt);   // (TMA, TMA_D, TMA_N, stage)

    PipelineState write_state = cutlass::make_producer_start_state<PipelineKV>();
    typename Traits::PipelineStateQ q_write_state = cutlass::make_producer_start_state<PipelineQ>();

    using Scheduler = FwdTileScheduler<Traits>;
    int unit = 0;  // the current round's unit (Scheduler::tile_at)
    int tiles_loaded = 0;  // tiles with key blocks so far (kOutputInV: o_read's phases)
    for (int k = 0;; ++k) {
      FwdTile t;
      SeqlenInfo sl;
      BlockRange kv_blocks;
      typename Scheduler::Slot const slot = Scheduler::template tile_at<true>(p, smem, k, unit, t, sl, kv_blocks);
      if (slot == Scheduler::Slot::kDone) { break; }
      if (slot == Scheduler::Slot::kSkip) { continue; }
      // The MMA warpgroups skip such a tile too (they write O = 0, LSE = -inf).
      if (kv_blocks.end <= kv_blocks.begin) { continue; }
      int const head_kv = t.head / p.q_heads_per_kv_head;

      // A packed document's rows start at its offset; its last tiles read the
      // next document's rows, which the mask (keys) and the epilogue (rows) ignore.
      constexpr bool kPacked = Traits::kPacked;
      Tensor gQ = local_tile(rows_from<kPacked>(p.tma_q.get_tma_tensor(p.shape_q)(_, _, t.head, sl.tensor_batch),
                                                sl.offset_q),
                             Shape<Int<kQRows>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (rows, D, load)
      Tensor gK = local_tile(rows_from<kPacked>(p.tma_k.get_tma_tensor(p.shape_k)(_, _, head_kv, sl.tensor_batch),
                                                sl.offset_k),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));   // (N, D, n)
      // V^T is (d, rows): its rows are mode 1.
      Tensor gVt = local_tile(rows_from<kPacked, 1>(p.tma_v.get_tma_tensor(p.shape_vt)(_, _, head_kv, sl.tensor_batch),
                                                    sl.offset_k),
                              Shape<Int<kHeadDimV>, Int<kBlockN>>{}, make_coord(_0{}, _));  // (DV, N, n)
      Tensor tQgQ = tma_q.partition_S(gQ);  // (TMA, TMA_M, TMA_D, load)
      Tensor tKgK = tma_k.partition_S(gK);
      Tensor tVgV = tma_v.partition_S(gVt);

      auto load_k = [&](int n, PipelineState const& state) {
        pipeline_k.producer_acquire(state);
        if (leader) {
          copy(p.tma_k.with(*pipeline_k.producer_get_barrier(state), 0, TMA::CacheHintSm90::EVICT_LAST),
               tKgK(_, _, _, n), tKsK(_, _, _, state.index()));
        }
      };
      auto load_v = [&](int n, PipelineState const& state) {
        pipeline_v.producer_acquire(state);
        if (leader) {
          copy(p.tma_v.with(*pipeline_v.producer_get_barrier(state), 0, TMA::CacheHintSm90::EVICT_LAST),
               tVgV(_, _, _, n), tVsV(_, _, _, state.index()));
        }
      };

      // kOutputInV: the previous tile's O sits in V's buffer until the copy
      // engine has read it; wait for that (o_read) before the tile's first V.
      auto wait_o_read = [&] {
        if constexpr (Traits::kOutputInV) {
          if (tiles_loaded > 0) { cutlass::arch::ClusterBarrier::wait(&smem.o_read, (tiles_loaded - 1) & 1); }
        }
      };

      int n = kv_blocks.end - 1;
      load_k(n, write_state);
      // Waits until the MMA warpgroups released this Q stage (their last
      // S = Q K^T of the tile kQStages tiles back has retired).
      // kQPerWarpgroup: one load per warpgroup's rows, each waiting only for that
      // warpgroup's release.
      CUTE_UNROLL
      for (int l = 0; l < kQLoads; ++l) {
        pipeline_q.producer_acquire(q_write_state);
        Tensor sQl = local_tile(sQ(_, _, Traits::q_smem_stage(q_write_state.index())),
                                Shape<Int<kQRows>, Int<kHeadDim>>{}, make_coord(l, _0{}));
        if (leader) {
          copy(p.tma_q.with(*pipeline_q.producer_get_barrier(q_write_state), 0, TMA::CacheHintSm90::EVICT_FIRST),
               tQgQ(_, _, _, t.m_block * kQLoads + l), tma_q.partition_D(sQl));
        }
        ++q_write_state;
      }
      bool first_v = true;
      for (--n; n >= kv_blocks.begin; --n) {
        PipelineState const v_state = write_state;  // V of block n+1 rides one step behind K
        ++write_state;
        load_k(n, write_state);
        if (first_v) { wait_o_read(); first_v = false; }
        load_v(n + 1, v_state);
      }
      if (first_v) { wait_o_read(); }
      load_v(kv_blocks.begin, write_state);
      ++write_state;
      ++tiles_loaded;
    }
  }
};

}  // namespace dash_fa3::fwd
