// dQ-writer role of the backward kernel: one warp per sdQ buffer (warps
// 1 .. kStagesDq of warpgroup 0). Writer b moves the fp32 partial dQ of every
// step whose CTA-wide step index is = b (mod kStagesDq) from sdQ buffer b into
// the fp32 dQ accumulator (batch, heads, seqlen_q_rounded, d) with one 1-D
// bulk reduce-add (cp.reduce.async.bulk ... .add.f32) of the whole tile: sdQ
// and the accumulator's tile hold it in the same fragment order
// (common/dq_accum_layout.h), kBlockM * d contiguous floats in both places,
// so no tensor map is needed.
//
// Per step of writer b, in the schedule's order:
//   deterministic: wait until sem[batch, h, q] == rank (the schedule's rank of this
//                  (KV tile, Q tile) contribution); this needs nothing of the
//                  step's dQ, so it overlaps the MMA warpgroups' work
//   per MMA warpgroup w: wait dq_full(b, w) (w wrote its half of sdQ buffer b),
//                  issue that half's reduce-add, commit
//   per w: wait until w's half has been READ -> arrive dq_empty(b, w) (w may
//                  write its half again while the add is still landing)
//   deterministic: wait until both adds have COMPLETED, then sem[batch, h, q] += 1
// Why one warp per buffer: in deterministic mode one step's hand-off is a
// serial chain (acquire spin, add, completion wait, release) about as long as
// a whole MMA step; with a single writer that chain, not the tensor cores,
// set the pace. Two writers overlap the chains of consecutive steps. A
// writer's release still waits only for its own add, so the ordering
// argument (bwd_semaphore.h) is unchanged and no new wait is introduced.
// Non-deterministic mode runs the same code without the semaphore wait and
// release: the adds of different CTAs then land in any order.
// A shared half (kDqSharedHalf, d = 256): the one sdQ buffer holds half a
// tile, and the halves pass through it in warpgroup order; the writer hands
// the region to the other warpgroup as soon as the copy engine has read it.
#pragma once

#include <cute/tensor.hpp>

#include "common/named_barriers.h"
#include "kernels/bwd/bwd_mainloop.h"
#include "kernels/bwd/bwd_semaphore.h"
#include "kernels/bwd/bwd_tasks.h"
#include "kernels/bwd/bwd_traits.h"
#include "schedules/schedule_metadata.h"

namespace dash_fa3::bwd {

template <class Traits>
struct BwdDqWriter {
  using Params = typename Traits::Params;
  using SharedStorage = typename Traits::SharedStorage;
  using Mainloop = BwdMainloop<Traits>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;

  // Run by all 32 lanes of writer warp `buffer`; lane 0 issues and waits.
  CUTE_DEVICE static void run(Params const& p, SharedStorage& smem, int buffer) {
    bool const leader = (threadIdx.x % 32) == 0;
    float const* sdq = smem.dq.data() + buffer * Traits::kDqBufferFloats;
    TileGeometry const geo = Traits::tile_geometry(p);

    // sdQ[buffer] starts out empty (a shared half: for warpgroup 0, which fills it first).
    CUTE_UNROLL
    for (int wg = 0; wg < (Traits::kDqSharedHalf ? 1 : Traits::kNumMmaWarpgroups); ++wg) {
      named_barrier_arrive(Mainloop::dq_empty(buffer, wg), Traits::kDqHandoffThreads);
    }
    // Index of the next step among all steps of this CTA; the MMA warpgroups
    // write step i into sdQ[i % kStagesDq].
    int cta_step = 0;

    CtaTasks const tasks = CtaTasks::of(p.cta_offsets);
    for (int task = tasks.begin; task < tasks.end; ++task) {
      int32_t const* row = schedule::task_row(p.tasks, task);
      int const n_steps = row[schedule::kCNSteps];
      if (n_steps <= 0) { continue; }
      int const b = row[schedule::kCBatch];
      int const h = row[schedule::kCHead];
      // Tile q of this (batch, head): rows [q kBlockM, (q + 1) kBlockM), contiguous.
      float* dq_bh = p.dq_accum + (int64_t(b) * p.heads + h) * p.seqlen_q_rounded * kHeadDim;
      int* sem_bh = p.dq_semaphore + (int64_t(b) * p.heads + h) * p.n_q;

      // First step of this task that falls on our buffer.
      int const first = (buffer - cta_step % Traits::kStagesDq + Traits::kStagesDq) % Traits::kStagesDq;
      cta_step += n_steps;
      schedule::StepOrder const order = schedule::StepOrder::of(row);  // kFixedSteps only
      for (int s = first; s < n_steps; s += Traits::kStagesDq) {
        schedule::StepInfo const st = Traits::kFixedSteps ? schedule::StepInfo{order.q_tile(s), 0}
                                                          : schedule::decode_step(geo, p.rank, row, s);
        bool const deterministic = !Traits::kFixedSteps && p.deterministic;
        if (leader && deterministic) {
          // Our turn: every contribution of lower rank has completed its add.
          semaphore_wait_for(sem_bh + st.q_tile, st.rank);
          fence_proxy_async_global();
        }
        float* dq_tile = dq_bh + int64_t(st.q_tile) * Traits::kDqTileFloats;
        if constexpr (Traits::kDqSharedHalf) {
          // One half-tile region, filled by the warpgroups in turn: each half
          // must have been read before the other warpgroup may write.
          CUTE_UNROLL
          for (int wg = 0; wg < Traits::kNumMmaWarpgroups; ++wg) {
            // Wait until MMA warpgroup wg has written its half of this step's partial dQ.
            named_barrier_sync(Mainloop::dq_full(buffer, wg), Traits::kDqHandoffThreads);
            if (leader) {
              bulk_reduce_add_f32(dq_tile + wg * Traits::kDqHalfFloats, sdq, Traits::kDqHalfBytes,
                                  uint64_t(TMA::CacheHintSm90::EVICT_LAST));
              tma_store_arrive();
              bulk_wait_read<0>();
            }
            __syncwarp();
            // The region has been read: the next warpgroup in turn may fill it.
            named_barrier_arrive(Mainloop::dq_empty(buffer, (wg + 1) % Traits::kNumMmaWarpgroups),
                                 Traits::kDqHandoffThreads);
          }
        } else {
          CUTE_UNROLL
          for (int wg = 0; wg < Traits::kNumMmaWarpgroups; ++wg) {
            // Wait until MMA warpgroup wg has written its half of this step's partial dQ.
            named_barrier_sync(Mainloop::dq_full(buffer, wg), Traits::kDqHandoffThreads);
            if (leader) {
              // A Q tile's accumulator receives an add from every KV tile of its
              // head, spread over the kernel: keep it in L2 between them.
              bulk_reduce_add_f32(dq_tile + wg * Traits::kDqHalfFloats, sdq + wg * Traits::kDqHalfFloats,
                                  Traits::kDqHalfBytes, uint64_t(TMA::CacheHintSm90::EVICT_LAST));
              tma_store_arrive();
            }
          }
          // One bulk group per half, committed in warpgroup order: half wg has
          // been read once at most (kNumMmaWarpgroups - 1 - wg) groups are pending.
          cute::for_each(cute::make_int_sequence<Traits::kNumMmaWarpgroups>{}, [&](auto wg) {
            if (leader) { bulk_wait_read<Traits::kNumMmaWarpgroups - 1 - decltype(wg)::value>(); }
            __syncwarp();
            // Warpgroup wg's half of sdQ[buffer] has been read: wg may overwrite it.
            named_barrier_arrive(Mainloop::dq_empty(buffer, wg), Traits::kDqHandoffThreads);
          });
        }
        if (leader && deterministic) {
          bulk_wait_all_complete();  // both adds have landed in global memory
          fence_proxy_async_global();
          semaphore_release_increment(sem_bh + st.q_tile);  // hand the turn to rank + 1
        }
      }
    }
    if (leader) { bulk_wait_all_complete(); }
  }
};

}  // namespace dash_fa3::bwd
