// MMA (consumer) role of the forward kernel: per tile, S = Q K^T with WGMMA
// from shared memory, fp32 online softmax, and O += P V with P from registers.
//
// Each MMA warpgroup (two, or three at hdim 64) owns 64 rows of the query tile
// and walks the same key blocks, from the last block down.
//
// Intra-warpgroup overlap: in step n the warpgroup issues S_n = Q K[n]^T and
// then O += P_{n+1} V[n+1] back to back without waiting, waits for S_n only,
// and runs the softmax of S_n while the PV GEMM still runs on the tensor
// cores. O is rescaled after the PV GEMM has retired. In the SASS (CUDA 13.0)
// only the row max of S_n sits between the two waits: ptxas moves the exp2s
// after the PV wait, as P_n overwrites the registers that PV GEMM reads. A
// second P fragment moves them before it, but is slower (hdim 128 causal) and
// does not fit next to kBlockN = 176 (measured: docs/journal/code-comments.md).
//
// Ping-pong: the warpgroups take turns, round robin, issuing their GEMMs of one
// step (kMmaTurn0..2), so the tensor cores run one warpgroup's GEMMs while the
// others do their softmax.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/gemm_sm90.h"
#include "common/mask.h"
#include "common/named_barriers.h"
#include "common/softcap.h"
#include "common/softmax.h"
#include "kernels/fwd/fwd_traits.h"

namespace dash_fa3::fwd {

template <class Traits>
struct FwdMainloop {
  using Element = typename Traits::Element;
  using Params = typename Traits::Params;
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineStateQ = typename Traits::PipelineStateQ;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = typename Traits::PipelineState;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  static constexpr bool kCausal = Traits::kCausal;
  static constexpr bool kLocal = Traits::kLocal;
  static constexpr bool kSoftcap = Traits::kSoftcap;
  // A turn barrier counts the warpgroup that waits and the one that passes.
  static constexpr int kTurnThreads = 2 * Traits::kThreadsPerWarpgroup;
  static constexpr int kWarpgroups = Traits::kNumMmaWarpgroups;

  // Output accumulator type of one thread: (kBlockM, kHeadDimV).
  using FragO = decltype(partition_fragment_C(typename Traits::TiledMmaPV{},
                                              Shape<Int<kBlockM>, Int<kHeadDimV>>{}));

  // mma_tid: thread index among the MMA threads, [0, 128 * kWarpgroups).
  CUTE_DEVICE static int warpgroup(int mma_tid) {
    return __shfl_sync(0xffffffff, mma_tid / Traits::kThreadsPerWarpgroup, 0);
  }

  // Called once by every MMA thread before the first tile.
  CUTE_DEVICE static void init(int mma_tid) {
    // kMmaTurn0: warpgroup 0 has the first turn; this arrival stands in for
    // the last warpgroup's "your turn" that warpgroup 0's first wait needs.
    if (warpgroup(mma_tid) == 0) { named_barrier_arrive(FwdBarrier::kMmaTurn0, kTurnThreads); }
  }

  CUTE_DEVICE static FwdBarrier turn_barrier(int wg) {
    return static_cast<FwdBarrier>(static_cast<int>(FwdBarrier::kMmaTurn0) + wg);
  }
  // Waits for this warpgroup's turn to issue GEMMs (kMmaTurn<w>: warpgroup w
  // waits, warpgroup w - 1 (round robin) arrives when it has issued its own).
  CUTE_DEVICE static void wait_turn(int wg) { named_barrier_sync(turn_barrier(wg), kTurnThreads); }
  // Hands the turn to the next warpgroup.
  CUTE_DEVICE static void pass_turn(int wg) {
    named_barrier_arrive(turn_barrier(wg + 1 == kWarpgroups ? 0 : wg + 1), kTurnThreads);
  }

  template <class Pipeline, class State>
  CUTE_DEVICE static void consumer_wait(Pipeline& pipeline, State const& state) {
    auto token = pipeline.consumer_try_wait(state);
    pipeline.consumer_wait(state, token);
  }

  // Computes the normalised O of one tile into tOrO and the LSE of this
  // thread's two rows into lse, over the key blocks kv_blocks (not empty;
  // common/block_range.h) of the tile's problem (seqlen_q x seqlen_k), last block first.
  CUTE_DEVICE static void run(Params const& p, SharedStorage& smem, PipelineQ& pipeline_q,
                              PipelineKV& pipeline_k, PipelineKV& pipeline_v, PipelineStateQ& q_state,
                              PipelineState& read_state, int m_block, int seqlen_q, int seqlen_k,
                              BlockRange kv_blocks, int mma_tid,
                              FragO& tOrO, float (&lse)[2]) {
    int const wg = warpgroup(mma_tid);
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});

    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(mma_tid);
    // The shared-memory operand descriptors depend only on the warpgroup:
    // slicing by a warp-uniform first thread (broadcast from lane 0) keeps
    // their arithmetic in uniform registers instead of per-thread registers
    // moved with R2UR in front of every WGMMA (as in bwd_mainloop.h).
    int const wg_first_tid =
        __shfl_sync(0xffffffff, mma_tid / Traits::kThreadsPerWarpgroup, 0) * Traits::kThreadsPerWarpgroup;
    auto wg_qk = mma_qk.get_slice(wg_first_tid);
    auto wg_pv = mma_pv.get_slice(wg_first_tid);
    // kQPerWarpgroup: stage index w of the Q pipeline is this warpgroup's rows of
    // SmemLayoutQ's single stage.
    Tensor tSrQ = wg_qk.partition_fragment_A(sQ)(_, _, _, Traits::q_smem_stage(q_state.index()));  // smem descriptors
    Tensor tSrK = wg_qk.partition_fragment_B(sK);    // (.., stage)
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);   // (.., stage)
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

    using FragS = decltype(partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{}));
    using LayoutP = decltype(accumulator_as_a_operand(typename FragS::layout_type{}));
    Tensor tOrP = make_tensor<Element>(LayoutP{});

    RowSoftmax softmax(p.score_scale_log2);
    float o_scale[2];
    int const row0 = m_block * kBlockM;
    // Softcap: every score becomes tanh(score * prescale) before the mask, which
    // writes -inf over it (common/softcap.h).
    auto cap = [&](auto& tSrS) {
      if constexpr (kSoftcap) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = tanh_approx(tSrS(i) * p.softcap_prescale); }
      }
    };
    auto mask = [&](auto& tSrS, int n) {
      if constexpr (kLocal) {
        apply_attention_mask<false, true>(tSrS, tScS, row0, n * kBlockN, seqlen_q, seqlen_k, p.window_left,
                                          p.window_right);
      } else {
        apply_attention_mask<kCausal>(tSrS, tScS, row0, n * kBlockN, seqlen_q, seqlen_k);
      }
    };

    // kQPerWarpgroup: this warpgroup's Q rows are released as soon as its S GEMM
    // of the tile's last key block (block kv_blocks.begin) has retired, so the
    // producer can load its rows of the next tile during the last softmax and
    // PV GEMM, a gain at 1k-2k keys and level from 4k (measured:
    // docs/journal/code-comments.md).
    auto release_q_after_last_s = [&](int n) {
      if constexpr (Traits::kQPerWarpgroup) {
        if (n == kv_blocks.begin) { pipeline_q.consumer_release(q_state); }
      }
    };

    // First block: S, mask (it may hold keys past seqlen_k and the diagonal;
    // with a window, also the left side), softmax. No PV GEMM to overlap with yet.
    int n = kv_blocks.end - 1;
    {
      FragS tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
      consumer_wait(pipeline_q, q_state);
      consumer_wait(pipeline_k, read_state);
      warpgroup_gemm<true, 0>(mma_qk, tSrQ, tSrK(_, _, _, uniform_stage(read_state)), tSrS);
      pipeline_k.consumer_release(read_state);
      release_q_after_last_s(n);
      cap(tSrS);
      mask(tSrS, n);
      softmax.template update<true, true>(tSrS, o_scale);
      convert_fragment(make_tensor(tSrS.data(), LayoutP{}), tOrP);
    }
    clear(tOrO);

    // One step: S_n = Q K[n]^T and O += P_{n+1} V[n+1] issued together, then
    // the softmax of S_n overlaps the PV GEMM.
    auto step = [&](int n, auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
      PipelineState const v_state = read_state;
      ++read_state;
      int const k_stage = uniform_stage(read_state);
      // v_state is the state one before read_state. Its stage from k_stage
      // rather than a second broadcast: that one made the three-warpgroup
      // kernels (160 registers) spill.
      int const v_stage = (k_stage == 0 ? Traits::kStages : k_stage) - 1;
      FragS tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
      consumer_wait(pipeline_k, read_state);
      // kMmaTurn<wg>: wait until the other warpgroup has issued its GEMMs.
      wait_turn(wg);
      warpgroup_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, k_stage), tSrS);
      consumer_wait(pipeline_v, v_state);
      warpgroup_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, v_stage), tOrO);
      // kMmaTurn<other>: our GEMMs are queued, the other warpgroup may issue.
      pass_turn(wg);
      warpgroup_wait<1>();  // S_n is ready; the PV GEMM may still run
      warpgroup_fence_operand(tSrS);
      pipeline_k.consumer_release(read_state);
      release_q_after_last_s(n);
      cap(tSrS);
      if constexpr (kMasked) { mask(tSrS, n); }
      softmax.template update<false, kMasked>(tSrS, o_scale);
      warpgroup_wait<0>();  // PV retired: tOrP may be overwritten, V released
      warpgroup_fence_operand(tOrO);
      pipeline_v.consumer_release(v_state);
      convert_fragment(make_tensor(tSrS.data(), LayoutP{}), tOrP);
      scale_rows(tOrO, o_scale);
    };

    --n;
    if constexpr (kCausal) {
      int const unmasked_end = Traits::tile_geometry(p, seqlen_q, seqlen_k).kv_unmasked(m_block).end;
      CUTE_NO_UNROLL
      for (; n >= unmasked_end; --n) { step(n, cute::true_type{}); }
    }
    if constexpr (kLocal) {
      // Blocks right of the unmasked ones (the right side of the window, keys
      // past seqlen_k), the unmasked ones, then those left of them (the left side).
      BlockRange const unmasked = Traits::tile_geometry(p, seqlen_q, seqlen_k).kv_unmasked(m_block);
      int const unmasked_begin = cute::max(unmasked.begin, kv_blocks.begin);
      int const unmasked_end = cute::max(unmasked.end, unmasked_begin);
      CUTE_NO_UNROLL
      for (; n >= unmasked_end; --n) { step(n, cute::true_type{}); }
      CUTE_NO_UNROLL
      for (; n >= unmasked_begin; --n) { step(n, cute::false_type{}); }
      CUTE_NO_UNROLL
      for (; n >= kv_blocks.begin; --n) { step(n, cute::true_type{}); }
    } else {
      CUTE_NO_UNROLL
      for (; n >= kv_blocks.begin; --n) { step(n, cute::false_type{}); }
    }

    // Every S = Q K^T of the tile has retired: this Q stage may be refilled
    // (kQPerWarpgroup: released already, release_q_after_last_s).
    if constexpr (!Traits::kQPerWarpgroup) { pipeline_q.consumer_release(q_state); }
    CUTE_UNROLL
    for (int i = 0; i < Traits::kQLoadsPerTile; ++i) { ++q_state; }

    // Last PV GEMM.
    consumer_wait(pipeline_v, read_state);
    warpgroup_gemm<false, 0>(mma_pv, tOrP, tOrV(_, _, _, uniform_stage(read_state)), tOrO);
    pipeline_v.consumer_release(read_state);
    ++read_state;

    softmax.finalize(p.score_scale, o_scale, lse);
    scale_rows(tOrO, o_scale);
  }
};

}  // namespace dash_fa3::fwd
