// dQ-writer role of the backward kernel: one warp (warp 1 of warpgroup 0)
// moves each step's fp32 partial dQ from sdQ into the fp32 dQ accumulator
// (batch, heads, seqlen_q_rounded, d) with one TMA reduce-add
// (cp.reduce.async.bulk.tensor ... .add, f32 elements).
//
// Per step, in the schedule's order:
//   wait kDqFull+b (the MMA warpgroups wrote sdQ buffer b = step % 2)
//   deterministic: wait until sem[b, h, q] == rank (the schedule's rank of this
//                  (KV tile, Q tile) contribution)
//   issue the reduce-add, commit
//   wait until sdQ[b] has been READ -> arrive kDqEmpty+b (the MMA warpgroups
//                  may write buffer b again while the add is still landing)
//   deterministic: wait until the add has COMPLETED, then sem[b, h, q] += 1
// The ordering argument is in bwd_semaphore.h. Non-deterministic mode runs the
// same code without the semaphore wait and release: the adds of different
// CTAs then land in any order.
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
  static constexpr int kDqHandoffThreads = Traits::kNumMmaThreads + Traits::kWarpThreads;

  // Run by all 32 lanes of the writer warp; lane 0 issues and waits.
  CUTE_DEVICE static void run(Params const& p, SharedStorage& smem) {
    bool const leader = (threadIdx.x % 32) == 0;
    Tensor sDq = make_tensor(make_smem_ptr(smem.dq.data()), typename Traits::SmemLayoutDq{});
    auto tma_dq = p.tma_dq.get_slice(_0{});
    Tensor tDqsDq = tma_dq.partition_S(sDq);
    int32_t const* header = p.schedule;

    // Both sdQ buffers start out empty.
    for (int b = 0; b < Traits::kStagesDq; ++b) { named_barrier_arrive(Mainloop::dq_empty(b), kDqHandoffThreads); }
    int dq_stage = 0;

    CtaTasks const tasks = CtaTasks::of(p.schedule);
    for (int task = tasks.begin; task < tasks.end; ++task) {
      int32_t const* row = schedule::task_row(p.schedule, task);
      int const n_steps = row[schedule::kCNSteps];
      if (n_steps <= 0) { continue; }
      int const b = row[schedule::kCBatch];
      int const h = row[schedule::kCHead];
      Tensor gDq = local_tile(p.tma_dq.get_tma_tensor(p.shape_dq)(_, _, h, b),
                              Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (M, D, m)
      Tensor tDqgDq = tma_dq.partition_D(gDq);
      int* sem_bh = p.dq_semaphore + (int64_t(b) * p.heads + h) * p.n_q;

      for (int s = 0; s < n_steps; ++s) {
        schedule::StepInfo const st = schedule::decode_step(header, row, s);
        // Wait until the MMA warpgroups have written this step's partial dQ to sdQ[dq_stage].
        named_barrier_sync(Mainloop::dq_full(dq_stage), kDqHandoffThreads);
        if (leader) {
          if (p.deterministic) {
            // Our turn: every contribution of lower rank has completed its add.
            semaphore_wait_for(sem_bh + st.q_tile, st.rank);
            fence_proxy_async_global();
          }
          copy(p.tma_dq, tDqsDq(_, _, _, dq_stage), tDqgDq(_, _, _, st.q_tile));
          tma_store_arrive();
          bulk_wait_all_read();
        }
        __syncwarp();
        // sdQ[dq_stage] has been read: the MMA warpgroups may overwrite it.
        named_barrier_arrive(Mainloop::dq_empty(dq_stage), kDqHandoffThreads);
        dq_stage ^= 1;
        if (leader && p.deterministic) {
          bulk_wait_all_complete();  // the add itself has landed in global memory
          fence_proxy_async_global();
          semaphore_release_increment(sem_bh + st.q_tile);  // hand the turn to rank + 1
        }
      }
    }
    if (leader) { bulk_wait_all_complete(); }
  }
};

}  // namespace dash_fa3::bwd
