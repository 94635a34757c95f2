// dQ-writer role of the backward kernel: kDqWriters = 2 warps (warps 1 and 2
// of warpgroup 0). Writer b moves the fp32 partial dQ of every step whose
// CTA-wide step index is = b (mod 2) from shared memory (sdQ) into the fp32
// dQ accumulator (batch, heads, seqlen_q_rounded, d) with 1-D bulk
// reduce-adds (cp.reduce.async.bulk ... .add.f32): sdQ and the accumulator's
// tile hold it in the same fragment order (common/dq_accum_layout.h), kBlockM
// * d contiguous floats in both places, so no tensor map is needed. Writer b
// waits on the hand-off barriers of set b (dq_full(b, w)); the MMA
// warpgroups use set (step mod 2).
//
// Per step of writer b, in the schedule's order:
//   deterministic: wait until sem[batch, h, q] == rank (the schedule's rank of this
//                  (KV tile, Q tile) contribution); this needs nothing of the
//                  step's dQ, so it overlaps the MMA warpgroups' work
//   per part w (Traits::kDqHandoffParts: MMA warpgroup w's half with two
//                  warpgroups, the whole tile with three): wait dq_full(b, w)
//                  (the part of the step's partial dQ is written), issue its
//                  reduce-add (deterministic rank 0: a plain bulk store, so
//                  the accumulator needs no zeroing), commit
//   per w: wait until part w has been READ -> arrive on the dq_empty barrier
//                  of whoever writes that region next (its warpgroups may write
//                  again while the add is still landing)
//   deterministic: wait until the adds have COMPLETED, then sem[batch, h, q] += 1
// Why two writers: in deterministic mode one step's hand-off is a serial chain
// (acquire spin, add, completion wait, release) about as long as a whole MMA
// step; with a single writer that chain, not the tensor cores, set the pace.
// Two writers overlap the chains of consecutive steps. A writer's release
// still waits only for its own add, so the ordering argument
// (bwd_semaphore.h) is unchanged and no new wait is introduced.
// Non-deterministic mode runs the same code without the semaphore wait and
// release: the adds of different CTAs then land in any order.
//
// Where the halves live (Traits::kStagesDq, kDqSharedHalf):
//   two buffers (d <= 128): set b's steps use buffer b; a half read at step s
//       is written next at step s + 2: dq_empty(b, w).
//   one buffer (d = 192): every step uses it; part w is written next at step
//       s + 1: dq_empty(1 - b, w).
//   one shared half (d = 256): the four quarters of a step pass through its
//       two quarter-tile slots in order (warpgroup 0's halves, then warpgroup
//       1's): after a quarter in slot k has been read, dq_empty(w, k) of the
//       warpgroup w whose quarter goes there next. Each of these barriers
//       alternates one arrival and one wait: the next arrival on it needs the
//       quarter its waiter stores next (so that wait has passed), and
//       warpgroup 0 stores a step's quarters only after both warpgroups met at
//       kDsReady, past warpgroup 1's stores of the step before.
#pragma once

#include <cute/tensor.hpp>

#include "common/named_barriers.h"
#include "kernels/bwd/bwd_mainloop.h"
#include "kernels/bwd/bwd_semaphore.h"
#include "kernels/bwd/bwd_tasks.h"
#include "kernels/bwd/bwd_trace.h"
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

  static constexpr int kParts = Traits::kDqHandoffParts;

  // The dq_empty barrier to arrive on once part wg of a step of set `set` has
  // been read (not for a shared half: its slots have one barrier each).
  CUTE_DEVICE static BwdBarrier next_writer_of(int set, int wg) {
    if constexpr (Traits::kStagesDq == 1) {
      return Mainloop::dq_empty(1 - set, wg);
    } else {
      return Mainloop::dq_empty(set, wg);
    }
  }

  // A shared half: the dq_empty barrier to arrive on once quarter i of a step
  // has been read: that of the warpgroup whose quarter takes its slot next
  // (warpgroup 1's of this step, or warpgroup 0's of the next).
  CUTE_DEVICE static BwdBarrier next_in_slot(int i) {
    return Mainloop::dq_empty(i < Traits::kDqSlots ? 1 : 0, i % Traits::kDqSlots);
  }

  // Run by all 32 lanes of writer warp `writer` (its hand-off set); lane 0 issues and waits.
  CUTE_DEVICE static void run(Params const& p, SharedStorage& smem, int writer) {
    static_assert(Traits::kDqWriters == 2 && (Traits::kStagesDq == 1 || Traits::kStagesDq == 2));
    bool const leader = (threadIdx.x % 32) == 0;
    float const* sdq = smem.dq.data() + Traits::sdq_buffer(writer) * Traits::kDqBufferFloats;

    // Every region starts out empty: its first writer (step 0 or, with two
    // buffers, step 1; with a shared half warpgroup 0, once per slot) may fill it.
    if (Traits::kStagesDq == 2 || writer == 0) {
      CUTE_UNROLL
      for (int part = 0; part < kParts; ++part) {
        named_barrier_arrive(Mainloop::dq_empty(writer, part), Traits::kDqHandoffThreads);
      }
    }
    // Index of the next step among all steps of this CTA; the MMA warpgroups
    // hand off step i in set i % kDqWriters.
    int cta_step = 0;

    TaskCursor cursor = TaskCursor::of(p.cta_offsets, p.task_counter);
    for (int task; (task = cursor.next(smem.task_ring)) >= 0;) {
      int32_t const* row = schedule::task_row(p.tasks, task);
      int const n_steps = row[schedule::kCNSteps];
      if (n_steps <= 0) { continue; }
      int const b = row[schedule::kCBatch];
      int const h = row[schedule::kCHead];
      // The task's problem: its ranks follow its own tiles.
      TileGeometry const geo = Traits::tile_geometry(p, Traits::seqlens(p, b));
      // Tile q of this (batch, head): rows [q kBlockM, (q + 1) kBlockM) from its first, contiguous.
      // The next head's rows follow seqlen_q_rounded rows on (Traits::stat_row), so a grouped
      // row's tile (j, q) (schedule::GroupTile) starts j * seqlen_q_rounded + q * kBlockM rows
      // from the row's head's first.
      int64_t const stat_row = Traits::stat_row(p, b, h);
      int64_t const split = row[schedule::kCSplit];
      float* dq_bh = p.dq_accum + split * p.dq_split_floats + stat_row * kHeadDim;
      int* sem_bh = p.dq_semaphore + split * p.dq_split_sems + stat_row / kBlockM;

      // First step of this task that falls on this writer.
      int const first = (writer - cta_step % Traits::kDqWriters + Traits::kDqWriters) % Traits::kDqWriters;
      cta_step += n_steps;
      schedule::StepOrder const order = schedule::StepOrder::of(row);  // kFixedSteps only
      bool const deterministic = !Traits::kFixedSteps && p.deterministic;
      for (int s = first; s < n_steps; s += Traits::kDqWriters) {
        schedule::StepInfo const st = Traits::kFixedSteps ? schedule::StepInfo{order.q_tile(s), 0}
                                                          : schedule::decode_step(geo, p.rank, row, s);
        if (leader) {
          DASH_FA3_TRACE_STEP(p, row, s, tracing::kWriterWait, tracing::now_clock());
          DASH_FA3_TRACE_STEP(p, row, s, tracing::kWriterWaitNs, tracing::now_ns());
        }
        // Computed per step from the parameters, not kept: these warps run in 24 registers.
        schedule::GroupTile const gt = schedule::group_tile(st.q_tile, p.rank.group_log2);
        int const tile = int(unsigned(gt.head * p.seqlen_q_rounded + gt.q * kBlockM) / kBlockM);
        if (leader && deterministic) {
          // Our turn: every contribution of lower rank has completed its add.
          semaphore_wait_for(sem_bh + tile, st.rank);
          fence_proxy_async_global();
          DASH_FA3_TRACE_STEP(p, row, s, tracing::kWriterAcquired, tracing::now_clock());
          DASH_FA3_TRACE_STEP(p, row, s, tracing::kWriterAcquiredNs, tracing::now_ns());
        }
        float* dq_tile = dq_bh + int64_t(tile) * Traits::kDqTileFloats;
        // The tile's first contribution stores: the accumulator is not zeroed (bwd_semaphore.h).
        bool const store = deterministic && st.rank == 0;
        if constexpr (Traits::kDqSharedHalf) {
          // Quarter i of the tile (warpgroup i / 2's half i % 2) passes through
          // slot i % 2; a slot's quarter is released once read, one quarter
          // later, so the next quarter's reduce is issued first.
          constexpr int kQuarters = Traits::kNumMmaWarpgroups * Traits::kDqSlots;
          cute::for_each(cute::make_int_sequence<kQuarters>{}, [&](auto i) {
            constexpr int kSlot = decltype(i)::value % Traits::kDqSlots;
            // Wait until quarter i of this step's partial dQ is in its slot.
            named_barrier_sync(Mainloop::dq_full(writer, kSlot), Traits::kDqHandoffThreads);
            if (leader) {
              bulk_store_or_add_f32(store, dq_tile + decltype(i)::value * Traits::kDqSlotFloats,
                                    sdq + kSlot * Traits::kDqSlotFloats, Traits::kDqSlotBytes,
                                    uint64_t(TMA::CacheHintSm90::EVICT_LAST));
              tma_store_arrive();
            }
            if constexpr (decltype(i)::value > 0) {
              if (leader) { bulk_wait_read<1>(); }
              __syncwarp();
              // Quarter i - 1 has been read: the one after it in its slot may fill it.
              named_barrier_arrive(next_in_slot(decltype(i)::value - 1), Traits::kDqHandoffThreads);
            }
          });
          if (leader) { bulk_wait_read<0>(); }
          __syncwarp();
          // The last quarter has been read.
          named_barrier_arrive(next_in_slot(kQuarters - 1), Traits::kDqHandoffThreads);
        } else {
          CUTE_UNROLL
          for (int wg = 0; wg < kParts; ++wg) {
            // Wait until part wg of this step's partial dQ is written.
            named_barrier_sync(Mainloop::dq_full(writer, wg), Traits::kDqHandoffThreads);
            if (leader) {
              // A Q tile's accumulator receives an add from every KV tile of its
              // head, spread over the kernel: keep it in L2 between them.
              bulk_store_or_add_f32(store, dq_tile + wg * Traits::kDqPartFloats, sdq + wg * Traits::kDqPartFloats,
                                    Traits::kDqPartBytes, uint64_t(TMA::CacheHintSm90::EVICT_LAST));
              tma_store_arrive();
            }
          }
          if (leader) { DASH_FA3_TRACE_STEP(p, row, s, tracing::kWriterIssued, tracing::now_clock()); }
          // One bulk group per part, committed in order: part wg has been
          // read once at most (kParts - 1 - wg) groups are pending.
          cute::for_each(cute::make_int_sequence<kParts>{}, [&](auto wg) {
            if (leader) { bulk_wait_read<kParts - 1 - decltype(wg)::value>(); }
            __syncwarp();
            // Part wg has been read: its next writer may overwrite it.
            named_barrier_arrive(next_writer_of(writer, decltype(wg)::value), Traits::kDqHandoffThreads);
          });
          if (leader) { DASH_FA3_TRACE_STEP(p, row, s, tracing::kWriterRead, tracing::now_clock()); }
        }
        if (leader && deterministic) {
          bulk_wait_all_complete();  // both adds have landed in global memory
          fence_proxy_async_global();
          semaphore_release_increment(sem_bh + tile);  // hand the turn to rank + 1
          DASH_FA3_TRACE_STEP(p, row, s, tracing::kWriterReleased, tracing::now_clock());
          DASH_FA3_TRACE_STEP(p, row, s, tracing::kWriterReleasedNs, tracing::now_ns());
        }
      }
    }
    if (leader) { bulk_wait_all_complete(); }
  }
};

}  // namespace dash_fa3::bwd
