// MMA (consumer) role of the forward kernel: per tile, S = Q K^T with WGMMA
// from shared memory, fp32 online softmax, and O += P V with P from registers.
//
// Each of the two MMA warpgroups owns 64 rows of the 128-row query tile and
// walks the same key blocks, from the last block down.
//
// Intra-warpgroup overlap: in step n the warpgroup issues S_n = Q K[n]^T and
// then O += P_{n+1} V[n+1] back to back without waiting, waits for S_n only,
// and runs the softmax of S_n while the PV GEMM still runs on the tensor
// cores. With one P fragment, P_n can only be written once that PV GEMM has
// retired, and ptxas (CUDA 13.0) then schedules the whole softmax after the
// PV wait, so the overlap is lost. Where registers allow it
// (Traits::kDoubleBufferP) P alternates between two fragments: the softmax
// writes the one the PV GEMM in flight does not read, and the PV GEMM is
// waited for at the start of the next step, before O is rescaled.
//
// Ping-pong: the two warpgroups take turns issuing their GEMMs of one step
// (kMmaTurn0/kMmaTurn1), so the tensor cores run one warpgroup's GEMMs while
// the other one does its softmax.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/gemm_sm90.h"
#include "common/mask.h"
#include "common/named_barriers.h"
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
  using Blocks = KeyBlockRange<Traits::kBlockM, Traits::kBlockN, Traits::kCausal>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr bool kCausal = Traits::kCausal;
  static constexpr int kTurnThreads = 2 * Traits::kThreadsPerWarpgroup;
  static_assert(Traits::kNumMmaWarpgroups == 2, "the ping-pong turn barriers assume two MMA warpgroups");

  // Output accumulator type of one thread.
  using FragO = decltype(partition_fragment_C(typename Traits::TiledMmaPV{},
                                              Shape<Int<kBlockM>, Int<kHeadDim>>{}));

  // mma_tid: thread index among the MMA threads, [0, 256).
  CUTE_DEVICE static int warpgroup(int mma_tid) {
    return __shfl_sync(0xffffffff, mma_tid / Traits::kThreadsPerWarpgroup, 0);
  }

  // Called once by every MMA thread before the first tile.
  CUTE_DEVICE static void init(int mma_tid) {
    // kMmaTurn0: warpgroup 0 has the first turn; this arrival stands in for
    // warpgroup 1's "your turn" that warpgroup 0's first wait needs.
    if (warpgroup(mma_tid) == 0) { named_barrier_arrive(FwdBarrier::kMmaTurn0, kTurnThreads); }
  }

  // Waits for this warpgroup's turn to issue GEMMs (kMmaTurn<w>: warpgroup w
  // waits, the other warpgroup arrives when it has issued its own).
  CUTE_DEVICE static void wait_turn(int wg) {
    named_barrier_sync(wg == 0 ? FwdBarrier::kMmaTurn0 : FwdBarrier::kMmaTurn1, kTurnThreads);
  }
  // Hands the turn to the other warpgroup.
  CUTE_DEVICE static void pass_turn(int wg) {
    named_barrier_arrive(wg == 0 ? FwdBarrier::kMmaTurn1 : FwdBarrier::kMmaTurn0, kTurnThreads);
  }

  template <class Pipeline, class State>
  CUTE_DEVICE static void consumer_wait(Pipeline& pipeline, State const& state) {
    auto token = pipeline.consumer_try_wait(state);
    pipeline.consumer_wait(state, token);
  }

  // Computes the normalised O of one tile into tOrO and the LSE of this
  // thread's two rows into lse. n_end >= 1 key blocks.
  CUTE_DEVICE static void run(Params const& p, SharedStorage& smem, PipelineQ& pipeline_q,
                              PipelineKV& pipeline_k, PipelineKV& pipeline_v, PipelineStateQ& q_state,
                              PipelineState& read_state, int m_block, int n_end, int mma_tid,
                              FragO& tOrO, float (&lse)[2]) {
    int const wg = warpgroup(mma_tid);
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});

    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(mma_tid);
    auto thr_pv = mma_pv.get_thread_slice(mma_tid);
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ)(_, _, _, q_state.index());  // smem descriptors
    Tensor tSrK = thr_qk.partition_fragment_B(sK);    // (.., stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);   // (.., stage)
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

    using FragS = decltype(partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{}));
    using LayoutP = decltype(accumulator_as_a_operand(typename FragS::layout_type{}));
    Tensor tOrP = make_tensor<Element>(LayoutP{});  // P (buffer 0 of two with kDoubleBufferP)

    RowSoftmax softmax(p.softmax_scale_log2);
    float o_scale[2];
    int const row0 = m_block * kBlockM;
    auto mask = [&](auto& tSrS, int n) CUTLASS_LAMBDA_FUNC_INLINE {
      apply_attention_mask<kCausal>(tSrS, tScS, row0, n * kBlockN, p.seqlen_q, p.seqlen_k);
    };

    // First block: S, mask (it may hold keys past seqlen_k and the diagonal),
    // softmax. No PV GEMM to overlap with yet.
    int n = n_end - 1;
    {
      FragS tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
      consumer_wait(pipeline_q, q_state);
      consumer_wait(pipeline_k, read_state);
      warpgroup_gemm<true, 0>(mma_qk, tSrQ, tSrK(_, _, _, read_state.index()), tSrS);
      pipeline_k.consumer_release(read_state);
      mask(tSrS, n);
      softmax.template update<true, true>(tSrS, o_scale);
      convert_fragment(make_tensor(tSrS.data(), LayoutP{}), tOrP);
    }
    clear(tOrO);

    // The part of a step both P schemes share: S_n = Q K[n]^T and O += p_in
    // V[n+1] issued in this warpgroup's turn, the wait for S_n, and the
    // softmax of S_n. read_state is K[n]'s stage, v_state V[n+1]'s.
    auto issue_and_softmax = [&](int n, auto masked, auto const& p_in, PipelineState const& v_state,
                                 auto& tSrS) CUTLASS_LAMBDA_FUNC_INLINE {
      constexpr bool kMasked = decltype(masked)::value;
      consumer_wait(pipeline_k, read_state);
      // kMmaTurn<wg>: wait until the other warpgroup has issued its GEMMs.
      wait_turn(wg);
      warpgroup_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read_state.index()), tSrS);
      consumer_wait(pipeline_v, v_state);
      warpgroup_gemm<false, -1>(mma_pv, p_in, tOrV(_, _, _, v_state.index()), tOrO);
      // kMmaTurn<other>: our GEMMs are queued, the other warpgroup may issue.
      pass_turn(wg);
      warpgroup_wait<1>();  // S_n is ready; the PV GEMM may still run
      warpgroup_fence_operand(tSrS);
      pipeline_k.consumer_release(read_state);
      if constexpr (kMasked) { mask(tSrS, n); }
      softmax.template update<false, kMasked>(tSrS, o_scale);
    };

    if constexpr (Traits::kDoubleBufferP) {
      Tensor tOrP1 = make_tensor<Element>(LayoutP{});
      bool pv_pending = false;  // a PV GEMM is in flight, not yet waited for
      PipelineState pending_v;  // the V stage it reads
      bool in_p0 = true;        // tOrP (true) or tOrP1 holds the newest P
      // Waits for the PV GEMM in flight (if any) and releases its V stage.
      auto retire_pv = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        if (pv_pending) {
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          pipeline_v.consumer_release(pending_v);
          pv_pending = false;
        }
      };
      // One step: multiplies p_in (P_{n+1}) and writes P_n into p_out.
      auto step = [&](int n, auto masked, auto& p_in, auto& p_out) CUTLASS_LAMBDA_FUNC_INLINE {
        PipelineState const v_state = read_state;
        ++read_state;
        FragS tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
        retire_pv();
        scale_rows(tOrO, o_scale);  // the previous softmax's factor, before this PV adds into O
        issue_and_softmax(n, masked, p_in, v_state, tSrS);
        convert_fragment(make_tensor(tSrS.data(), LayoutP{}), p_out);  // not the PV's operand
        pv_pending = true;
        pending_v = v_state;
      };
      auto steps_down_to = [&](int n_stop, auto masked) CUTLASS_LAMBDA_FUNC_INLINE {
        CUTE_NO_UNROLL
        for (; n >= n_stop; --n) {
          if (in_p0) {
            step(n, masked, tOrP, tOrP1);
          } else {
            step(n, masked, tOrP1, tOrP);
          }
          in_p0 = !in_p0;
        }
      };

      --n;
      if constexpr (kCausal) {
        steps_down_to(Blocks::unmasked_end(m_block, p.seqlen_q, p.seqlen_k), cute::true_type{});
      }
      steps_down_to(0, cute::false_type{});

      // Every S = Q K^T of the tile has retired: this Q stage may be refilled.
      pipeline_q.consumer_release(q_state);
      ++q_state;

      // Last PV GEMM.
      retire_pv();
      scale_rows(tOrO, o_scale);
      consumer_wait(pipeline_v, read_state);
      if (in_p0) {
        warpgroup_gemm<false, 0>(mma_pv, tOrP, tOrV(_, _, _, read_state.index()), tOrO);
      } else {
        warpgroup_gemm<false, 0>(mma_pv, tOrP1, tOrV(_, _, _, read_state.index()), tOrO);
      }
      pipeline_v.consumer_release(read_state);
      ++read_state;
    } else {
      // One step: S_n = Q K[n]^T and O += P_{n+1} V[n+1] issued together; the
      // softmax of S_n is written between the two waits, but ptxas moves it
      // after the PV wait (see the file header).
      auto step = [&](int n, auto masked) {
        PipelineState const v_state = read_state;
        ++read_state;
        FragS tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
        issue_and_softmax(n, masked, tOrP, v_state, tSrS);
        warpgroup_wait<0>();  // PV retired: tOrP may be overwritten, V released
        warpgroup_fence_operand(tOrO);
        pipeline_v.consumer_release(v_state);
        convert_fragment(make_tensor(tSrS.data(), LayoutP{}), tOrP);
        scale_rows(tOrO, o_scale);
      };

      --n;
      if constexpr (kCausal) {
        int const unmasked_end = Blocks::unmasked_end(m_block, p.seqlen_q, p.seqlen_k);
        CUTE_NO_UNROLL
        for (; n >= unmasked_end; --n) { step(n, cute::true_type{}); }
      }
      CUTE_NO_UNROLL
      for (; n >= 0; --n) { step(n, cute::false_type{}); }

      // Every S = Q K^T of the tile has retired: this Q stage may be refilled.
      pipeline_q.consumer_release(q_state);
      ++q_state;

      // Last PV GEMM.
      consumer_wait(pipeline_v, read_state);
      warpgroup_gemm<false, 0>(mma_pv, tOrP, tOrV(_, _, _, read_state.index()), tOrO);
      pipeline_v.consumer_release(read_state);
      ++read_state;
    }

    softmax.finalize(p.softmax_scale, o_scale, lse);
    scale_rows(tOrO, o_scale);
  }
};

}  // namespace dash_fa3::fwd
