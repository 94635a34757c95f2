// Compile-time configuration of the Hopper forward kernel: tile sizes, warp
// roles, register budgets, shared-memory layouts, MMA and TMA types, the
// shared storage and the kernel parameter block. Everything the role files
// need is derived here from (head dims, element type, mask kind).
#pragma once

// Extended WGMMA N extents (kBlockN = 176, 112, 80); see fwd_launch.cuh.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <type_traits>

#include "common/block_range.h"
#include "common/constants.h"
#include "common/gemm_sm90.h"
#include "common/params.h"
#include "common/seqlen_info.h"

namespace dash_fa3::fwd {

using namespace cute;

// Warp roles. Warpgroup 0 is the producer (only its first warp works; the
// other three exit after giving their registers back); warpgroups 1.. are
// the MMA consumers, each owning 64 rows of the query tile (two or three of
// them: FwdTileConfig::kMmaWarpgroups).
enum class WarpRole : int { kProducer = 0, kMma = 1 };

// Named barriers of the forward kernel (hardware ids: common/named_barriers.h).
// (Q, K and V hand-offs between the producer and the MMA warpgroups use the
// mbarriers of their TMA pipelines, the packed documents' unit hand-off the
// mbarriers tile_full / tile_empty of SharedStorage, not named barriers.)
enum class FwdBarrier : uint32_t {
  // Turn tokens: MMA warpgroup w waits on kMmaTurn0 + w before issuing its
  // GEMMs of one step, then passes the turn to warpgroup w + 1 (round robin;
  // kMmaTurn2 only with three MMA warpgroups).
  kMmaTurn0 = 0,
  kMmaTurn1 = 1,
  kMmaTurn2 = 2,
  // The TMA epilogue (fwd_epilogue.h), per MMA warpgroup w (128 threads):
  // kOutput<w> orders its threads' shared-memory writes of O around the
  // store's issue.
  kOutput0 = 3,
  kOutput1 = 4,
  kOutput2 = 5,
  // One O slot shared by two warpgroups: warpgroup w syncs on kOutputTurn<w>
  // before writing the slot; the other warpgroup's issuing warp arrives once
  // the copy engine has read the slot.
  kOutputTurn0 = 6,
  kOutputTurn1 = 7,
  // O through V's buffer (FwdTraits::kOutputInV): every MMA thread syncs on
  // it once its last PV GEMM of the tile has retired, so no warpgroup writes
  // O over V while another still reads V.
  kOutputVFree = 8,
  kCount,
};

// Tile shape per head dim (16-bit inputs). kBlockM is 64 rows per MMA
// warpgroup: two (128 rows, 240 registers each) or, at hdim 64 without a
// diagonal, three (192 rows, 160 registers each; FA3 uses 192 rows at hdim 64
// for every mask): at d = 64 the softmax's exp2 (MUFU) work is as large as the
// tensor-core work, and a third warpgroup gives the tensor cores another one
// to run while two do their softmax. Full attention gains from 2k up and is
// level below; causal gains only at long lengths, as a 192-row tile crosses
// the diagonal in two key blocks (measured: docs/journal/code-comments.md),
// and the local kernels spill at 160 registers; the masks with a diagonal keep two, and dense causal
// switches to three from kCausalThreeWarpgroupsFrom query rows on (fwd_launch.cuh).
// kBlockN is as large as registers (S accumulator
// kBlockN/2 + P kBlockN/4 + O accumulator kHeadDimV/2 per thread, under the budget)
// and shared memory (kQStages x Q + kStages x (K + V) under 227 KiB) allow.
// Masks with a diagonal (causal, local) keep kBlockN = kBlockM at hdim <= 128
// so a diagonal costs a single masked block per Q tile (a window with both
// sides bounded has two). kQStages = 2 lets the producer load the next tile's Q
// while the current tile runs (no bubble between tiles); it does not fit in
// shared memory at hdim >= 192, nor next to kBlockN = 176 at hdim 128.
// Per (kHeadDim, kHeadDimV): V's head dim differs only at (192, 128) (MLA).
template <int kHeadDim, int kHeadDimV, bool kDiagonal>
struct FwdTileConfig;
template <bool kDiagonal> struct FwdTileConfig<64, 64, kDiagonal> {
  static constexpr int kMmaWarpgroups = kDiagonal ? 2 : 3, kBlockN = 128, kStages = 2, kQStages = 2;
};
template <bool kDiagonal> struct FwdTileConfig<96, 96, kDiagonal> {
  static constexpr int kMmaWarpgroups = 2, kBlockN = 128, kStages = 2, kQStages = 2;
};
template <bool kDiagonal> struct FwdTileConfig<128, 128, kDiagonal> {
  // Full: 128 x 176 with one Q stage measured faster than 128 x 160 with two.
  static constexpr int kMmaWarpgroups = 2, kBlockN = kDiagonal ? 128 : 176, kStages = 2,
                       kQStages = kDiagonal ? 2 : 1;
};
template <bool kDiagonal> struct FwdTileConfig<192, 192, kDiagonal> {
  static constexpr int kMmaWarpgroups = 2, kBlockN = 112, kStages = 2, kQStages = 1;
};
template <bool kDiagonal> struct FwdTileConfig<256, 256, kDiagonal> {
  static constexpr int kMmaWarpgroups = 2, kBlockN = 80, kStages = 2, kQStages = 1;
};
// MLA: FA3's 128 x 128 for this pair. The narrower V leaves room for 128 keys
// (registers: S 64 + P 32 + O 64 per thread, as at hdim 128 causal) and, with
// one Q stage (48 KiB; a second does not fit), 208 KiB of Q, K and V, so one
// O slot (16 KiB) fits beside them (FwdTraits::kOutputSlots).
template <bool kDiagonal> struct FwdTileConfig<192, 128, kDiagonal> {
  static constexpr int kMmaWarpgroups = 2, kBlockN = 128, kStages = 2, kQStages = 1;
};

// kHeadDimV_: the head dim of V and O (kHeadDim_ but for MLA's (192, 128)).
// kMmaWarpgroups_: 0 takes FwdTileConfig's; 2 or 3 overrides it (run_fwd's
// second tile for long causal sequences at hdim 64, fwd_launch.cuh).
// kOutputInV_: O leaves through V's buffer even where an O slot fits (run_fwd's
// second kernel for long keys where the two warpgroups would share one slot).
template <int kHeadDim_, int kHeadDimV_, class Element_, MaskKind kMask_, bool kPacked_, bool kSoftcap_,
          int kMmaWarpgroups_ = 0, bool kOutputInV_ = false>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  // The tile configs budget registers and shared memory for V no wider than
  // Q and K; 16-column multiples: the PV GEMM's N, stmatrix and the swizzle atoms.
  static_assert(kHeadDimV <= kHeadDim && kHeadDimV % 16 == 0, "value head dim: a multiple of 16, at most kHeadDim");
  static constexpr MaskKind kMask = kMask_;
  static constexpr bool kCausal = kMask == MaskKind::kCausal;
  // A runtime window (Params::window_left/right), masked on both sides.
  static constexpr bool kLocal = kMask == MaskKind::kLocal;
  // Packed documents (common/seqlen_info.h): each problem's lengths and rows
  // come from cu_seqlens. The dense instantiation reads the call's lengths
  // from the kernel parameters and has no per-document code.
  static constexpr bool kPacked = kPacked_;
  // Softcapped scores (common/softcap.h): a tanh per score before the mask.
  static constexpr bool kSoftcap = kSoftcap_;
  using TileConfig = FwdTileConfig<kHeadDim, kHeadDimV, kCausal || kLocal>;

  static constexpr int kNumMmaWarpgroups = kMmaWarpgroups_ == 0 ? TileConfig::kMmaWarpgroups : kMmaWarpgroups_;
  static_assert(kNumMmaWarpgroups == 2 || kNumMmaWarpgroups == 3, "two or three MMA warpgroups");
  static constexpr int kBlockM = 64 * kNumMmaWarpgroups;
  static constexpr int kBlockN = TileConfig::kBlockN;
  static constexpr int kStages = TileConfig::kStages;
  static constexpr int kQStages = TileConfig::kQStages;
  static_assert(kBlockN % 16 == 0, "kBlockN is the K extent of the PV GEMM");
  // Dense causal masks: single query tiles handed out longest first off a
  // counter (fwd_tile_scheduler.h), except at hdim 64 on two MMA warpgroups
  // (seqlen_q < kCausalThreeWarpgroupsFrom), whose tiles are short enough that
  // the hand-off per tile costs more than the balance gains, where the other
  // dense causal kernels gain (measured: docs/journal/code-comments.md). That
  // kernel keeps static pairs.
  static constexpr bool kDynamicCausalTiles =
      kCausal && !kPacked && !(kHeadDim == 64 && kNumMmaWarpgroups == 2);

  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kNumMmaThreads = kNumMmaWarpgroups * kThreadsPerWarpgroup;
  static constexpr int kNumProducerThreads = 32;  // one warp issues all TMA loads
  static constexpr int kNumThreads = kThreadsPerWarpgroup + kNumMmaThreads;
  // setmaxnreg budgets: 128 x 24 + 256 x 240 = 64512 = 384 x 168, 128 x 32 + 384 x 160 = 65536 = 512 x 128,
  // the whole of the launch's allocation (common/constants.h, setmaxnreg_budgets_fit).
  static constexpr int kProducerRegisters = kNumMmaWarpgroups == 2 ? 24 : 32;
  static constexpr int kMmaRegisters = kNumMmaWarpgroups == 2 ? 240 : 160;
  static_assert(kThreadsPerWarpgroup == 128 &&
                    setmaxnreg_budgets_fit(kNumMmaWarpgroups, kProducerRegisters, kMmaRegisters),
                "setmaxnreg budgets exceed the launch's register allocation");

  // GEMM shapes: S = Q K^T is (kBlockM, kBlockN, kHeadDim); O += P V is
  // (kBlockM, kHeadDimV, kBlockN) with P from registers and V MN-major.
  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kBlockN>>;
  using MmaWarpgroupLayout = Layout<Shape<Int<kNumMmaWarpgroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileShapeQK>(), MmaWarpgroupLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K, GMMA::Major::MN>(),
      MmaWarpgroupLayout{}));

  // Shared-memory layouts. Q and K are K-major (head dim contiguous); V is
  // stored as V^T viewed (head dim, key), MN-major, i.e. the same bytes as a
  // row-major (key, head dim) tile, which is what TMA copies from global.
  using SmemLayoutQ = decltype(tile_to_shape(
      gmma_smem_atom<GMMA::Major::K, Element, kHeadDim>(),
      Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      gmma_smem_atom<GMMA::Major::K, Element, kHeadDim>(),
      Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutVt = decltype(tile_to_shape(
      gmma_smem_atom<GMMA::Major::MN, Element, kHeadDimV>(),
      Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  // O leaves through shared memory and a TMA store per 64-row warpgroup slice
  // (fwd_epilogue.h): kOutputSlots 64-row buffers, one per MMA warpgroup where
  // they fit next to Q, K and V, one shared in turn where only one does (hdim
  // 128 without a diagonal: 128 x 176 tiles, and (192, 128)), none at hdim
  // 192 and 256 and with kOutputInV_, where kOutputInV below puts O in V's
  // buffer. (Packed documents store a document's last, partial tile from
  // registers: a TMA store clips at the tensor's end, not at the document's.)
  static constexpr int kSmemQKVBytes =
      ((kQStages * kBlockM + kStages * kBlockN) * kHeadDim + kStages * kBlockN * kHeadDimV) * int(sizeof(Element));
  static constexpr int kOutputSlotBytes = 64 * kHeadDimV * int(sizeof(Element));
  static constexpr int kSmemBarrierReserve = 1024;  // pipelines' mbarriers, padding
  static constexpr bool output_slots_fit(int slots) {
    return kSmemQKVBytes + slots * kOutputSlotBytes + kSmemBarrierReserve <= kSm90SharedMemoryBytes;
  }
  static constexpr int kOutputSlots = kOutputInV_                           ? 0
                                      : output_slots_fit(kNumMmaWarpgroups) ? kNumMmaWarpgroups
                                      : output_slots_fit(1)                 ? 1
                                                                            : 0;
  // Without slots, the warpgroups' O goes into V's buffer, both stages of
  // which are free between a tile's last PV GEMM and the next tile's first V
  // load: the producer holds that load until the copy engine has read O
  // (SharedStorage::o_read; fwd_producer.h), which FA3 does too. It is faster
  // than O written from registers: at hdim 192/256 most at short lengths, at
  // hdim 128 full from run_fwd's kSharedOutputSlotBelowKeys keys on (measured:
  // docs/journal/code-comments.md).
  static constexpr bool kOutputInV =
      kOutputSlots == 0 &&
      kNumMmaWarpgroups * kOutputSlotBytes <= kStages * kBlockN * kHeadDimV * int(sizeof(Element));
  static_assert(!kOutputInV_ || kOutputInV, "kOutputInV_: the warpgroups' O buffers fit in V's stages");
  static constexpr int kOutputBuffers = kOutputInV ? kNumMmaWarpgroups : kOutputSlots;
  static constexpr bool kTmaEpilogue = kOutputBuffers > 0;
  static_assert(kOutputSlots == 0 || kOutputSlots == kNumMmaWarpgroups || (kOutputSlots == 1 && kNumMmaWarpgroups == 2),
                "O slots: one per warpgroup, or one shared by two (kOutputTurn0/1)");
  using SmemLayoutO = decltype(tile_to_shape(
      gmma_smem_atom<GMMA::Major::K, Element, kHeadDimV>(),
      Shape<_64, Int<kHeadDimV>, Int<kOutputBuffers == 0 ? 1 : kOutputBuffers>>{}));
  static_assert(!kOutputInV || cosize_v<SmemLayoutO> <= cosize_v<SmemLayoutVt>,
                "kOutputInV: the warpgroups' O buffers fit in V's stages");
  // The epilogue re-reads the thread index per tile (FwdEpilogue::
  // tile_thread_index) where the addressing hoisted out of the tile loop
  // spilled: dense hdim 256 with a diagonal, 20 bytes (the tile counter, the
  // Q phase, an stmatrix offset) -> none, and faster. Elsewhere it is slower
  // (hdim 64, hdim 128 full), and in the packed kernels it moves their spills
  // onto the document's per-tile values and grows them (hdim 256 causal, 20 ->
  // 32 bytes; measured: docs/journal/code-comments.md).
  static constexpr bool kEpilogueIndexPerTile = !kPacked && kHeadDim == 256 && (kCausal || kLocal);
  // One warpgroup's PV GEMM: the register layout of its 64 rows of O, which
  // the stmatrix copy into an O slot partitions.
  using TiledMmaPVWarpgroup = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDimV>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>()));

  // kQPerWarpgroup: each MMA warpgroup's 64 rows of the single Q stage are a
  // pipeline stage of their own: a warpgroup releases its rows once its last
  // S GEMM of the tile retires and waits only for its own rows of the next
  // tile, so the first warpgroup of the ping-pong need not wait for the
  // second one's last S GEMM before the producer reloads its rows. It gains at
  // hdim 128 full (one Q stage, 176-key blocks) at short lengths and costs at
  // hdim 256 (80-key blocks), so only hdim 128 has it (measured:
  // docs/journal/code-comments.md).
  static constexpr bool kQPerWarpgroup = kQStages == 1 && kHeadDim == 128;
  // TMA loads (Q pipeline stages) per tile's Q, their rows, and the
  // SmemLayoutQ stage that Q pipeline stage i fills: producer and MMA
  // warpgroups index both with these.
  static constexpr int kQLoadsPerTile = kQPerWarpgroup ? kNumMmaWarpgroups : 1;
  static constexpr int kQPipelineStages = kQStages * kQLoadsPerTile;
  static constexpr int kQRowsPerLoad = kBlockM / kQLoadsPerTile;
  CUTE_HOST_DEVICE static constexpr int q_smem_stage(int q_pipeline_stage) { return q_pipeline_stage / kQLoadsPerTile; }
  // One load's rows of one Q stage, at their place in SmemLayoutQ's stage.
  using SmemLayoutQLoad = std::conditional_t<
      kQPerWarpgroup,
      decltype(composition(take<0, 2>(SmemLayoutQ{}),
                           make_layout(Shape<Int<kQRowsPerLoad>, Int<kHeadDim>>{}, make_stride(_1{}, Int<kBlockM>{})))),
      decltype(take<0, 2>(SmemLayoutQ{}))>;
  static constexpr uint32_t kTmaBytesQ = kQRowsPerLoad * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesV = kBlockN * kHeadDimV * sizeof(Element);

  // Global views as TMA sees them: Q/K/V as (row, dim, head, batch) and V^T
  // as (dim, row, head, batch); the head dim is contiguous, the rest strided.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemStrideT = Stride<_1, int64_t, int64_t, int64_t>;
  using TmaQ = decltype(make_tma_copy(
      SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutQLoad{}, Shape<Int<kQRowsPerLoad>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(
      SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}),
      take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(
      SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStrideT{}),
      take<0, 2>(SmemLayoutVt{}), Shape<Int<kHeadDimV>, Int<kBlockN>>{}, _1{}));
  // O as (row, dim, head, batch) (shape_o); rows past seqlen_q are clipped
  // by the copy engine.
  using TmaO = decltype(make_tma_copy(
      SM90_TMA_STORE{},
      make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{}, GmemStride{}),
      take<0, 2>(SmemLayoutO{}), Shape<_64, Int<kHeadDimV>>{}, _1{}));

  // Q, K and V each have a TMA pipeline: full barriers complete on the TMA
  // transaction bytes, empty barriers when all MMA threads released.
  using PipelineQ = cutlass::PipelineTmaAsync<kQPipelineStages>;
  using PipelineStateQ = typename PipelineQ::PipelineState;
  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineKV::PipelineState;

  struct OutputBuffer {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutO>> o;
  };
  struct NoOutputBuffer {};

  // 128-byte swizzled TMA destinations (and sources) must be 1024-byte aligned.
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutVt>> v;
    std::conditional_t<(kOutputSlots > 0), OutputBuffer, NoOutputBuffer> out;
    // kOutputInV: completes a phase per tile once every MMA warpgroup's O
    // has left V's buffer (one arrival per warpgroup).
    alignas(8) uint64_t o_read;
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename PipelineKV::SharedStorage pipeline_k;
    alignas(16) typename PipelineKV::SharedStorage pipeline_v;
    // Dynamic scheduling (packed documents, dense causal masks): the unit of
    // the current round and its hand-off from the producer warp to the MMA
    // threads (fwd_tile_scheduler.h).
    int tile_unit;
    alignas(8) uint64_t tile_full;
    uint64_t tile_empty;
  };
  static constexpr int kSharedStorageBytes = int(sizeof(SharedStorage));
  static_assert(kSharedStorageBytes <= kSm90SharedMemoryBytes, "shared memory budget of one SM90 CTA");

  // Kernel parameters (passed as a __grid_constant__ so the TMA descriptors
  // stay in parameter space).
  struct Params {
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
    TmaO tma_o;          // kTmaEpilogue only
    GmemShape shape_q;   // (seqlen_q, d, heads, batch); O's with dv (shape_o)
    GmemShape shape_k;   // (seqlen_k, d, heads_kv, batch)
    GmemShape shape_vt;  // (dv, seqlen_k, heads_kv, batch)
    void* o;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    float* lse;
    int64_t lse_batch_stride, lse_head_stride;
    // Packed documents (common/seqlen_info.h): batch + 1 offsets each, or
    // nullptr for a dense batch. Packed, seqlen_q / seqlen_k are the longest
    // document's (max_seqlen_q / _k: they size the tile scheduler's units).
    int const* cu_seqlens_q;
    int const* cu_seqlens_k;
    int* packed_order;  // packed: the documents' order and the tile counter (common/packed_order.h)
    int* tile_counter;  // dense causal: the tile counter (fwd_tile_scheduler.h)
    int seqlen_q, seqlen_k, heads, batch;
    int q_heads_per_kv_head;
    // The softmax's scale of the scores it sees (common/softcap.h: softmax_scale,
    // or softcap with kSoftcap), plain and times log2(e).
    float score_scale, score_scale_log2;
    float softcap_prescale;  // kSoftcap: scores are tanh(QK^T * softcap_prescale)
    // Tile scheduler.
    int num_m_blocks;
    int num_units;          // scheduling units (tiles, or causal tile pairs), see fwd_tile_scheduler.h;
                            // packed: a bound (the call's count: packed_order_units)
    int heads_per_section;  // (batch, head) pairs per section (fwd_tile_scheduler.h), set by launch_fwd
    // kLocal: the window with an unbounded side as a bound that masks
    // nothing (left: seqlen_k, right: seqlen_q; the block ranges are the same,
    // see make_fwd_params), so the device code has no -1 case. Unused otherwise
    // (last, so the other fields keep their offsets).
    int window_left, window_right;
  };

  // O's shape for its TMA store (common/problem_view.h).
  CUTE_HOST_DEVICE static GmemShape shape_o(Params const& p) { return value_shape<kHeadDim, kHeadDimV>(p.shape_q); }

  // The lengths and rows of problem (document) b.
  CUTE_HOST_DEVICE static SeqlenInfo seqlens(Params const& p, int b) { return problem_seqlens<kPacked>(p, b); }

  // Block ranges of one (batch, head) with lengths sl and this kernel's tiles;
  // the full and causal windows are constants, so their window tests fold away.
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
};

}  // namespace dash_fa3::fwd
