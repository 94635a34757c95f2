// MMA (consumer) role of the backward kernel, run by the MMA warpgroups.
// Row split (d <= 128): warpgroup w owns KV rows [64w, 64w + 64) of the task's
// KV tile; its dK and dV rows accumulate in registers across all steps of the
// task. Head-dim split (d = 256): both own all 64 KV rows, warpgroup w the
// head-dim half w of dK and dV. Three warpgroups (d = 192): all 96 KV rows,
// warpgroup w head-dim rows [64w, 64w + 64) of dK^T and dV^T (bwd_traits.h;
// run_task_three below, the others run_task_two).
//
// One step (one Q tile q), row split:
//   S^T  = K Q^T         (SS WGMMA)    issued together, then
//   dP^T = V dO^T        (SS WGMMA)    P is computed while dP still runs
//   P^T  = exp2(S^T * scale_log2 - lse_log2[m])   (masked entries -> 0)
//   dS^T = P^T * (dP^T - dPsum[m])
//   (softcap: S^T <- tanh(S^T * prescale) first, and dS^T times 1 - tanh^2;
//   common/softcap.h)
//   dV  += P^T dO        (RS WGMMA, P^T from registers)
//   dS^T -> sdS          (shared memory, for the dQ GEMM of both warpgroups;
//                        hdim 64 and 96 store it before the dV issue: Traits::kDsBeforeDv)
//   dQ   = dS K          (SS WGMMA, after both warpgroups wrote sdS: kDsReady)
//   dK  += dS^T Q        (RS WGMMA)
//   dQ -> sdQ[step % 2], this warpgroup's half handed to the dQ writer
//                        (dq_empty / dq_full) while the dK GEMM still runs; 128-bit stores of
//                        register groups in fragment order (common/dq_accum_layout.h)
// Traits::kDkBeforeDq (hdim 128): dK is issued right after dV, before sdS
// and kDsReady, so the tensor cores hold dV and dK while the warpgroups meet;
// dQ, the last GEMM, goes to sdQ once it retires and is handed over once the
// next step has computed its dS^T.
// Head-dim split: S^T and dP^T of Q rows [32w, 32w + 32) as above; then P^T
// and dS^T -> sP, sdS; after kDsReady dV += P^T dO, dQ = dS K and dK += dS^T Q
// for head-dim half w, all three from shared memory; the dQ hand-off as above.
// dK here is unscaled; the epilogue multiplies it by softmax_scale.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "common/dq_accum_layout.h"
#include "common/gemm_sm90.h"
#include "common/named_barriers.h"
#include "common/softcap.h"
#include "kernels/bwd/bwd_trace.h"
#include "kernels/bwd/bwd_traits.h"
#include "schedules/schedule_metadata.h"

namespace dash_fa3::bwd {

template <class Traits>
struct BwdMainloop {
  using Element = typename Traits::Element;
  using Params = typename Traits::Params;
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineDo = typename Traits::PipelineDo;
  using PipelineStateQ = typename Traits::PipelineStateQ;
  using PipelineStateDo = typename Traits::PipelineStateDo;
  static constexpr bool kSplitHeadDim = Traits::kSplitHeadDim;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr bool kCausal = Traits::kCausal;
  static constexpr bool kLocal = Traits::kLocal;
  static constexpr bool kSoftcap = Traits::kSoftcap;
  static constexpr int kMmaThreads = Traits::kNumMmaThreads;

  using FragSdP = decltype(partition_fragment_C(typename Traits::TiledMmaSdP{}, typename Traits::SdPTile{}));
  using FragDk = decltype(partition_fragment_C(typename Traits::TiledMmaDk{},
                                               typename Traits::template DkvTile<kHeadDim>{}));
  using FragDv = decltype(partition_fragment_C(typename Traits::TiledMmaDv{},
                                               typename Traits::template DkvTile<Traits::kHeadDimV>{}));
  using FragDq = decltype(partition_fragment_C(typename Traits::TiledMmaDq{},
                                               Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // One warpgroup's dQ accumulator: ((2, 2, A/8), 1, N/A) registers (N columns
  // per warpgroup, A = one WGMMA's N), register r = flat index, as
  // common/dq_accum_layout.h defines the fragment order (tests/test_contract_cpp.py
  // compares it with cute's partition_C of this MMA).
  static constexpr int kDqWgCols = dq_frag_wg_cols(kBlockM, kHeadDim);
  static constexpr int kDqAtomCols = dq_frag_atom_cols(kBlockM, kHeadDim);
  static_assert(std::is_same_v<decltype(shape(typename FragDq::layout_type{})),
                               Shape<Shape<_2, _2, Int<kDqAtomCols / 8>>, _1, Int<kDqWgCols / kDqAtomCols>>>,
                "dQ accumulator is not ((2, 2, A/8), 1, N/A)");
  static_assert(size(FragDq{}) == kDqWgCols / 2 && size(FragDq{}) % kDqFragGroup == 0,
                "dQ accumulator: N/2 registers per thread, whole groups of 4");
  // Traits::kLseEarly: this thread's LSE values of a step are loaded into
  // registers before the S^T GEMM. The register order this assumes: per
  // warpgroup one 64 x kBlockM atom, accumulator ((2, 2, kBlockM / 8), 1, 1).
  static constexpr bool kLseEarly = Traits::kLseEarly;
  static constexpr bool kDkBeforeDq = Traits::kDkBeforeDq;
  static constexpr int kSdPRegs = decltype(size(typename FragSdP::layout_type{}))::value;
  static_assert(!kLseEarly || (decltype(size<0, 0>(typename FragSdP::layout_type{}))::value == 2 &&
                                decltype(size<0, 1>(typename FragSdP::layout_type{}))::value == 2 &&
                                decltype(size<0, 2>(typename FragSdP::layout_type{}))::value == kBlockM / 8 &&
                                decltype(size(typename FragSdP::layout_type{}))::value == kBlockM / 2),
                "one 64 x kBlockM S^T atom per warpgroup");
  // P^T / dS^T accumulators re-viewed as the register A operand of dV / dK.
  using LayoutA = decltype(accumulator_as_a_operand(typename FragSdP::layout_type{}));

  // Every MMA thread: sK and sV are free (before the first task, and after a
  // task whose dK/dV do not leave through them): lets the producer load the
  // next task's K and V.
  CUTE_DEVICE static void release_kv() {
    named_barrier_arrive(BwdBarrier::kKEmpty, kMmaThreads + Traits::kWarpThreads);
    named_barrier_arrive(BwdBarrier::kVEmpty, kMmaThreads + Traits::kWarpThreads);
  }

  // The hand-off barriers of part `part` (Traits::dq_part) in hand-off set stage.
  CUTE_DEVICE static BwdBarrier dq_empty(int stage, int part) {
    return static_cast<BwdBarrier>(static_cast<uint32_t>(BwdBarrier::kDqEmpty) +
                                   Traits::kDqHandoffParts * stage + part);
  }
  CUTE_DEVICE static BwdBarrier dq_full(int stage, int part) {
    return static_cast<BwdBarrier>(static_cast<uint32_t>(BwdBarrier::kDqFull) +
                                   Traits::kDqHandoffParts * stage + part);
  }

  // st.shared.v4.f32: a 128-bit store to a 32-bit shared-memory address.
  CUTE_DEVICE static void store_shared_v4(uint32_t addr, float x, float y, float z, float w) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" : : "r"(addr), "f"(x), "f"(y), "f"(z), "f"(w)
                 : "memory");
  }

  // This thread's first dQ slot in sdQ buffer 0 (32-bit shared address): its
  // register group g goes to (g * 128 + wg_tid) * 4 of its warpgroup's region.
  CUTE_DEVICE static uint32_t sdq_thread_address(SharedStorage& smem, int mma_tid) {
    int const dq_thread_offset = Traits::sdq_wg_offset(mma_tid / kDqFragWgThreads) +
                                 dq_frag_reg_offset(mma_tid % kDqFragWgThreads, 0);
    return cute::cast_smem_ptr_to_uint(smem.dq.data()) + uint32_t(dq_thread_offset) * uint32_t(sizeof(float));
  }

  // One 128-bit store per group of 4 dQ registers into sdQ buffer `buffer`,
  // in fragment order: a warp's stores of one group cover 512 contiguous
  // bytes, so each is 4 wavefronts, the minimum (64-bit pair stores into the
  // swizzled row-major tile were 2-way bank conflicts).
  // Groups [kFirst, kFirst + kCount) only where given (a slot of a shared half).
  template <int kFirst = 0, int kCount = -1>
  CUTE_DEVICE static void store_dq(uint32_t sdq_thread, int buffer, FragDq const& tQrDq) {
    uint32_t const dst = sdq_thread + uint32_t(buffer) * Traits::kDqBufferBytes;
    constexpr int kEnd = kCount < 0 ? int(size(FragDq{})) / kDqFragGroup : kFirst + kCount;
    CUTE_UNROLL
    for (int g = kFirst; g < kEnd; ++g) {
      store_shared_v4(dst + uint32_t(dq_frag_reg_offset(0, kDqFragGroup * g)) * uint32_t(sizeof(float)),
                      tQrDq(4 * g), tQrDq(4 * g + 1), tQrDq(4 * g + 2), tQrDq(4 * g + 3));
    }
  }

  template <class Pipeline>
  CUTE_DEVICE static void consumer_wait(Pipeline& pipeline, typename Pipeline::PipelineState const& state) {
    auto token = pipeline.consumer_try_wait(state);
    pipeline.consumer_wait(state, token);
  }

  // Trace builds (bwd_trace.h): warpgroup wg's first thread records the time
  // around its dq_empty wait; nothing otherwise.
  CUTE_DEVICE static void trace_empty_wait(Params const& p, int32_t const* row, int s, int wg, int mma_tid,
                                           int field) {
    if (mma_tid % Traits::kThreadsPerWarpgroup == 0) {
      DASH_FA3_TRACE_STEP(p, row, s, field + 2 * wg, tracing::now_clock());
    }
  }

  // Runs the n_steps >= 1 steps of one task. K and V must have landed.
  // ds_stage: which sdS buffer the next step writes; dq_stage: the dQ
  // hand-off set of the next step (its sdQ buffer: Traits::sdq_buffer). Both
  // flip every step.
  // sP (head-dim split); the row split has none and gets sdS, which it never reads as P.
  CUTE_DEVICE static Element* sp_data(SharedStorage& smem) {
    if constexpr (kSplitHeadDim) {
      return smem.pbuf.p.data();
    } else {
      return smem.ds.data();
    }
  }

  CUTE_DEVICE static void run_task(Params const& p, SharedStorage& smem, PipelineQ& pipeline_q,
                                   PipelineDo& pipeline_do, PipelineStateQ& read_q, PipelineStateDo& read_do,
                                   int& ds_stage, int& dq_stage, int32_t const* row, int n_steps, int mma_tid,
                                   FragDk& tdKrdK, FragDv& tdVrdV) {
    if constexpr (Traits::kThreeWarpgroups) {
      run_task_three(p, smem, pipeline_q, pipeline_do, read_q, read_do, dq_stage, row, n_steps, mma_tid, tdKrdK,
                     tdVrdV);
    } else {
      run_task_two(p, smem, pipeline_q, pipeline_do, read_q, read_do, ds_stage, dq_stage, row, n_steps, mma_tid,
                   tdKrdK, tdVrdV);
    }
  }

  // The three-warpgroup arrangement (d = 192, bwd_traits.h). One step:
  //   S  = Q K^T, dP = dO V^T   (SS; warpgroup w: KV columns [32w, 32w + 32))
  //   (the previous step's dK^T retires: its Q stage is released)
  //   P  = exp2(S * scale_log2 - lse_log2[m]) (masked -> 0)
  //   kDsFree; P -> sP; kPReady
  //   dV^T += dO^T P            (SS; warpgroup w: head-dim rows [64w, 64w + 64))
  //   dS = P (dP - dPsum[m]) -> sdS, under dV^T; kDsReady
  //   dQ = dS K                 (SS; warpgroup w: head-dim columns [64w, 64w + 64))
  //   (dV^T retires: the dO stage is released)
  //   dK^T += Q^T dS            (SS; as dV^T)
  //   dQ -> sdQ, handed to the dQ writer (one part) while dK^T runs on into
  //   the next step's S and dP.
  // Each move of work off the path between a step's dP and its dQ GEMM was
  // measured (docs/journal/bwd-kernel.md).
  CUTE_DEVICE static void run_task_three(Params const& p, SharedStorage& smem, PipelineQ& pipeline_q,
                                         PipelineDo& pipeline_do, PipelineStateQ& read_q, PipelineStateDo& read_do,
                                         int& dq_stage, int32_t const* row, int n_steps, int mma_tid,
                                         FragDk& tdKrdK, FragDv& tdVrdV) {
    constexpr int kDvWarpgroups = Traits::kDvWarpgroups;
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutDo{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutDot{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    // sP and sdS (kBlockM, kBlockN), KV contiguous: dS the K-major A operand
    // of dQ; both viewed (kBlockN, kBlockM) as the MN-major B operands of dK^T
    // and dV^T; written from registers through position-independent swizzle
    // views (32-bit shared addresses, as the row split's sdS).
    Tensor sDs = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDs{});
    Tensor sDst = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDst{});
    Tensor sPt = make_tensor(make_smem_ptr(smem.pbuf.p.data()), typename Traits::SmemLayoutDst{});
    Tensor sDsW = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDs{}));
    Tensor sPW = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(smem.pbuf.p.data()), typename Traits::SmemLayoutDs{}));
    uint32_t const sdq_thread = sdq_thread_address(smem, mma_tid);

    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmaDk mma_dk;
    typename Traits::TiledMmaDv mma_dv;
    typename Traits::TiledMmaDq mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(mma_tid);
    // Descriptors sliced by the warpgroup's first thread (uniform registers; see run_task_two).
    int const wg = __shfl_sync(0xffffffff, mma_tid / Traits::kThreadsPerWarpgroup, 0);
    int const wg_first_tid = wg * Traits::kThreadsPerWarpgroup;
    bool const has_dv = Traits::has_dv_slice(wg_first_tid);
    auto wg_sdp = mma_sdp.get_slice(wg_first_tid);
    auto wg_dk = mma_dk.get_slice(wg_first_tid);
    // A warpgroup without a dV slice (MLA's warpgroup 2) issues no dV GEMM; it
    // takes the last one's descriptors only to have some.
    auto wg_dv = mma_dv.get_slice(cute::min(wg, kDvWarpgroups - 1) * Traits::kThreadsPerWarpgroup);
    auto wg_dq = mma_dq.get_slice(wg_first_tid);
    Tensor tSrQ = wg_sdp.partition_fragment_A(sQ);    // (.., stage)
    Tensor tSrdO = wg_sdp.partition_fragment_A(sdO);  // (.., stage)
    Tensor tSrK = wg_sdp.partition_fragment_B(sK);
    Tensor tSrV = wg_sdp.partition_fragment_B(sV);
    Tensor tDrQt = wg_dk.partition_fragment_A(sQt);    // (.., stage)
    Tensor tDrDst = wg_dk.partition_fragment_B(sDst);  // (.., 1)
    Tensor tDrdOt = wg_dv.partition_fragment_A(sdOt);  // (.., stage)
    Tensor tDrPt = wg_dv.partition_fragment_B(sPt);    // (.., 1)
    Tensor tQrDs = wg_dq.partition_fragment_A(sDs);    // (.., 1)
    Tensor tQrKt = wg_dq.partition_fragment_B(sKt);
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_r2s = r2s.get_thread_slice(mma_tid);
    Tensor tRsDs = thr_r2s.partition_D(sDsW);  // (.., 1), this thread's dS slots
    Tensor tRsP = thr_r2s.partition_D(sPW);    // (.., 1), its P slots
    // (Q row, KV column) of each accumulator register, tile-local.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(typename Traits::SdPTile{}));
    static_assert(decltype(size(tScS))::value == 16, "one 64 x 32 atom of S per warpgroup");

    TileGeometry const geo = Traits::tile_geometry(p, Traits::seqlens(p, row[schedule::kCBatch]));
    int const kv = row[schedule::kCKvTile];
    int const n0 = kv * kBlockN;
    int const q_unmasked = geo.q_unmasked_begin(kv);
    int const q_unmasked_end = kLocal ? geo.q_unmasked_end(kv) : 0;
    bool const mask_every_step = !kCausal && !kLocal && q_unmasked > 0;
    int const causal_shift = geo.seqlen_k - geo.seqlen_q;
    int const hi_shift = causal_shift + (kLocal ? p.window_right : 0);
    int const lo_shift = kLocal ? causal_shift - p.window_left : 0;
    float const scale_log2 = p.score_scale_log2;
    schedule::StepOrder const order = schedule::StepOrder::of(row);
    // This thread's two Q rows of S (registers 4j + 2r + c: row r).
    int const m_lo = get<0>(tScS(0));
    int const m_hi = get<0>(tScS(2));
    PipelineStateQ release_q = read_q;  // the Q stage of the step whose dK^T is in flight

    CUTE_NO_UNROLL
    for (int s = 0; s < n_steps; ++s) {
      bool need_mask = mask_every_step;
      int m0 = 0;
      if constexpr (kCausal || kLocal) {
        int const q = order.q_tile(s) >> p.rank.group_log2;  // a grouped row's: schedule::GroupTile
        need_mask = kLocal ? (q < q_unmasked || q >= q_unmasked_end) : q < q_unmasked;
        m0 = q * kBlockM;
      }
      FragSdP tSrS = partition_fragment_C(mma_sdp, typename Traits::SdPTile{});
      FragSdP tdPrdP = partition_fragment_C(mma_sdp, typename Traits::SdPTile{});
      // The step's stage indices, warp-uniform for the WGMMA descriptors (common/gemm_sm90.h).
      int const q_stage = uniform_stage(read_q);
      int const do_stage = uniform_stage(read_do);
      consumer_wait(pipeline_q, read_q);
      float const* lse = smem.lse[q_stage];
      float const lse_lo = lse[m_lo];
      float const lse_hi = lse[m_hi];
      warpgroup_gemm<true, -1>(mma_sdp, tSrQ(_, _, _, q_stage), tSrK, tSrS);
      consumer_wait(pipeline_do, read_do);
      warpgroup_gemm<true, -1>(mma_sdp, tSrdO(_, _, _, do_stage), tSrV, tdPrdP);
      // The previous step's dK^T ran on under the S and dP issue (no wait
      // between it and this step's first WGMMA); it has retired before this
      // step writes sP and sdS (kDsFree).
      warpgroup_wait<2>();
      if (s > 0) {
        warpgroup_fence_operand(tdKrdK);
        pipeline_q.consumer_release(release_q);  // the previous step's Q stage is read
      }
      warpgroup_wait<1>();  // S is ready; dP may still run
      warpgroup_fence_operand(tSrS);
      auto masked_at = [&](int i) {
        int const m = m0 + get<0>(tScS(i));
        int const n = n0 + get<1>(tScS(i));
        return n >= geo.seqlen_k || ((kCausal || kLocal) && n > m + hi_shift) || (kLocal && n < m + lo_shift);
      };
      // Softcap: S <- t = tanh(S * prescale) first, dS times 1 - t^2 (common/softcap.h).
      float dtanh[kSoftcap ? kSdPRegs : 1];
      auto probs = [&](auto masked) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          float x = tSrS(i);
          if constexpr (kSoftcap) {
            float const t = tanh_approx(x * p.softcap_prescale);
            dtanh[i] = fmaf(-t, t, 1.f);
            x = t;
          }
          float const pv = exp2f(fmaf(x, scale_log2, -((i & 2) ? lse_hi : lse_lo)));
          tSrS(i) = masked(i) ? 0.f : pv;
        }
      };
      // Only tiles that hold masked entries pay for the test.
      if (need_mask) {
        probs(masked_at);
      } else {
        probs([](int) { return false; });
      }
      Tensor tPrP = make_tensor<Element>(typename FragSdP::layout_type{});
      convert_fragment(tSrS, tPrP);
      // Wait until every warpgroup's GEMMs of the previous step, which read
      // sP and sdS, have retired (each waited for its own dK^T above).
      named_barrier_sync(BwdBarrier::kDsFree, kMmaThreads);
      copy(r2s, thr_r2s.retile_S(tPrP), tRsP(_, _, _, 0));
      // The generic-proxy stores above are read by WGMMA (async proxy) next.
      cutlass::arch::fence_view_async_shared();
      // Wait until every warpgroup has written its KV columns of P.
      named_barrier_sync(BwdBarrier::kPReady, kMmaThreads);
      // dV^T first, before dS is computed: it runs under dS and its stores,
      // and its retirement frees the dO stage (d = 192 has one), so the next
      // step's dO loads under this step's dQ and dK^T.
      if (has_dv) {
        warpgroup_gemm<false, -1>(mma_dv, tDrdOt(_, _, _, do_stage), tDrPt(_, _, _, 0), tdVrdV);
      } else {
        // An empty batch, so that every warpgroup waits on the same counts below.
        warpgroup_commit_batch();
      }
      warpgroup_wait<1>();  // dP is ready; dV^T may still run
      warpgroup_fence_operand(tdPrdP);
      float const* dpsum = smem.dpsum[do_stage];
      float const dpsum_lo = dpsum[m_lo];
      float const dpsum_hi = dpsum[m_hi];
      CUTE_UNROLL
      for (int i = 0; i < size(tdPrdP); ++i) {
        float const ds = tSrS(i) * (tdPrdP(i) - ((i & 2) ? dpsum_hi : dpsum_lo));
        if constexpr (kSoftcap) {
          tdPrdP(i) = ds * dtanh[i];
        } else {
          tdPrdP(i) = ds;
        }
      }
      Tensor tPrDs = make_tensor<Element>(typename FragSdP::layout_type{});
      convert_fragment(tdPrdP, tPrDs);
      copy(r2s, thr_r2s.retile_S(tPrDs), tRsDs(_, _, _, 0));
      // As for sP: read by the dQ and dK^T WGMMAs.
      cutlass::arch::fence_view_async_shared();
      // Wait until every warpgroup has written its KV columns of dS.
      named_barrier_sync(BwdBarrier::kDsReady, kMmaThreads);
      FragDq tQrDq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      warpgroup_gemm<true, -1>(mma_dq, tQrDs(_, _, _, 0), tQrKt, tQrDq);
      // The dO stage is released before dK^T is issued: issuing it first
      // held the warpgroup at the WGMMA issue while dV^T had long retired.
      warpgroup_wait<1>();  // dV^T retired: the dO stage (and dPsum) is read
      warpgroup_fence_operand(tdVrdV);
      pipeline_do.consumer_release(read_do);
      ++read_do;
      warpgroup_gemm<false, -1>(mma_dk, tDrQt(_, _, _, q_stage), tDrDst(_, _, _, 0), tdKrdK);
      warpgroup_wait<1>();  // dQ retired; dK^T runs under its hand-off
      warpgroup_fence_operand(tQrDq);
      // Wait until the dQ writer has read the previous step's partial dQ from the sdQ tile.
      named_barrier_sync(dq_empty(dq_stage, 0), Traits::kDqHandoffThreads);
      store_dq(sdq_thread, Traits::sdq_buffer(dq_stage), tQrDq);
      // sdQ is read by the bulk copy engine (async proxy).
      cutlass::arch::fence_view_async_shared();
      // Tell the dQ writer of this step's set that the tile holds the partial dQ.
      named_barrier_arrive(dq_full(dq_stage, 0), Traits::kDqHandoffThreads);
      release_q = read_q;  // released once dK^T retires, in the next step or below
      ++read_q;
      dq_stage ^= 1;
    }
    warpgroup_wait<0>();  // the last dK^T retired: its Q stage, sP and sdS are read
    warpgroup_fence_operand(tdKrdK);
    pipeline_q.consumer_release(release_q);
  }

  CUTE_DEVICE static void run_task_two(Params const& p, SharedStorage& smem, PipelineQ& pipeline_q,
                                       PipelineDo& pipeline_do, PipelineStateQ& read_q, PipelineStateDo& read_do,
                                       int& ds_stage, int& dq_stage, int32_t const* row, int n_steps, int mma_tid,
                                       FragDk& tdKrdK, FragDv& tdVrdV) {
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutDo{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutDot{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    Tensor sDs = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDs{});
    // sdS is written from registers through a position-independent swizzle
    // tensor: the 128-byte swizzle acts on the 32-bit element offset (exact
    // because the buffer is 1024-byte aligned) and the stores are st.shared.
    // Swizzling the 64-bit generic address instead kept 64-bit addresses live
    // through the dS^T computation and made ptxas spill.
    Tensor sDst = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDst{}));
    // Head-dim split: sP written the same way; sP^T and sdS^T as the K-major A operands of dV and dK.
    Tensor sPst = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(sp_data(smem)), typename Traits::SmemLayoutDst{}));
    Tensor sPt = make_tensor(make_smem_ptr(sp_data(smem)), typename Traits::SmemLayoutDst{});
    Tensor sDsT = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDst{});
    uint32_t const sdq_thread = sdq_thread_address(smem, mma_tid);

    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmaDk mma_dk;
    typename Traits::TiledMmaDv mma_dv;
    typename Traits::TiledMmaDq mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(mma_tid);
    // The shared-memory operand descriptors of a WGMMA depend only on the
    // warpgroup. Sliced by a warpgroup's first thread index that the compiler
    // knows to be warp-uniform (broadcast from lane 0), their arithmetic stays
    // in uniform registers. Sliced by the thread index, each descriptor was
    // computed per thread and moved to a uniform register (R2UR) in front of
    // every WGMMA, many times the R2UR and IMAD instructions FA3's kernel
    // issues (measured: docs/journal/code-comments.md).
    int const wg = __shfl_sync(0xffffffff, mma_tid / Traits::kThreadsPerWarpgroup, 0);
    int const wg_first_tid = wg * Traits::kThreadsPerWarpgroup;
    auto wg_sdp = mma_sdp.get_slice(wg_first_tid);
    auto wg_dk = mma_dk.get_slice(wg_first_tid);
    auto wg_dv = mma_dv.get_slice(wg_first_tid);
    auto wg_dq = mma_dq.get_slice(wg_first_tid);
    Tensor tSrK = wg_sdp.partition_fragment_A(sK);
    Tensor tSrV = wg_sdp.partition_fragment_A(sV);
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);      // (.., stage)
    Tensor tSrdO = wg_sdp.partition_fragment_B(sdO);    // (.., stage)
    Tensor tDrdOt = wg_dv.partition_fragment_B(sdOt);  // (.., stage)
    Tensor tDrQt = wg_dk.partition_fragment_B(sQt);    // (.., stage)
    Tensor tQrDs = wg_dq.partition_fragment_A(sDs);     // (.., stage)
    // Head-dim split: P^T and dS^T as the shared-memory A operands of dV, dK (.., stage).
    auto tDrPt = [&] {
      if constexpr (kSplitHeadDim) { return wg_dv.partition_fragment_A(sPt); } else { return 0; }
    }();
    auto tDrDst = [&] {
      if constexpr (kSplitHeadDim) { return wg_dk.partition_fragment_A(sDsT); } else { return 0; }
    }();
    Tensor tQrKt = wg_dq.partition_fragment_B(sKt);
    auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_r2s_ds = r2s_ds.get_thread_slice(mma_tid);
    Tensor tRsDst = thr_r2s_ds.partition_D(sDst);         // (.., stage), this thread's dS^T slots
    Tensor tRsPt = thr_r2s_ds.partition_D(sPst);          // (.., stage), head-dim split: its P^T slots
    // (KV row, Q row) of each accumulator register, tile-local.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));

    // The task's problem (a packed document has its own lengths).
    TileGeometry const geo = Traits::tile_geometry(p, Traits::seqlens(p, row[schedule::kCBatch]));
    int const kv = row[schedule::kCKvTile];
    int const n0 = kv * kBlockN;
    int const q_unmasked = geo.q_unmasked_begin(kv);  // Q tiles from here on need no mask
    // local: ... up to here (Q tiles from here on reach past the window's left side).
    int const q_unmasked_end = kLocal ? geo.q_unmasked_end(kv) : 0;
    // Without a causal mask or a window only keys past seqlen_k are masked:
    // q_unmasked is 0 or n_q, so every step of the task needs the mask or none
    // does, and these warpgroups need no Q tile.
    bool const mask_every_step = !kCausal && !kLocal && q_unmasked > 0;
    int const causal_shift = geo.seqlen_k - geo.seqlen_q;  // key j visible to query i iff j <= i + shift
    // local: key j is visible to query i iff i + lo_shift <= j <= i + hi_shift
    // (window sides that are unbounded come as bounds that hide nothing).
    int const hi_shift = causal_shift + (kLocal ? p.window_right : 0);
    int const lo_shift = kLocal ? causal_shift - p.window_left : 0;
    float const scale_log2 = p.score_scale_log2;
    // The task's Q-tile order, read from the row once (the ranks are the dQ writer's business).
    schedule::StepOrder const order = schedule::StepOrder::of(row);

    // kDkBeforeDq: the sdQ set whose partial dQ this warpgroup stored but has
    // not yet handed to the dQ writer (-1: none).
    int dq_pending = -1;
    // Tell the dQ writer that hand-off part `part` of set `stage` holds its
    // partial dQ (fenced first: sdQ is read by the bulk copy engine, the async proxy).
    auto signal_dq_full = [&](int stage, int part) {
      cutlass::arch::fence_view_async_shared();
      named_barrier_arrive(dq_full(stage, part), Traits::kDqHandoffThreads);
    };
    // This warpgroup's half of the sdQ buffer.
    auto hand_over_dq = [&](int stage) {
      signal_dq_full(stage, Traits::dq_part(wg));
      dq_pending = -1;
    };
    CUTE_NO_UNROLL
    for (int s = 0; s < n_steps; ++s) {
      if (mma_tid == 0) {
        DASH_FA3_TRACE_STEP(p, row, s, tracing::kMmaStepBegin, tracing::now_clock());
        DASH_FA3_TRACE_STEP(p, row, s, tracing::kMmaStepBeginNs, tracing::now_ns());
      }
      bool need_mask = mask_every_step;
      int m0 = 0;  // first row of the Q tile; only the causal and window masks read it
      if constexpr (kCausal) {
        int const q = order.q_tile(s) >> p.rank.group_log2;  // a grouped row's: schedule::GroupTile
        need_mask = q < q_unmasked;
        m0 = q * kBlockM;
      }
      if constexpr (kLocal) {
        int const q = order.q_tile(s) >> p.rank.group_log2;  // a grouped row's: schedule::GroupTile
        need_mask = q < q_unmasked || q >= q_unmasked_end;
        m0 = q * kBlockM;
      }

      FragSdP tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      FragSdP tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      DASH_FA3_TRACE_TIMED(p, row, s, tracing::kMmaQWait, mma_tid == 0, consumer_wait(pipeline_q, read_q));
      float const* lse = smem.lse[read_q.index()];
      // This thread's LSE values, loaded before the S^T GEMM so the exp2 below
      // does not wait for shared memory after the GEMM wait.
      float lse_early[kLseEarly ? kBlockM / 4 : 1];
      if constexpr (kLseEarly) {
        CUTE_UNROLL
        for (int j = 0; j < kBlockM / 8; ++j) {
          float2 const v = *reinterpret_cast<float2 const*>(lse + 8 * j + 2 * (mma_tid % 4));
          lse_early[2 * j] = v.x;
          lse_early[2 * j + 1] = v.y;
        }
      }
      warpgroup_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, read_q.index()), tSrS);
      DASH_FA3_TRACE_TIMED(p, row, s, tracing::kMmaDoWait, mma_tid == 0, consumer_wait(pipeline_do, read_do));
      warpgroup_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, read_do.index()), tdPrdP);
      warpgroup_wait<1>();  // S^T is ready; dP^T may still run
      warpgroup_fence_operand(tSrS);
      // P^T = exp2(S^T * scale_log2 - lse_log2). Entries past seqlen_k or
      // above the causal diagonal (or outside the window) are 0; only tiles that
      // hold such entries pay for the test.
      // Register i of S^T holds Q column 8 * (i / 4) + 2 * (lane % 4) + i % 2.
      auto lse_of = [&](int i) {
        if constexpr (kLseEarly) {
          return lse_early[2 * (i / 4) + i % 2];
        } else {
          return lse[get<1>(tScS(i))];
        }
      };
      // Softcap: t = tanh(S^T * prescale), P^T = exp2(t * scale_log2 - lse_log2)
      // and 1 - t^2, while dP^T still runs. P^T and 1 - t^2 wait for dP^T as
      // fp16 pairs, in the registers S^T held: an fp32 copy of 1 - t^2 next to
      // S^T and dP^T spilled (hdim 128: 96/204 bytes; fp16 1 - t^2 beside fp32
      // P^T: 28/40, hdim 64: 184/208), and computing the exp2 after the dP^T
      // wait loses the overlap (measured: docs/journal/code-comments.md).
      // Both are rounded to 16 bits for their GEMMs anyway (P^T for dV, dS^T).
      __half2 p_h[kSoftcap ? kSdPRegs / 2 : 1];
      __half2 dtanh[kSoftcap ? kSdPRegs / 2 : 1];
      auto softcap_probs = [&](auto masked_at) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); i += 2) {
          float const t0 = tanh_approx(tSrS(i) * p.softcap_prescale);
          float const t1 = tanh_approx(tSrS(i + 1) * p.softcap_prescale);
          dtanh[i / 2] = __floats2half2_rn(fmaf(-t0, t0, 1.f), fmaf(-t1, t1, 1.f));
          float const p0 = masked_at(i) ? 0.f : exp2f(fmaf(t0, scale_log2, -lse_of(i)));
          float const p1 = masked_at(i + 1) ? 0.f : exp2f(fmaf(t1, scale_log2, -lse_of(i + 1)));
          p_h[i / 2] = __floats2half2_rn(p0, p1);
        }
      };
      if constexpr (kSoftcap) {
        // The mask test is spelled out again in the plain loop below: one lambda
        // shared by both changed the plain kernels' code (hdim 64 local backward,
        // CUDA 13.0: 3472 SASS instructions against 4248), which are tuned and
        // measured as they are.
        if (need_mask) {
          softcap_probs([&](int i) {
            int const n = n0 + get<0>(tScS(i));
            int const m = get<1>(tScS(i));
            return n >= geo.seqlen_k || ((kCausal || kLocal) && n > m0 + m + hi_shift) ||
                   (kLocal && n < m0 + m + lo_shift);
          });
        } else {
          softcap_probs([](int) { return false; });
        }
        warpgroup_wait<0>();  // dP^T is ready
        warpgroup_fence_operand(tdPrdP);
        float const* dpsum = smem.dpsum[read_do.index()];
        CUTE_UNROLL
        for (int i = 0; i < size(tdPrdP); ++i) {
          bool const lo = i % 2 == 0;
          tSrS(i) = lo ? __low2float(p_h[i / 2]) : __high2float(p_h[i / 2]);
          float const d = lo ? __low2float(dtanh[i / 2]) : __high2float(dtanh[i / 2]);
          tdPrdP(i) = tSrS(i) * (tdPrdP(i) - dpsum[get<1>(tScS(i))]) * d;
        }
      } else {
        if (need_mask) {
          CUTE_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            int const n = n0 + get<0>(tScS(i));
            int const m = get<1>(tScS(i));
            bool const masked = n >= geo.seqlen_k || ((kCausal || kLocal) && n > m0 + m + hi_shift) ||
                                (kLocal && n < m0 + m + lo_shift);
            tSrS(i) = masked ? 0.f : exp2f(fmaf(tSrS(i), scale_log2, -lse_of(i)));
          }
        } else {
          CUTE_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            tSrS(i) = exp2f(fmaf(tSrS(i), scale_log2, -lse_of(i)));
          }
        }
        warpgroup_wait<0>();  // dP^T is ready
        warpgroup_fence_operand(tdPrdP);
        float const* dpsum = smem.dpsum[read_do.index()];
        CUTE_UNROLL
        for (int i = 0; i < size(tdPrdP); ++i) {
          tdPrdP(i) = tSrS(i) * (tdPrdP(i) - dpsum[get<1>(tScS(i))]);
        }
      }
      // kDkBeforeDq: the previous step's dQ goes to the writer only now. Handed
      // over right after the dP^T issue, its fence waits for the 8 STS.128 to
      // drain, in front of the exp2s; here the wait is off that path (measured:
      // docs/journal/code-comments.md).
      if (dq_pending >= 0) { hand_over_dq(dq_pending); }
      FragDq tQrDq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      if constexpr (!kSplitHeadDim) {
        // P^T is converted only now, after dS^T: converting it before the dP^T
        // wait kept the 16-bit P^T live next to fp32 S^T and dP^T (hdim 64:
        // 64 + 64 + 32 registers on top of dK, dV), which made ptxas spill.
        Tensor tDrP = make_tensor<Element>(LayoutA{});
        convert_fragment(make_tensor(tSrS.data(), LayoutA{}), tDrP);
        Tensor tDrDs = make_tensor<Element>(LayoutA{});
        convert_fragment(make_tensor(tdPrdP.data(), LayoutA{}), tDrDs);

        // dS^T -> sdS with stmatrix: each 8 x 8 block of the accumulator (8 KV
        // rows x 8 adjacent Q rows) is one matrix whose rows are 16 contiguous
        // bytes of the M-contiguous sdS; one STSM.x4 moves 8 registers' worth
        // (4-byte stores took 4x the instructions, which queued in front of the
        // WGMMAs on the MIO pipe). Before or after the dV issue: Traits::kDsBeforeDv.
        auto store_ds = [&] {
          copy(r2s_ds, thr_r2s_ds.retile_S(make_tensor(tDrDs.data(), typename FragSdP::layout_type{})),
               tRsDst(_, _, _, ds_stage));
        };
        if constexpr (Traits::kDsBeforeDv) { store_ds(); }
        warpgroup_gemm<false, -1>(mma_dv, tDrP, tDrdOt(_, _, _, read_do.index()), tdVrdV);
        if constexpr (kDkBeforeDq) {
          warpgroup_gemm<false, -1>(mma_dk, tDrDs, tDrQt(_, _, _, read_q.index()), tdKrdK);
        }
        if constexpr (!Traits::kDsBeforeDv) { store_ds(); }
        // The generic-proxy stores above are read by WGMMA (async proxy) next.
        cutlass::arch::fence_view_async_shared();

        // Wait until both warpgroups have written their KV rows of dS.
        named_barrier_sync(BwdBarrier::kDsReady, kMmaThreads);
        warpgroup_gemm<true, -1>(mma_dq, tQrDs(_, _, _, ds_stage), tQrKt, tQrDq);
        if constexpr (!kDkBeforeDq) {
          warpgroup_gemm<false, -1>(mma_dk, tDrDs, tDrQt(_, _, _, read_q.index()), tdKrdK);
        }
      } else {
        // P^T and dS^T of this warpgroup's Q rows -> sP, sdS (stmatrix, as above).
        Tensor tPrP = make_tensor<Element>(typename FragSdP::layout_type{});
        convert_fragment(tSrS, tPrP);
        Tensor tPrDs = make_tensor<Element>(typename FragSdP::layout_type{});
        convert_fragment(tdPrdP, tPrDs);
        copy(r2s_ds, thr_r2s_ds.retile_S(tPrP), tRsPt(_, _, _, ds_stage));
        copy(r2s_ds, thr_r2s_ds.retile_S(tPrDs), tRsDst(_, _, _, ds_stage));
        // The generic-proxy stores above are read by WGMMA (async proxy) next.
        cutlass::arch::fence_view_async_shared();

        // Wait until both warpgroups have written their Q rows of P^T and dS^T.
        named_barrier_sync(BwdBarrier::kDsReady, kMmaThreads);
        warpgroup_gemm<false, -1>(mma_dv, tDrPt(_, _, _, ds_stage), tDrdOt(_, _, _, read_do.index()), tdVrdV);
        warpgroup_gemm<true, -1>(mma_dq, tQrDs(_, _, _, ds_stage), tQrKt, tQrDq);
        warpgroup_gemm<false, -1>(mma_dk, tDrDst(_, _, _, ds_stage), tDrQt(_, _, _, read_q.index()), tdKrdK);
      }
      if constexpr (kDkBeforeDq) {
        warpgroup_wait<1>();  // dV and dK retired; dQ still runs
        warpgroup_fence_operand(tdVrdV);
        warpgroup_fence_operand(tdKrdK);
        // dO, dPsum and Q of this step are read (dP^T, dV; S^T, dK): the
        // producer may load the next ones while dQ still runs.
        pipeline_do.consumer_release(read_do);
        ++read_do;
        pipeline_q.consumer_release(read_q);
        ++read_q;
        // Wait until the dQ writer has finished reading what it last took from
        // this warpgroup's half of this sdQ buffer (its partial dQ of
        // kStagesDq steps ago).
        trace_empty_wait(p, row, s, wg, mma_tid, tracing::kMmaEmptyWait);
        named_barrier_sync(dq_empty(dq_stage, Traits::dq_part(wg)), Traits::kDqHandoffThreads);
        trace_empty_wait(p, row, s, wg, mma_tid, tracing::kMmaEmptyDone);
        warpgroup_wait<0>();  // dQ retired: sdS is read
        warpgroup_fence_operand(tQrDq);
        store_dq(sdq_thread, Traits::sdq_buffer(dq_stage), tQrDq);
        // The fence and dq_full come after the next step's dS^T (or at the
        // task's end), by when the stores have drained.
        dq_pending = dq_stage;
      } else {
        warpgroup_wait<1>();  // dV and dQ retired; dK runs under the dQ hand-off below
        warpgroup_fence_operand(tQrDq);
        // dO and dPsum of this stage are read (dP^T and dV retired): the producer
        // may load the next dO while dK still runs.
        pipeline_do.consumer_release(read_do);
        ++read_do;

        if constexpr (Traits::kDqSharedHalf) {
          // This warpgroup's half in two quarters, one per slot (bwd_traits.h),
          // each handed over as soon as it is stored.
          cute::for_each(cute::make_int_sequence<Traits::kDqSlots>{}, [&](auto slot) {
            // Wait until the dQ writer has read the slot's last quarter (warpgroup
            // 0: warpgroup 1's of the previous step; warpgroup 1: warpgroup 0's).
            if (slot == 0) { trace_empty_wait(p, row, s, wg, mma_tid, tracing::kMmaEmptyWait); }
            named_barrier_sync(dq_empty(wg, slot), Traits::kDqHandoffThreads);
            if (slot == 0) { trace_empty_wait(p, row, s, wg, mma_tid, tracing::kMmaEmptyDone); }
            store_dq<decltype(slot)::value * Traits::kDqSlotGroups, Traits::kDqSlotGroups>(sdq_thread, 0, tQrDq);
            signal_dq_full(dq_stage, slot);  // the slot holds this quarter
          });
        } else {
          // Wait until the dQ writer has finished reading what it last took from
          // this warpgroup's half of this sdQ buffer: this warpgroup's partial dQ
          // of kStagesDq steps ago.
          trace_empty_wait(p, row, s, wg, mma_tid, tracing::kMmaEmptyWait);
          named_barrier_sync(dq_empty(dq_stage, Traits::dq_part(wg)), Traits::kDqHandoffThreads);
          trace_empty_wait(p, row, s, wg, mma_tid, tracing::kMmaEmptyDone);
          store_dq(sdq_thread, Traits::sdq_buffer(dq_stage), tQrDq);
        }
        warpgroup_wait<0>();  // dK retired: the Q stage and sdS are read
        warpgroup_fence_operand(tdVrdV);
        warpgroup_fence_operand(tdKrdK);
        // Fenced after the dK wait, by when the stores have drained, so the
        // fence costs nothing.
        if constexpr (!Traits::kDqSharedHalf) { hand_over_dq(dq_stage); }
        pipeline_q.consumer_release(read_q);
        ++read_q;
      }
      ds_stage ^= 1;
      dq_stage ^= 1;
    }
    if (dq_pending >= 0) { hand_over_dq(dq_pending); }
  }
};

}  // namespace dash_fa3::bwd
