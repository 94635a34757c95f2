// Compile-time configuration of the Hopper backward kernel: tile sizes, warp
// roles, named barriers, register budgets, shared-memory layouts, MMA and TMA
// types, the shared storage and the kernel parameter block. Everything the
// role files need is derived here from (head dim, element type, mask kind).
//
// Two arrangements of the two MMA warpgroups (docs/design/kernels-bwd.md has
// the longer argument):
//
// Row split (head dims up to 128, kBlockN = 128):
//  * S and dP are computed transposed, S^T = K Q^T and dP^T = V dO^T, with
//    the two MMA warpgroups split along the KV rows (warpgroup w owns KV rows
//    [64w, 64w + 64) of the 128-row KV tile). The accumulator of S^T is then
//    already P^T laid out as a register A operand of dV += P^T dO, and dS^T
//    is the register A operand of dK += dS^T Q: neither P nor dS goes through
//    shared memory for the dK/dV GEMMs, and each warpgroup's dK/dV rows are
//    its own, so no reduction between warpgroups is needed.
//  * dQ = dS K needs all KV rows, so dS is written once to shared memory
//    (m-contiguous, which matches the register pairs of the transposed
//    accumulator) and read by both warpgroups. The dQ tile is split between
//    the warpgroups along M when kBlockM = 128 (hdim 64) and along the head
//    dim when kBlockM = 64 (hdim 96/128), so each warpgroup's WGMMA is 64 x N.
//
// Head-dim split (head dims 192 and 256, kBlockN = 64): a warpgroup's dK and
// dV rows over the whole head dim would take 2 x 64 x d / 128 = d registers
// per thread, more than a thread has. So both warpgroups share the 64 KV rows
// and split the head dim instead: warpgroup w accumulates columns
// [w d/2, (w + 1) d/2) of dK and dV (d/2 registers in all) and of each partial
// dQ. S^T and dP^T (64 x kBlockM) are split along the Q rows, 32 per
// warpgroup; P^T and dS^T both go to shared memory, because each warpgroup's
// dK/dV GEMMs need all Q rows of them. Every GEMM is then shared-memory
// sourced.
//
// Three warpgroups (head dim 192, kBlockM = 64, kBlockN = 96; FA3's
// arrangement there): a 64 x 96 KV tile of dK and dV over d = 192 would take
// 144 registers per thread in two warpgroups. Three warpgroups own 64
// head-dim rows each of dK^T and dV^T (48 registers each), accumulated
// transposed (dK^T += Q^T dS, dV^T += dO^T P: M is the head dim, which three
// 64-row WGMMAs cover, where 96 KV rows would not split). S = Q K^T and
// dP = dO V^T (64 x 96) are split along the KV columns, 32 per warpgroup, and
// each thread's rows are 2 Q rows (2 LSE and 2 dPsum values). P and dS go to
// shared memory (N-contiguous: the K-major A operand of dQ = dS K, the
// MN-major B operands of dK^T and dV^T); one buffer each, as Q's two stages,
// dO's stage, K, V and one sdQ tile fill the rest, so the next step writes
// them only after every warpgroup's GEMMs of this one have retired (kDsFree);
// P is stored first and meets at kPReady, so dV^T runs under dS.
// dQ: warpgroup w its 64 columns (dq_accum_layout.h with three warpgroups),
// handed to the dQ writer as one tile.
//
// MLA (kHeadDimV < kHeadDim, (192, 128) only): V, dO and dV have the value
// head dim. dP = dO V^T runs over it, and dV^T is split over kHeadDimV / 64
// warpgroups (MLA's 128: warpgroups 0 and 1; warpgroup 2 holds no dV).
//
// Both: the partial dQ goes to shared memory and on to the fp32 accumulator
// in the accumulator registers' own order (common/dq_accum_layout.h): 128-bit
// stores without bank conflicts, and one 1-D bulk reduce-add per tile.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <type_traits>

#include "common/block_range.h"
#include "common/constants.h"
#include "common/dq_accum_layout.h"
#include "common/problem_view.h"
#include "common/seqlen_info.h"
#include "common/gemm_sm90.h"
#include "common/params.h"
#include "kernel_contract.h"  // generated: bwd_block_m / bwd_block_n
#include "kernels/bwd/bwd_tasks.h"
#include "schedules/schedule_metadata.h"

namespace dash_fa3::bwd {

using namespace cute;

// Warp roles. Warpgroup 0: warp 0 issues the TMA loads, warps 1 and 2 are
// the dQ writers (one per sdQ buffer), warp 3 only gives its registers back.
// Warpgroups 1-2: MMA.
enum class WarpRole : int { kProducer = 0, kDqWriter = 1, kIdle = 2, kMma = 3 };

// Named barriers of the backward kernel (hardware ids: common/named_barriers.h).
enum class BwdBarrier : uint32_t {
  // The MMA warpgroups are done with sK of the current task (and, where dK is
  // staged in sK, the epilogue's TMA store has read it); the producer waits on
  // it before loading the next task's K.
  kKEmpty = 0,
  // Both MMA warpgroups have written their rows of dS^T to sdS; both wait on
  // it before the dQ = dS K GEMM.
  kDsReady = 1,
  // kDqEmpty + 2 b + w (dq_empty(b, w)): the region that MMA warpgroup w
  // writes its half of a partial dQ of hand-off set b (steps = b mod 2) into
  // has been read by the copy engine; warpgroup w waits on it before writing
  // there (bwd_dq_writer.h says which writer arrives). Per warpgroup, so that
  // neither waits for the other at the hand-off (they already meet at kDsReady).
  // d = 256 indexes both by its sdQ slots instead (BwdTraits::kDqSharedHalf).
  kDqEmpty = 2,  // .. 5
  // kDqFull + 2 b + w (dq_full(b, w)): MMA warpgroup w has written its half
  // of a partial dQ of hand-off set b; dQ writer b waits on it before issuing
  // that half's reduce-add.
  kDqFull = 6,  // .. 9
  // MHA epilogue: both MMA warpgroups' GEMMs of the task have retired (the dQ
  // GEMM of either warpgroup reads all of sK and sdS), then: both have written
  // their dK/dV rows into the staging tiles (the TMA store reads them), then
  // (staging in sdS) the TMA store has read sdS.
  kEpilogue = 10,
  // As kKEmpty, for sV and the next task's V.
  kVEmpty = 11,
  // Three warpgroups: every MMA warpgroup's GEMMs of the previous step (which
  // read the one sP and sdS buffer) have retired; each waits on it before
  // writing the step's P and dS.
  kDsFree = 12,
  // Three warpgroups: every MMA warpgroup has written its KV columns of P to
  // sP; each waits on it before the dV^T GEMM (dS is stored after that GEMM
  // is issued and meets at kDsReady).
  kPReady = 13,
  kCount,
};

// Measurement build, never the default (tools/build_config.py MEASUREMENT_KNOBS).
#ifndef DASH_FA3_BWD_FIXED_STEPS
#define DASH_FA3_BWD_FIXED_STEPS 0
#endif

// The MMAs of each arrangement (BwdTraits below), as functions so that only
// the chosen one is instantiated. S^T = K Q^T and dP^T = V dO^T, (kBlockN,
// kBlockM, d): row split, warpgroups along M (KV rows); head-dim split, along
// N (Q rows). Three warpgroups: S = Q K^T and dP = dO V^T, (kBlockM, kBlockN,
// d), warpgroups along the KV columns.
template <class Element, int kWarpgroups, bool kSplitHeadDim, int kBlockM, int kBlockN, int kHeadDim>
CUTE_HOST_DEVICE constexpr auto tiled_mma_sdp() {
  if constexpr (kWarpgroups == 3) {
    return make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN / kWarpgroups>, Int<kHeadDim>>>(),
        Layout<Shape<_1, Int<kWarpgroups>, _1>>{});
  } else if constexpr (kSplitHeadDim) {
    return make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM / 2>, Int<kHeadDim>>>(),
        Layout<Shape<_1, _2, _1>>{});
  } else {
    return make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
        Layout<Shape<_2, _1, _1>>{});
  }
}

// dK += dS^T Q: (kBlockN, d, kBlockM), dV += P^T dO: (kBlockN, dv, kBlockM)
// (kDim = d or dv). Row split: A (P^T, dS^T) from registers, warpgroups along
// the KV rows. Head-dim split: from sP / sdS (K-major views), warpgroups
// along the head dim. Three warpgroups: transposed, dK^T += Q^T dS (d,
// kBlockN, kBlockM) and dV^T += dO^T P, A (Q^T, dO^T) and B (dS, P viewed
// (KV, Q)) MN-major, warpgroups along the head dim, 64 rows each.
template <class Element, int kWarpgroups, bool kSplitHeadDim, int kBlockM, int kBlockN, int kDim>
CUTE_HOST_DEVICE constexpr auto tiled_mma_dkv() {
  if constexpr (kWarpgroups == 3) {
    return make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kBlockM>>,
                                               GMMA::Major::MN, GMMA::Major::MN>(),
                          Layout<Shape<Int<kDim / 64>, _1, _1>>{});
  } else if constexpr (kSplitHeadDim) {
    return make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kDim / 2>, Int<kBlockM>>,
                                               GMMA::Major::K, GMMA::Major::MN>(),
                          Layout<Shape<_1, _2, _1>>{});
  } else {
    return make_tiled_mma(
        GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kDim>, Int<kBlockM>>,
                             GMMA::Major::K, GMMA::Major::MN>(),
        Layout<Shape<_2, _1, _1>>{});
  }
}

template <int kHeadDim_, int kHeadDimV_, class Element_, MaskKind kMask_, bool kPacked_, bool kSoftcap_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // V's, dO's and dV's head dim (MLA: narrower than Q's and K's).
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr MaskKind kMask = kMask_;
  static constexpr bool kCausal = kMask == MaskKind::kCausal;
  // A runtime window (Params::window_left/right), masked on both sides.
  static constexpr bool kLocal = kMask == MaskKind::kLocal;
  // Packed documents (common/seqlen_info.h): each problem's lengths and rows
  // come from cu_seqlens. The dense instantiation reads the call's lengths
  // from the kernel parameters and has no per-document code.
  static constexpr bool kPacked = kPacked_;
  // Softcapped scores (common/softcap.h): tanh before P, dS times 1 - tanh^2.
  static constexpr bool kSoftcap = kSoftcap_;

  // Tile shape per head dim, from dash_fa3/schedule/contract.py (as FA3's
  // Hopper backward at hdim 64/128): kBlockN KV rows, kBlockM Q rows per step.
  static constexpr int kBlockM = bwd_block_m(kHeadDim);
  static constexpr int kBlockN = bwd_block_n(kHeadDim);
  static constexpr int kNumMmaWarpgroups = bwd_mma_warpgroups(kHeadDim);
  // The three-warpgroup arrangement (d = 192, see the top of this file).
  static constexpr bool kThreeWarpgroups = kNumMmaWarpgroups == 3;
  // Chains (schedule header dkv_chained, columns chain_before / chain_after): consecutive rows
  // of a CTA at one KV tile keep K and V in shared memory and sum their dK/dV in registers, which
  // then live across the MMA warps' task loop (bwd_kernel.h). Not with three warpgroups: there
  // they crowd the MMA warps' kMmaRegisters and spill, so each task clears and stores its own
  // dK/dV, the kernel reads no chain column and the launcher refuses chained schedules. From
  // the contract (BWD_CHAINS in dash_fa3/schedule/contract.py), so the schedules agree.
  static constexpr bool kChains = bwd_chains(kHeadDim);
  static_assert(kChains == !kThreeWarpgroups, "chains in every kernel but the three-warpgroup one");
  // The two-warpgroup head-dim split (see the top of this file): d = 256.
  static constexpr bool kSplitHeadDim = kHeadDim > 128 && !kThreeWarpgroups;
  static_assert(kNumMmaWarpgroups == 2 || (kThreeWarpgroups && kHeadDim == 192 && kBlockM == 64),
                "three MMA warpgroups only at head dim 192 with 64 Q rows per step");
  static_assert(kBlockN == (kThreeWarpgroups ? 32 * kNumMmaWarpgroups
                            : kSplitHeadDim  ? 64
                                             : 64 * kNumMmaWarpgroups),
                "row split: each MMA warpgroup owns 64 KV rows; head-dim split: both share 64; three "
                "warpgroups: 32 KV columns of S each");
  static_assert(kHeadDimV == kHeadDim ||
                    ((kSplitHeadDim || kThreeWarpgroups) && kHeadDimV < kHeadDim && kHeadDimV % 64 == 0),
                "a narrower value head dim only with the head-dim split or three warpgroups, in whole "
                "64-column slices");
  // Warpgroups that accumulate a head-dim slice of dV (three warpgroups: 64
  // columns each, so MLA's 128 leaves warpgroup 2 without one).
  static constexpr int kDvWarpgroups = kThreeWarpgroups ? kHeadDimV / 64 : kNumMmaWarpgroups;
  // Whether MMA thread mma_tid's warpgroup holds a slice of dV.
  CUTE_HOST_DEVICE static constexpr bool has_dv_slice(int mma_tid) {
    return mma_tid < kDvWarpgroups * kThreadsPerWarpgroup;
  }
  // Whether task row `row` continues a chain (its K, V and dK/dV are the previous row's), and
  // whether its chain goes on after it (the next row takes its dK/dV); never without kChains.
  CUTE_HOST_DEVICE static bool continues_chain(int32_t const* row) {
    return kChains && row[schedule::kCChainBefore] > 0;
  }
  CUTE_HOST_DEVICE static bool chain_goes_on(int32_t const* row) {
    return kChains && row[schedule::kCChainAfter] > 0;
  }
  // Pipeline depths. Shared memory bounds them at d = 256: K, V, two Q and
  // one dO stage, sP, sdS and half an sdQ tile (kDqSharedHalf) take 224 KB.
  // Q keeps two stages there: a Q stage is released only at the end of a
  // step, so with one the next step's S^T waited for the whole load.
  // Three warpgroups at d = 192 (K, V 36 KB each, Q 2 x 24, one sdQ tile 48):
  // one dO stage and one sP / sdS buffer, as FA3 (MLA's narrower dO and V
  // leave room for a second dO stage).
  static constexpr int kStagesQ = 2;  // Q (+LSE) pipeline
  static constexpr int kStagesDo =    // dO (+dPsum) pipeline
      kHeadDimV > 192 || (kThreeWarpgroups && kHeadDimV == kHeadDim) ? 1 : 2;
  // sdS (and sP): a double buffer needs no barrier before the next write.
  static constexpr int kStagesDs = kThreeWarpgroups ? 1 : 2;
  // dQ-writer warps (warps 1..kDqWriters of warpgroup 0): writer b takes the
  // CTA's steps = b (mod 2) and the hand-off barriers of set b, so the
  // serial hand-off chains of consecutive steps overlap (bwd_dq_writer.h).
  static constexpr int kDqWriters = 2;
  // sdQ buffers: two, so that the MMA warpgroups run one step ahead of a dQ
  // writer that waits for its turn (deterministic mode). One at d > 128: a
  // tile is kBlockM x d fp32 (48 or 64 KB); the writers then take turns on it.
  static constexpr int kStagesDq = kSplitHeadDim || kThreeWarpgroups ? 1 : 2;
  static_assert(kStagesDq == 1 || kStagesDq == kDqWriters, "one sdQ buffer, or one per writer");
  // Where the MHA epilogue stages dK and dV for their TMA stores
  // (bwd_epilogue.h): in sdS, free once the task's last dQ GEMM retires, where
  // it holds them (row split: dK fits at d <= 128, dV beside it at d = 64),
  // else in sK / sV. Staged in sdS, a tile's K or V buffer is released as soon
  // as the task's GEMMs retire, so the next task's load runs under the
  // epilogue instead of after its TMA store has read the buffer.
  static constexpr int kDsElements = kBlockM * kBlockN * kStagesDs;
  static constexpr int kKvTileElements = kBlockN * kHeadDim;  // row split: kHeadDimV == kHeadDim
  static constexpr bool kRowSplit = !kSplitHeadDim && !kThreeWarpgroups;
  static constexpr bool kDkStagedInDs = kRowSplit && kDsElements >= kKvTileElements;
  static constexpr bool kDvStagedInDs = kRowSplit && kDsElements >= 2 * kKvTileElements;
  // The sdQ buffer of hand-off set b.
  CUTE_HOST_DEVICE static constexpr int sdq_buffer(int b) { return kStagesDq == 1 ? 0 : b; }
  // A partial dQ tile is handed to its dQ writer in parts: one per MMA
  // warpgroup with two (neither waits for the other at the hand-off), the
  // whole tile with three (a barrier per part and set would take 12 of the
  // 15 named barriers; the warpgroups meet at kDsFree, kPReady and kDsReady anyway).
  static constexpr int kDqHandoffParts = kThreeWarpgroups ? 1 : kNumMmaWarpgroups;
  static_assert(uint32_t(BwdBarrier::kDqFull) - uint32_t(BwdBarrier::kDqEmpty) >= kDqWriters * kDqHandoffParts &&
                    uint32_t(BwdBarrier::kEpilogue) - uint32_t(BwdBarrier::kDqFull) >= kDqWriters * kDqHandoffParts,
                "one dq_empty and one dq_full barrier per (hand-off set, part)");
  static_assert(kBlockM >= 64 && kBlockM % 64 == 0 && kHeadDim % 32 == 0, "no backward tile for this head dim");
  static_assert(!kSplitHeadDim || kBlockM == 64, "head-dim split: 32 Q rows of S^T per warpgroup");

  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kNumMmaThreads = kNumMmaWarpgroups * kThreadsPerWarpgroup;
  static constexpr int kNumThreads = kThreadsPerWarpgroup + kNumMmaThreads;
  static constexpr int kWarpThreads = 32;
  // Whether the MMA threads load a step's LSE values into registers before the
  // S^T GEMM (bwd_mainloop.h), so the exp2 after the GEMM wait does not wait
  // for shared memory: kBlockM / 4 registers per thread. Row split only. At
  // kBlockM = 128 (hdim 64) the 32 registers fit only in the wide budget below
  // and not next to softcap's or the packed window's extra state (ptxas,
  // CUDA 13.0: 152/120 bytes of spills at 232 registers; 48/48 with softcap,
  // 16/32 packed local at 240). At hdim 64 it is faster than LSE reads after
  // the wait (measured: docs/journal/code-comments.md).
  static constexpr bool kLseEarly = kRowSplit && (kBlockM == 64 || (!kSoftcap && !(kLocal && kPacked)));
  // The row split's GEMM order in a step (bwd_mainloop.h). hdim 128: dV, dK,
  // then sdS, kDsReady and dQ, and dQ's hand-off to the writer (fence,
  // dq_full) deferred until the next step has computed its dS^T. Other
  // head dims: dV, sdS, kDsReady, dQ, dK, dQ handed over while dK runs.
  // The first order is the faster at hdim 128 and the slower at hdim 64; at
  // hdim 96 (also kBlockM = 64) it is level with kDsBeforeDv below (measured:
  // docs/journal/code-comments.md).
  static constexpr bool kDkBeforeDq = kRowSplit && kHeadDim == 128;
  // Whether dS^T goes to sdS before the dV GEMM is issued (else under it).
  // Storing first is the faster at hdim 64 and 96, deterministic or not, as
  // FA3's hdim-64 order (measured: docs/journal/code-comments.md). At hdim 64
  // only in the kLseEarly (24/240) kernels: with softcap or the packed window
  // (40/232) ptxas spills more (CUDA 13.0: softcap 8-32 -> 28-64 bytes, local
  // packed 0 -> 16). hdim 128 stores after issuing dV and dK (kDkBeforeDq);
  // storing first there gains nothing.
  static constexpr bool kDsBeforeDv = kRowSplit && !kDkBeforeDq && kLseEarly;
  // setmaxnreg budgets (they must fit the launch's allocation:
  // common/constants.h, setmaxnreg_budgets_fit). Wide (24/240) where the
  // early LSE values of a 128-row step need it; else 40/232 (24/240 alone
  // gives the hdim-128 backward nothing, so it stays where it measures best;
  // measured: docs/journal/code-comments.md).
  // Three warpgroups: 32/160, the whole register file (as the forward's).
  static constexpr bool kWideMmaRegisters = kLseEarly && kBlockM == 128;
  static constexpr int kProducerRegisters = kThreeWarpgroups ? 32 : kWideMmaRegisters ? 24 : 40;
  static constexpr int kMmaRegisters = kThreeWarpgroups ? 160 : kWideMmaRegisters ? 240 : 232;
  static_assert(kThreadsPerWarpgroup == 128 &&
                    setmaxnreg_budgets_fit(kNumMmaWarpgroups, kProducerRegisters, kMmaRegisters),
                "setmaxnreg budgets exceed the launch's register allocation");
  // What the schedule as data costs (DESIGN.md wants it within noise): with
  // DASH_FA3_BWD_FIXED_STEPS=1 the dQ writers read each task's Q-tile order
  // once, as the producer and the MMA warps always do, instead of decoding
  // every step (Q tile and rank) from the task row, and the semaphore wait
  // and release are compiled out. Non-deterministic calls only (the launcher
  // refuses the others).
  static constexpr bool kFixedSteps = DASH_FA3_BWD_FIXED_STEPS != 0;

  // ---- MMAs (tiled_mma_sdp, tiled_mma_dkv above)
  using TiledMmaSdP =
      decltype(tiled_mma_sdp<Element, kNumMmaWarpgroups, kSplitHeadDim, kBlockM, kBlockN, kHeadDim>());
  // The (rows, columns) of S's accumulator tile: (KV, Q) transposed, (Q, KV) with three warpgroups.
  using SdPTile = std::conditional_t<kThreeWarpgroups, Shape<Int<kBlockM>, Int<kBlockN>>,
                                     Shape<Int<kBlockN>, Int<kBlockM>>>;
  // (The K extent of a tile shape only selects nothing: dP, whose K is
  // kHeadDimV, runs on the same MMA.)
  template <int kDim>
  using TiledMmaDkvOf = decltype(tiled_mma_dkv<Element, kNumMmaWarpgroups, kSplitHeadDim, kBlockM, kBlockN, kDim>());
  using TiledMmaDk = TiledMmaDkvOf<kHeadDim>;
  using TiledMmaDv = TiledMmaDkvOf<kHeadDimV>;
  // The accumulator tile of dK (kDim = kHeadDim) or dV (kHeadDimV): (KV, d), transposed with three warpgroups.
  template <int kDim>
  using DkvTile = std::conditional_t<kThreeWarpgroups, Shape<Int<kDim>, Int<kBlockN>>, Shape<Int<kBlockN>, Int<kDim>>>;
  // dQ = dS K: (kBlockM, kHeadDim, kBlockN), warpgroups along M if kBlockM =
  // 128, else along N. dS is M-contiguous (the transposed scores write it),
  // with three warpgroups KV-contiguous (K-major).
  static constexpr int kDqWgM = kBlockM / 64;
  static constexpr int kDqWgN = kNumMmaWarpgroups / kDqWgM;
  using TiledMmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM / kDqWgM>, Int<kHeadDim / kDqWgN>, Int<kBlockN>>,
                           kThreeWarpgroups ? GMMA::Major::K : GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<Int<kDqWgM>, Int<kDqWgN>, _1>>{}));
  // The fragment order of dQ (common/dq_accum_layout.h) describes this MMA:
  // its warpgroup split and the N of its atom (at hdim 96 cute picks 16-wide
  // atoms, which alternate between the warpgroups).
  static_assert(dq_frag_layout_ok(kBlockM, kHeadDim) && kNumMmaWarpgroups == dq_frag_warpgroups(kHeadDim) &&
                    kDqWgM == (kBlockM == 2 * kDqFragWgRows ? 2 : 1),
                "dQ fragment order not defined for this tile");
  static_assert(size<1>(typename TiledMmaDq::AtomShape_MNK{}) == dq_frag_atom_cols(kBlockM, kHeadDim),
                "dQ WGMMA atom differs from dq_frag_atom_cols");

  // ---- shared-memory layouts
  // The swizzle of a kDim-wide tile of Q, dO, K or V: the widest whose atom
  // divides the head-dim slice of one warpgroup in the MN-major GEMMs (dK/dV:
  // B = Q^T, dO^T; dQ: B = K^T), so that warpgroup 1's slice starts on an
  // atom: at d = 192 the slices are 96 wide, 128-byte atoms 64.
  // Three warpgroups: 64-wide slices.
  static constexpr int swizzle_extent(int dim) { return kThreeWarpgroups ? 64 : kSplitHeadDim ? dim / 2 : dim; }
  // Q (kDim = kHeadDim), dO (kHeadDimV): (kBlockM, kDim, stage), head dim
  // contiguous (as TMA writes it).
  template <int kStageCount, int kDim = kHeadDim>
  using SmemLayoutQOf = decltype(tile_to_shape(gmma_smem_atom<GMMA::Major::K, Element, swizzle_extent(kDim)>(),
                                               Shape<Int<kBlockM>, Int<kDim>, Int<kStageCount>>{}));
  // The same bytes viewed (kDim, kBlockM, stage): the MN-major B operand of dK/dV.
  template <int kStageCount, int kDim = kHeadDim>
  using SmemLayoutQtOf = decltype(composition(
      SmemLayoutQOf<kStageCount, kDim>{}, make_layout(Shape<Int<kDim>, Int<kBlockM>, Int<kStageCount>>{},
                                                      Stride<Int<kBlockM>, _1, Int<kBlockM * kDim>>{})));
  using SmemLayoutQ = SmemLayoutQOf<kStagesQ>;
  using SmemLayoutQt = SmemLayoutQtOf<kStagesQ>;
  using SmemLayoutDo = SmemLayoutQOf<kStagesDo, kHeadDimV>;
  using SmemLayoutDot = SmemLayoutQtOf<kStagesDo, kHeadDimV>;
  // K (kDim = kHeadDim), V (kHeadDimV): (kBlockN, kDim), loaded once per task.
  template <int kDim>
  using SmemLayoutKvOf = decltype(tile_to_shape(gmma_smem_atom<GMMA::Major::K, Element, swizzle_extent(kDim)>(),
                                                Shape<Int<kBlockN>, Int<kDim>>{}));
  using SmemLayoutK = SmemLayoutKvOf<kHeadDim>;
  using SmemLayoutV = SmemLayoutKvOf<kHeadDimV>;
  // K (V) viewed (kDim, kBlockN): the MN-major B operand of dQ; with three
  // warpgroups also the epilogue's view of the dK^T (dV^T) staging tile.
  template <int kDim>
  using SmemLayoutKvtOf = decltype(composition(
      SmemLayoutKvOf<kDim>{}, make_layout(Shape<Int<kDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  using SmemLayoutKt = SmemLayoutKvtOf<kHeadDim>;
  using SmemLayoutVt = SmemLayoutKvtOf<kHeadDimV>;
  // dS: (kBlockM, kBlockN, stage), M contiguous (the A operand of dQ, MN-major);
  // three warpgroups: KV contiguous (K-major), as their untransposed scores write it.
  using SmemLayoutDs = decltype(tile_to_shape(
      gmma_smem_atom<kThreeWarpgroups ? GMMA::Major::K : GMMA::Major::MN, Element,
                     kThreeWarpgroups ? kBlockN : kBlockM>(),
      Shape<Int<kBlockM>, Int<kBlockN>, Int<kStagesDs>>{}));
  // dS viewed (kBlockN, kBlockM, stage): how the transposed accumulator writes
  // it, and (head-dim split) the K-major A operand dS^T of dK. sP (head-dim
  // split only) has the same layouts.
  using SmemLayoutDst = decltype(composition(
      SmemLayoutDs{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kStagesDs>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kBlockN>>{})));
  // Partial dQ, fp32: per stage one flat tile of kBlockM x kHeadDim floats in
  // fragment order (common/dq_accum_layout.h), the order of the global
  // accumulator's tiles, so one 1-D bulk reduce-add moves it. (A row-major
  // 128-byte-swizzled tile took 64-bit stores of accumulator pairs, each a
  // 2-way bank conflict.)
  static constexpr int kDqTileFloats = kBlockM * kHeadDim;
  static constexpr uint32_t kDqTileBytes = kDqTileFloats * sizeof(float);
  // Each MMA warpgroup's registers fill one region of a tile in fragment
  // order; the tile is handed to the dQ writer and reduce-added in
  // kDqHandoffParts parts (a part per warpgroup, or the whole tile).
  static constexpr int kDqWgFloats = kDqTileFloats / kNumMmaWarpgroups;  // one warpgroup's region
  static_assert(dq_frag_wg_base(kBlockM, kHeadDim, 1) == kDqWgFloats, "warpgroup regions of sdQ");
  static constexpr int kDqPartFloats = kDqTileFloats / kDqHandoffParts;
  static constexpr uint32_t kDqPartBytes = kDqPartFloats * sizeof(float);
  static_assert(kDqPartBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  // The hand-off part of MMA warpgroup wg's region.
  CUTE_HOST_DEVICE static constexpr int dq_part(int wg) { return kDqHandoffParts == 1 ? 0 : wg; }
  // d = 256: the one sdQ buffer holds half a tile (32 KB; a whole tile would
  // leave room for one Q stage only), as two slots of a quarter tile each,
  // which the quarters of a step pass through in order: warpgroup 0's first
  // and second half, then warpgroup 1's (bwd_dq_writer.h). With a slot per
  // warpgroup half, warpgroup 1 waited for warpgroup 0's whole half to be
  // stored and read; now for its first quarter only, read while warpgroup 0
  // stores the second. Here dq_full(b, slot) is per hand-off set and slot,
  // dq_empty(w, slot) per warpgroup and slot (the quarters' order).
  static constexpr bool kDqSharedHalf = kHeadDim > 192;
  static_assert(!kDqSharedHalf || kStagesDq == 1, "a shared half-tile sdQ is the one buffer");
  static constexpr int kDqSlots = 2;  // slots of a shared half
  static_assert(!kDqSharedHalf || (kDqHandoffParts == kDqSlots && kNumMmaWarpgroups == 2),
                "a shared half: dq_full(b, slot) and dq_empty(w, slot) take the (set, part) barrier ids");
  static constexpr int kDqSlotFloats = kDqWgFloats / kDqSlots;
  static constexpr uint32_t kDqSlotBytes = kDqSlotFloats * sizeof(float);
  // Register groups (dq_accum_layout.h) of a warpgroup per slot: group g lies
  // at float 4 * 128 * g of its warpgroup's region, so a slot is a run of groups.
  static constexpr int kDqSlotGroups = kDqSlotFloats / (kDqFragGroup * kDqFragWgThreads);
  static_assert(!kDqSharedHalf || kDqSlotGroups * kDqFragGroup * kDqFragWgThreads == kDqSlotFloats,
                "whole groups per slot");
  static constexpr int kDqBufferFloats = kDqSharedHalf ? kDqWgFloats : kDqTileFloats;
  static constexpr uint32_t kDqBufferBytes = kDqBufferFloats * sizeof(float);
  // Float offset of MMA warpgroup wg's region in an sdQ buffer.
  CUTE_HOST_DEVICE static constexpr int sdq_wg_offset(int wg) { return kDqSharedHalf ? 0 : wg * kDqWgFloats; }
  // Threads of one dq_empty / dq_full barrier: the MMA warpgroups of one
  // part and one dQ writer warp.
  static constexpr int kDqHandoffThreads =
      kThreadsPerWarpgroup * (kNumMmaWarpgroups / kDqHandoffParts) + kWarpThreads;

  static constexpr uint32_t kRowStatBytes = kBlockM * sizeof(float);  // LSE or dPsum of one tile
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesDo = kBlockM * kHeadDimV * sizeof(Element);
  static constexpr uint32_t kTmaBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesV = kBlockN * kHeadDimV * sizeof(Element);
  static_assert(kRowStatBytes % 16 == 0, "bulk copies move multiples of 16 bytes");

  // ---- TMA
  // Q, K, V, dO as (row, dim, head, batch).
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  // Loads of a Q-shaped tensor (Q: kDim = kHeadDim, dO: kHeadDimV), one stage.
  template <int kDim>
  using TmaQOf = decltype(make_tma_copy(
      SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}),
      take<0, 2>(SmemLayoutQOf<1, kDim>{}), Shape<Int<kBlockM>, Int<kDim>>{}, _1{}));
  // Loads (K, V) and, for MHA, stores (dK, dV: the whole (kBlockN, kDim) tile
  // from its staging tile in the K/V tile layout, rows past seqlen_k clipped
  // by the copy engine) of a K-shaped tensor.
  template <class Op, class Ptr, int kDim>
  using TmaKvOf = decltype(make_tma_copy(Op{}, make_tensor(make_gmem_ptr(Ptr{}), GmemShape{}, GmemStride{}),
                                         SmemLayoutKvOf<kDim>{}, Shape<Int<kBlockN>, Int<kDim>>{}, _1{}));
  using TmaQ = TmaQOf<kHeadDim>;
  using TmaDo = TmaQOf<kHeadDimV>;
  using TmaK = TmaKvOf<SM90_TMA_LOAD, Element const*, kHeadDim>;
  using TmaV = TmaKvOf<SM90_TMA_LOAD, Element const*, kHeadDimV>;
  using TmaDk = TmaKvOf<SM90_TMA_STORE, Element*, kHeadDim>;
  using TmaDv = TmaKvOf<SM90_TMA_STORE, Element*, kHeadDimV>;

  using PipelineQ = cutlass::PipelineTmaAsync<kStagesQ>;
  using PipelineDo = cutlass::PipelineTmaAsync<kStagesDo>;
  using PipelineStateQ = typename PipelineQ::PipelineState;
  using PipelineStateDo = typename PipelineDo::PipelineState;

  // sP: P^T of a step for every warpgroup's dV GEMM (not in the row split).
  struct PBuffer {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutDs>> p;
  };
  struct NoPBuffer {};

  // 128-byte swizzled TMA destinations must be 1024-byte aligned (sdQ, a
  // bulk-copy source, needs 16; it keeps 1024).
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutDo>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutDs>> ds;
    alignas(1024) cute::array_aligned<float, kDqBufferFloats * kStagesDq> dq;  // stage s at s * kDqBufferFloats
    alignas(16) float lse[kStagesQ][kBlockM];     // log2-domain LSE rows of the Q stage
    alignas(16) float dpsum[kStagesDo][kBlockM];  // dPsum rows of the dO stage
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename PipelineDo::SharedStorage pipeline_do;
    // K (k_full) and V (v_full) of the current task have landed (one phase per task each).
    alignas(8) cutlass::arch::ClusterTransactionBarrier k_full;
    alignas(8) cutlass::arch::ClusterTransactionBarrier v_full;
    // Dynamic dispatch: the claimed task indices (bwd_tasks.h).
    TaskRingStorage task_ring;
    std::conditional_t<kRowSplit, NoPBuffer, PBuffer> pbuf;
  };
  static_assert(cosize_v<SmemLayoutDs> == kDsElements, "sdS holds kStagesDs tiles of kBlockM x kBlockN");
  // dV is staged right after dK: its tile must start on a swizzle atom (1024 bytes).
  static_assert(!kDvStagedInDs || (kKvTileElements * sizeof(Element)) % 1024 == 0,
                "dV staging tile misaligned in sdS");
  static constexpr int kSharedStorageBytes = int(sizeof(SharedStorage));
  static_assert(kSharedStorageBytes <= kSm90SharedMemoryBytes, "shared memory budget of one SM90 CTA");

  // Kernel parameters (a __grid_constant__, so the TMA descriptors stay in
  // parameter space).
  struct Params {
    TmaQ tma_q;
    TmaDo tma_do;
    TmaK tma_k;
    TmaV tma_v;
    TmaDk tma_dk;  // MHA only: GQA writes fp32 partials (dk_partial) instead
    TmaDv tma_dv;
    // dO's and V's with dv columns: shape_do / shape_v (common/problem_view.h).
    GmemShape shape_q;  // (seqlen_q, d, heads, batch); packed: (total_q, d, heads, 1)
    GmemShape shape_k;  // (seqlen_k, d, heads_kv, batch); packed: (total_k, d, heads_kv, 1)
    // Packed documents (common/seqlen_info.h): batch + 1 offsets each, nullptr
    // for a dense batch. Packed, batch counts documents and seqlen_q /
    // seqlen_k are the longest document's.
    int const* cu_seqlens_q;
    int const* cu_seqlens_k;
    // Per-row statistics, dQ accumulator rows and semaphores (stat_row): dense
    // (batch, heads, seqlen_q_rounded), packed (heads, seqlen_q_rounded) with
    // seqlen_q_rounded the padded total (common/seqlen_info.h).
    float const* lse_log2;
    float const* dpsum;
    // fp32, seqlen_q_rounded rows x d per (batch, head) or head; rows
    // [q kBlockM, (q + 1) kBlockM) from the problem's first row hold Q tile q
    // in fragment order (common/dq_accum_layout.h).
    float* dq_accum;
    int* dq_semaphore;      // one per kBlockM statistics rows
    // dK, dV (batch, seqlen_k, heads_kv, d) with strides: MHA tasks with at
    // least one step store them with tma_dk/tma_dv, tasks without steps directly.
    void* dk;
    void* dv;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    // GQA: fp32 partials (batch, heads, seqlen_k, d) (packed: (heads, total_k,
    // d)), dV's with dv columns, one slab per query head, each element written once; the
    // postprocess sums a group's slabs in a fixed order (with dkv_accumulate or dkv_ordered:
    // one accumulator per KV head). nullptr for MHA.
    float* dk_partial;
    float* dv_partial;
    int partial_rows;  // k rows per slab: seqlen_k, packed total_k
    // Non-deterministic GQA: the partials are (batch, heads_kv, ...) accumulators, zeroed, that
    // every query head of the group adds into (BwdParams::dkv_accumulate).
    int dkv_accumulate;
    // Deterministic GQA, in turns (BwdParams::dkv_ordered): the accumulators as above, not
    // zeroed, and a turn counter per (batch, KV head, KV tile).
    int dkv_ordered;
    int* dkv_semaphore;
    // The schedule (csrc/schedules/schedule_metadata.h): CTA c runs task rows
    // [cta_offsets[c], cta_offsets[c + 1]) of the task table; the header's
    // fields that decode every step are launch constants, in rank.
    int32_t const* cta_offsets;
    int32_t const* tasks;
    // Dynamic dispatch (bwd_tasks.h): the claim counter, zeroed; nullptr: static.
    int* task_counter;
    int num_tasks;
    schedule::RankParams rank;
    // dQ split s (a row's split column) adds into dq_accum + s * dq_split_floats and waits on
    // dq_semaphore + s * dq_split_sems.
    int64_t dq_split_floats;
    int64_t dq_split_sems;
    int seqlen_q, seqlen_k, seqlen_q_rounded, heads, heads_kv, batch;
    float softmax_scale;     // dK's (and, in the postprocess, dQ's) factor
    float score_scale_log2;  // P = exp2(scores * score_scale_log2 - lse_log2) (common/softcap.h)
    float softcap_prescale;  // kSoftcap: scores are tanh(QK^T * softcap_prescale)
    int deterministic;
    // kLocal: the window, an unbounded side as a bound that hides nothing
    // (left: seqlen_k, right: seqlen_q; same block ranges, see make_bwd_params).
    // Unused otherwise (last, so the other fields keep their offsets).
    int window_left, window_right;
#if DASH_FA3_BWD_TRACE
    int64_t* trace_tasks;  // kernels/bwd/bwd_trace.h
    int64_t* trace_steps;
    int trace_max_steps;
#endif
  };

  // The lengths and rows of problem (document) b.
  CUTE_HOST_DEVICE static SeqlenInfo seqlens(Params const& p, int b) { return problem_seqlens<kPacked>(p, b); }

  // Block ranges of one (batch, head) with lengths seqlen_q x seqlen_k and
  // this kernel's tiles. The full and causal windows are constants, so their
  // window tests fold away.
  CUTE_HOST_DEVICE static TileGeometry tile_geometry(Params const& p, int seqlen_q, int seqlen_k) {
    if constexpr (kLocal) {
      return {seqlen_q, seqlen_k, kBlockM, kBlockN, p.window_left, p.window_right};
    } else {
      return {seqlen_q, seqlen_k, kBlockM, kBlockN, -1, kCausal ? 0 : -1};
    }
  }
  CUTE_HOST_DEVICE static TileGeometry tile_geometry(Params const& p, SeqlenInfo const& sl) {
    return tile_geometry(p, sl.seqlen_q, sl.seqlen_k);
  }

  // First statistics row of (problem b, head h): its LSE / dPsum rows, its
  // dQ accumulator rows (times kHeadDim floats) and, divided by kBlockM, its
  // first semaphore.
  CUTE_HOST_DEVICE static int64_t stat_row(Params const& p, int b, int h) {
    if constexpr (kPacked) {
      return int64_t(h) * p.seqlen_q_rounded + packed_padded_offset(p.cu_seqlens_q[b], b, kBlockM);
    } else {
      return (int64_t(b) * p.heads + h) * p.seqlen_q_rounded;
    }
  }

  // KV tile kv of (problem sl, KV head h_kv) in the TMA view of a K-shaped
  // tensor: (kBlockN, kHeadDim) of K and dK, (kBlockN, kHeadDimV) of V and dV
  // (kValue).
  template <bool kValue, class TmaCopy>
  CUTE_DEVICE static auto kv_tile(TmaCopy const& tma, Params const& p, SeqlenInfo const& sl, int h_kv, int kv) {
    constexpr int kDim = kValue ? kHeadDimV : kHeadDim;
    return local_tile(rows_from<kPacked>(tma.get_tma_tensor(kValue ? shape_v(p) : p.shape_k)(
                                             _, _, h_kv, sl.tensor_batch),
                                         sl.offset_k),
                      Shape<Int<kBlockN>, Int<kDim>>{}, make_coord(kv, _0{}));
  }

  // dO's and V's (and dV's) shapes: Q's and K's with dv columns (common/problem_view.h).
  CUTE_HOST_DEVICE static GmemShape shape_do(Params const& p) { return value_shape<kHeadDim, kHeadDimV>(p.shape_q); }
  CUTE_HOST_DEVICE static GmemShape shape_v(Params const& p) { return value_shape<kHeadDim, kHeadDimV>(p.shape_k); }
};

}  // namespace dash_fa3::bwd
