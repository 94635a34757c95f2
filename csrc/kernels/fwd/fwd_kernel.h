// The forward kernel: sets up barriers and pipelines, then dispatches warp
// roles. All work lives in the role files:
//   fwd_producer.h        TMA loads of Q, K, V      (warpgroup 0, warp 0)
//   fwd_mainloop.h        WGMMA + online softmax    (warpgroups 1 and 2)
//   fwd_epilogue.h        O and LSE stores          (the MMA warpgroups)
//   fwd_tile_scheduler.h  which tiles a CTA visits  (all roles)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "kernels/fwd/fwd_epilogue.h"
#include "kernels/fwd/fwd_mainloop.h"
#include "kernels/fwd/fwd_producer.h"
#include "kernels/fwd/fwd_tile_scheduler.h"
#include "kernels/fwd/fwd_traits.h"

namespace dash_fa3::fwd {

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
fwd_kernel(CUTE_GRID_CONSTANT typename Traits::Params const p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineKV = typename Traits::PipelineKV;
  extern __shared__ char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  int const warp_idx = cutlass::canonical_warp_idx_sync();
  WarpRole const role = cutlass::canonical_warp_group_idx() == 0 ? WarpRole::kProducer : WarpRole::kMma;

  if (warp_idx == 0 && cute::elect_one_sync()) { FwdProducer<Traits>::prefetch_descriptors(p); }

  typename PipelineKV::Params pipe_params;
  pipe_params.role = role == WarpRole::kProducer ? PipelineKV::ThreadCategory::Producer
                                                 : PipelineKV::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kNumMmaThreads;  // every MMA thread releases each stage
  pipe_params.transaction_bytes = Traits::kTmaBytesK;
  // Warp 0 initialises the stage barriers (and fences the inits).
  PipelineKV pipeline_k(smem.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
  // V's tiles are narrower than K's where kHeadDimV < kHeadDim (MLA).
  typename PipelineKV::Params v_params = pipe_params;
  v_params.transaction_bytes = Traits::kTmaBytesV;
  PipelineKV pipeline_v(smem.pipeline_v, v_params, Shape<_1, _1, _1>{});
  typename PipelineQ::Params q_params;
  q_params.role = pipe_params.role == PipelineKV::ThreadCategory::Producer
                      ? PipelineQ::ThreadCategory::Producer
                      : PipelineQ::ThreadCategory::Consumer;
  q_params.is_leader = pipe_params.is_leader;
  // kQPerWarpgroup: a stage's rows belong to one warpgroup.
  q_params.num_consumers = Traits::kNumMmaThreads / Traits::kQLoadsPerTile;
  q_params.transaction_bytes = Traits::kTmaBytesQ;
  PipelineQ pipeline_q(smem.pipeline_q, q_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    FwdTileScheduler<Traits>::init_handoff(smem);
    if constexpr (Traits::kOutputInV) {
      cutlass::arch::ClusterBarrier::init(&smem.o_read, Traits::kNumMmaWarpgroups);
      cutlass::arch::fence_barrier_init();
    }
  }
  // Barrier inits must be visible to every thread before anyone waits.
  __syncthreads();

  if (role == WarpRole::kProducer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (warp_idx == 0) { FwdProducer<Traits>::run(p, smem, pipeline_q, pipeline_k, pipeline_v); }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegisters>();
    using Mainloop = FwdMainloop<Traits>;
    using Epilogue = FwdEpilogue<Traits>;
    int const mma_tid = threadIdx.x - Traits::kThreadsPerWarpgroup;
    Mainloop::init(mma_tid);
    Epilogue::init(mma_tid);
    typename Traits::PipelineState read_state;
    // kQPerWarpgroup: warpgroup w reads stages w, w + W, ... (Mainloop::run).
    typename Traits::PipelineStateQ q_state(Traits::kQPerWarpgroup ? Mainloop::warpgroup(mma_tid) : 0, 0, 0);
    using Scheduler = FwdTileScheduler<Traits>;
    int unit = 0;  // the current round's unit (Scheduler::tile_at)
    CUTE_NO_UNROLL
    for (int k = 0;; ++k) {
      FwdTile t;
      SeqlenInfo sl;
      BlockRange kv_blocks;
      typename Scheduler::Slot const slot = Scheduler::template tile_at<false>(p, smem, k, unit, t, sl, kv_blocks);
      if (slot == Scheduler::Slot::kDone) { break; }
      if (slot == Scheduler::Slot::kSkip) { continue; }
      if (kv_blocks.end <= kv_blocks.begin) {
        Epilogue::store_empty(p, t, sl, Epilogue::tile_thread_index(mma_tid));
        continue;
      }
      typename Mainloop::FragO tOrO;
      float lse[2];
      Mainloop::run(p, smem, pipeline_q, pipeline_k, pipeline_v, q_state, read_state, t.m_block,
                    sl.seqlen_q, sl.seqlen_k, kv_blocks, mma_tid, tOrO, lse);
      // The rows and the thread index again, rather than registers held
      // through the mainloop (Epilogue::tile_thread_index).
      Epilogue::store(p, smem, tOrO, lse, t, Traits::seqlens(p, t.batch), Epilogue::tile_thread_index(mma_tid));
    }
    Epilogue::finish(mma_tid);
  }
#endif
}

}  // namespace dash_fa3::fwd
