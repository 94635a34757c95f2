// The backward main kernel: sets up barriers and pipelines, then dispatches
// warp roles. All work lives in the role files:
//   bwd_producer.h   TMA loads of K, V per task; Q+LSE, dO+dPsum per step   (warpgroup 0, warp 0)
//   bwd_dq_writer.h  partial dQ -> dQ accumulator, bulk reduce-add, ordered (warpgroup 0, warps 1-2)
//   bwd_mainloop.h   S, P, dP, dS, dV, dK, partial dQ with WGMMA           (warpgroups 1-2; 1-3 at hdim 192)
//   bwd_epilogue.h   dK, dV stores (GQA: fp32 per-q-head partials)         (the MMA warpgroups)
//   bwd_tasks.h      which schedule rows a CTA runs, static or claimed     (all roles)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "kernels/bwd/bwd_dq_writer.h"
#include "kernels/bwd/bwd_epilogue.h"
#include "kernels/bwd/bwd_mainloop.h"
#include "kernels/bwd/bwd_producer.h"
#include "kernels/bwd/bwd_tasks.h"
#include "kernels/bwd/bwd_trace.h"
#include "kernels/bwd/bwd_traits.h"

namespace dash_fa3::bwd {

// The Q and dO pipelines' parameters: the producer warpgroup fills each stage
// (Q or dO, tile_bytes, and its row statistic), every MMA thread releases it.
template <class Traits, class Pipeline>
CUTE_DEVICE typename Pipeline::Params pipeline_params(int warpgroup, uint32_t tile_bytes) {
  typename Pipeline::Params params;
  params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = Traits::kNumMmaThreads;
  params.transaction_bytes = tile_bytes + Traits::kRowStatBytes;
  return params;
}

// Where the MMA warps keep a task's dK/dV accumulators. With chains (Traits::kChains) in the
// task loop's scope: a chain's rows (schedule columns chain_before/after) sum theirs there from
// one row to the next. Without, in each task's own scope, so that nothing of them is live
// between tasks (bwd_traits.h says why the three-warpgroup kernel needs that).
template <class Mainloop, bool kChains>
struct TaskDkv {
  typename Mainloop::FragDk dk;
  typename Mainloop::FragDv dv;
  // Runs one task, f(dK, dV).
  template <class F>
  CUTE_DEVICE void run(F&& f) { f(dk, dv); }
};
template <class Mainloop>
struct TaskDkv<Mainloop, false> {
  template <class F>
  CUTE_DEVICE void run(F&& f) {
    typename Mainloop::FragDk dk;
    typename Mainloop::FragDv dv;
    f(dk, dv);
  }
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
bwd_kernel(CUTE_GRID_CONSTANT typename Traits::Params const p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineDo = typename Traits::PipelineDo;
  extern __shared__ char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  int const warp_idx = cutlass::canonical_warp_idx_sync();
  int const warpgroup = cutlass::canonical_warp_group_idx();
  WarpRole const role = warpgroup > 0 ? WarpRole::kMma
                        : warp_idx == 0 ? WarpRole::kProducer
                        : warp_idx <= Traits::kDqWriters ? WarpRole::kDqWriter
                                                        : WarpRole::kIdle;

  if (warp_idx == 0 && cute::elect_one_sync()) {
    BwdProducer<Traits>::prefetch_descriptors(p);
    smem.k_full.init(1);  // one arrival each: the producer's expect-tx
    smem.v_full.init(1);
    // The task ring's consumers are the dQ writers.
    TaskCursor::init(smem.task_ring, Traits::kDqWriters);
  }

  // Warp 0 initialises the stage barriers (and fences the inits).
  PipelineQ pipeline_q(smem.pipeline_q, pipeline_params<Traits, PipelineQ>(warpgroup, Traits::kTmaBytesQ),
                       Shape<_1, _1, _1>{});
  PipelineDo pipeline_do(smem.pipeline_do, pipeline_params<Traits, PipelineDo>(warpgroup, Traits::kTmaBytesDo),
                         Shape<_1, _1, _1>{});
  // Barrier inits must be visible to every thread before anyone waits.
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (role == WarpRole::kProducer) {
      BwdProducer<Traits>::run(p, smem, pipeline_q, pipeline_do);
    } else if (role == WarpRole::kDqWriter) {
      BwdDqWriter<Traits>::run(p, smem, /*writer=*/warp_idx - 1);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegisters>();
    using Mainloop = BwdMainloop<Traits>;
    int const mma_tid = threadIdx.x - Traits::kThreadsPerWarpgroup;
    Mainloop::release_kv();  // sK/sV start out free
    typename Traits::PipelineStateQ read_q;
    typename Traits::PipelineStateDo read_do;
    int kv_phase = 0;
    int ds_stage = 0;
    int dq_stage = 0;
    TaskDkv<Mainloop, Traits::kChains> task_dkv;
    CUTE_NO_UNROLL
    for (;;) {
      // The producer has announced this CTA's next task and, if it has steps,
      // its K has landed (bwd_tasks.h: the MMA warps learn their tasks here,
      // not from the ring, which cost them registers they do not have).
      smem.k_full.wait(kv_phase);
      int const task = smem.task_ring.announced;
      if (task < 0) { break; }
      int32_t const* row = schedule::task_row(p.tasks, task);
      int const n_steps = row[schedule::kCNSteps];
      // The task, with its dK/dV where TaskDkv keeps them (a return ends the task).
      task_dkv.run([&](auto& tdKrdK, auto& tdVrdV) {
        if (!Traits::continues_chain(row)) {
          clear(tdKrdK);
          clear(tdVrdV);
        }
        if (n_steps == 0) {  // never in a chain (dash_fa3/schedule/validate.py)
          // Nothing loaded. Wait for the producer's v_full arrival for this task:
          // it comes after the producer's kVEmpty sync for it, which this
          // task's kVEmpty arrival below must not overtake (a named barrier
          // would count two tasks' arrivals as one completion).
          smem.v_full.wait(kv_phase);
          kv_phase ^= 1;
          // The announcement is read: the producer may announce the next task.
          Mainloop::release_kv();
          BwdEpilogue<Traits>::store_direct(p, tdKrdK, tdVrdV, row, mma_tid);
          return;
        }
        // The task's V has landed. (Waiting for V inside the first step, after
        // its S^T was issued, made ptxas spill in the hdim-64 window kernel.)
        smem.v_full.wait(kv_phase);
        kv_phase ^= 1;
        if (mma_tid == 0) {
          DASH_FA3_TRACE_TASK(p, row, tracing::kTaskCta, blockIdx.x);
          DASH_FA3_TRACE_TASK(p, row, tracing::kTaskSm, tracing::sm_id());
          DASH_FA3_TRACE_TASK(p, row, tracing::kTaskBegin, tracing::now_clock());
          DASH_FA3_TRACE_TASK(p, row, tracing::kTaskBeginNs, tracing::now_ns());
        }
        Mainloop::run_task(p, smem, pipeline_q, pipeline_do, read_q, read_do, ds_stage, dq_stage, row, n_steps,
                           mma_tid, tdKrdK, tdVrdV);
        if (mma_tid == 0) { DASH_FA3_TRACE_TASK(p, row, tracing::kTaskEpilogue, tracing::now_clock()); }
        if (Traits::chain_goes_on(row)) {
          // The chain goes on with the next row, same K and V: the producer loads none for it,
          // so releasing sK/sV only lets it announce that row.
          Mainloop::release_kv();
        } else if (p.dk_partial == nullptr && !BwdEpilogue<Traits>::needs_direct_store(p, row)) {
          // MHA, or a whole group's chain: dK/dV leave through sK/sV, which are released to the
          // producer afterwards.
          BwdEpilogue<Traits>::store_tma(p, smem, tdKrdK, tdVrdV, row, mma_tid);
        } else {
          // Every GEMM of the task has retired: sK and sV are free for the next task.
          Mainloop::release_kv();
          BwdEpilogue<Traits>::store_direct(p, tdKrdK, tdVrdV, row, mma_tid);
        }
        if (mma_tid == 0) {
          DASH_FA3_TRACE_TASK(p, row, tracing::kTaskEnd, tracing::now_clock());
          DASH_FA3_TRACE_TASK(p, row, tracing::kTaskEndNs, tracing::now_ns());
        }
      });
    }
  }
#endif
}

}  // namespace dash_fa3::bwd
