// Producer role of the backward kernel: one warp issues every TMA load.
//
// Per task (one KV tile of one (batch, q head)), in the order its CTA takes
// them (bwd_tasks.h): the task's index into task_ring.announced, then K and V
// once, onto the k_full and v_full transaction barriers (the MMA warpgroups
// learn their next task from k_full), each after the MMA warpgroups have
// released the previous task's tile in that buffer (kKEmpty, kVEmpty; where
// the epilogue stages dK/dV in sdS that is when the task's GEMMs retire, else
// when the epilogue's TMA store has read the buffer). Then, per step, in the schedule's Q-tile
// order: Q + its LSE rows into the Q pipeline, dO + its dPsum rows into the
// dO pipeline (kStagesQ / kStagesDo deep), so the loads of the next steps run
// under the current step's GEMMs where shared memory leaves room for a second
// stage.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/named_barriers.h"
#include "common/problem_view.h"
#include "kernels/bwd/bwd_tasks.h"
#include "kernels/bwd/bwd_trace.h"
#include "kernels/bwd/bwd_traits.h"
#include "schedules/schedule_metadata.h"

namespace dash_fa3::bwd {

template <class Traits>
struct BwdProducer {
  using Params = typename Traits::Params;
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineDo = typename Traits::PipelineDo;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  // Steps of a task whose Q and dO can be loaded before its K and V: one per
  // stage of the shallower of the two pipelines.
  static constexpr int kPreloadSteps = Traits::kStagesQ < Traits::kStagesDo ? Traits::kStagesQ : Traits::kStagesDo;

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_dk.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_dv.get_tma_descriptor());
  }

  // L2 prefetch of K and V of the CTA's next task with steps, if any: its
  // load waits for the end of this task (and, where dK/dV are staged in sK/sV,
  // for its epilogue), so the load should find them in L2 rather than in DRAM.
  CUTE_DEVICE static void prefetch_next_kv(Params const& p, int task, int end) {
    for (int next = task + 1; next < end; ++next) {
      int32_t const* row = schedule::task_row(p.tasks, next);
      if (row[schedule::kCNSteps] <= 0 || Traits::continues_chain(row)) { continue; }
      SeqlenInfo const sl = Traits::seqlens(p, row[schedule::kCBatch]);
      int const h_kv = row[schedule::kCHeadKv];
      int const kv = row[schedule::kCKvTile];
      Tensor gK = Traits::template kv_tile<false>(p.tma_k, p, sl, h_kv, kv);
      Tensor gV = Traits::template kv_tile<true>(p.tma_v, p, sl, h_kv, kv);
      cute::prefetch(p.tma_k, p.tma_k.get_slice(_0{}).partition_S(gK));
      cute::prefetch(p.tma_v, p.tma_v.get_slice(_0{}).partition_S(gV));
      return;
    }
  }

  // Run by all 32 lanes of the producer warp; lane 0 issues the copies and the
  // expect-tx arrivals (it is the pipelines' leader thread).
  CUTE_DEVICE static void run(Params const& p, SharedStorage& smem, PipelineQ& pipeline_q,
                              PipelineDo& pipeline_do) {
    bool const leader = (threadIdx.x % 32) == 0;
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutDo{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    auto tma_q = p.tma_q.get_slice(_0{});
    auto tma_do = p.tma_do.get_slice(_0{});
    auto tma_k = p.tma_k.get_slice(_0{});
    auto tma_v = p.tma_v.get_slice(_0{});
    Tensor tQsQ = tma_q.partition_D(sQ);     // (TMA, TMA_M, TMA_D, stage)
    Tensor tdOsdO = tma_do.partition_D(sdO);
    Tensor tKsK = tma_k.partition_D(sK);     // (TMA, TMA_N, TMA_D)
    Tensor tVsV = tma_v.partition_D(sV);

    auto write_q = cutlass::make_producer_start_state<PipelineQ>();
    auto write_do = cutlass::make_producer_start_state<PipelineDo>();
    uint64_t& k_full = reinterpret_cast<uint64_t&>(smem.k_full);
    uint64_t& v_full = reinterpret_cast<uint64_t&>(smem.v_full);

    TaskCursor cursor = TaskCursor::of(p.cta_offsets, p.task_counter);
    for (int task; (task = cursor.claim(smem.task_ring, p.task_counter, p.num_tasks)) >= 0;) {
      int32_t const* row = schedule::task_row(p.tasks, task);
      int const n_steps = row[schedule::kCNSteps];
      // A task without steps (the MMA warpgroups write dK = dV = 0) takes the
      // same path with nothing loaded: k_full and v_full still complete one
      // phase for it (no bytes expected), and the MMA warps wait on v_full
      // before their kVEmpty arrival for it, so that arrival cannot reach the
      // named barrier before this warp's sync for it below.
      // A row that continues a chain (schedule column chain_before) keeps the K and V of the
      // row before it, which are still in sK/sV: the MMA warpgroups do not write them, and only
      // this warp loads into them.
      bool const loads = n_steps > 0 && !Traits::continues_chain(row);
      int const b = row[schedule::kCBatch];
      int const h = row[schedule::kCHead];
      int const h_kv = row[schedule::kCHeadKv];
      int const kv = row[schedule::kCKvTile];
      SeqlenInfo const sl = Traits::seqlens(p, b);

      // A packed document's Q tiles start at its first row; its last tile
      // also reads the next document's rows, whose statistics rows are
      // padding (common/seqlen_info.h).
      auto q_rows = [&](auto const& tma, auto const& shape, int head) {
        return rows_from<Traits::kPacked>(tma.get_tma_tensor(shape)(_, _, head, sl.tensor_batch), sl.offset_q);
      };
      // The Q tiles (TMA, TMA_M, TMA_D, m) of query head `head`: the row's, or in a grouped
      // row the step's (schedule::GroupTile).
      auto q_tiles = [&](int head) {
        return tma_q.partition_S(local_tile(q_rows(p.tma_q, p.shape_q, head), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                                            make_coord(_, _0{})));
      };
      auto do_tiles = [&](int head) {
        return tma_do.partition_S(local_tile(q_rows(p.tma_do, Traits::shape_do(p), head),
                                             Shape<Int<kBlockM>, Int<Traits::kHeadDimV>>{}, make_coord(_, _0{})));
      };
      Tensor gK = Traits::template kv_tile<false>(p.tma_k, p, sl, h_kv, kv);
      Tensor gV = Traits::template kv_tile<true>(p.tma_v, p, sl, h_kv, kv);
      Tensor tKgK = tma_k.partition_S(gK);
      Tensor tVgV = tma_v.partition_S(gV);

      // Loads Q tile q's rows of one Q-shaped tensor (Q or dO) of query head `head` and its
      // per-row statistic (LSE or dPsum) into the next stage of `pipeline`. Q and dO
      // of one tile are read by every KV tile of the head: keep them in L2.
      auto load_stage = [&](auto& pipeline, auto& write, auto const& tma, auto const& tXgX,
                            auto& tXsX, float const* stat, auto& smem_stat, int head, int q) {
        pipeline.producer_acquire(write);
        if (leader) {
          uint64_t* bar = pipeline.producer_get_barrier(write);
          copy(tma.with(*bar, 0, TMA::CacheHintSm90::EVICT_LAST), tXgX(_, _, _, q), tXsX(_, _, _, write.index()));
          SM90_BULK_COPY_G2S::copy(stat + Traits::stat_row(p, b, head) + q * kBlockM, bar, smem_stat[write.index()],
                                   Traits::kRowStatBytes);
        }
        ++write;
      };
      // The task's Q-tile order, read from the row once.
      schedule::StepOrder const order = schedule::StepOrder::of(row);
      auto load_step = [&](int s) {
        schedule::GroupTile const t = schedule::group_tile(order.q_tile(s), p.rank.group_log2);
        int const head = h + t.head;
        int const q = t.q;
        if constexpr (Traits::kStagesDo >= Traits::kStagesQ) {
          // dO first: the MMA warpgroups free a dO stage in the middle of a step
          // (when dV retires) and a Q stage only at its end, so loading dO first
          // lets it start half a step earlier instead of queueing behind Q.
          load_stage(pipeline_do, write_do, p.tma_do, do_tiles(head), tdOsdO, p.dpsum, smem.dpsum, head, q);
          load_stage(pipeline_q, write_q, p.tma_q, q_tiles(head), tQsQ, p.lse_log2, smem.lse, head, q);
        } else {
          // Fewer dO stages than Q stages (d = 192: one): Q first. Its stage
          // for step s is free a step ahead (step s - 2 has ended), while dO's
          // waits for step s - 1's dV; behind that wait, Q's load comes late
          // and the MMA warps stall on it (measured:
          // docs/journal/code-comments.md).
          load_stage(pipeline_q, write_q, p.tma_q, q_tiles(head), tQsQ, p.lse_log2, smem.lse, head, q);
          load_stage(pipeline_do, write_do, p.tma_do, do_tiles(head), tdOsdO, p.dpsum, smem.dpsum, head, q);
        }
      };
      // The first steps' Q and dO go out before the wait for sK/sV: their
      // stages are free once the previous task's steps are done, so these
      // loads overlap the previous task's epilogue instead of queueing behind it.
      int const preload = n_steps < kPreloadSteps ? n_steps : kPreloadSteps;
      for (int s = 0; s < preload; ++s) { load_step(s); }
      // Wait until both MMA warpgroups are done with the previous task's K
      // (they arrive once at start-up too), then load this task's; the same for V.
      named_barrier_sync(BwdBarrier::kKEmpty, Traits::kNumMmaThreads + Traits::kWarpThreads);
      if (leader) {
        // The announcement of this task and its K land on k_full together.
        smem.task_ring.announced = task;
        smem.k_full.arrive_and_expect_tx(loads ? Traits::kTmaBytesK : 0u);
        if (loads) { copy(p.tma_k.with(k_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tKgK, tKsK); }
        DASH_FA3_TRACE_TASK(p, row, tracing::kTaskKIssued, tracing::now_clock());
      }
      named_barrier_sync(BwdBarrier::kVEmpty, Traits::kNumMmaThreads + Traits::kWarpThreads);
      if (leader) {
        smem.v_full.arrive_and_expect_tx(loads ? Traits::kTmaBytesV : 0u);
        if (loads) { copy(p.tma_v.with(v_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tVgV, tVsV); }
        DASH_FA3_TRACE_TASK(p, row, tracing::kTaskVIssued, tracing::now_clock());
        // Static dispatch knows this CTA's next task (dynamic: not yet claimed).
        if (!cursor.dynamic()) { prefetch_next_kv(p, task, cursor.end); }
      }
      for (int s = preload; s < n_steps; ++s) { load_step(s); }
    }
    // No more tasks: tell the MMA warpgroups, once they have read the last announcement.
    named_barrier_sync(BwdBarrier::kKEmpty, Traits::kNumMmaThreads + Traits::kWarpThreads);
    if (leader) { announce(smem, -1); }
  }

  // Announces task (-1: none left) to the MMA warpgroups on k_full without loading K
  // (lane 0; the arrive releases the store).
  CUTE_DEVICE static void announce(SharedStorage& smem, int task) {
    smem.task_ring.announced = task;
    smem.k_full.arrive();
  }
};

}  // namespace dash_fa3::bwd
