// Small SM90 (Hopper) GEMM helpers shared by the attention kernels: shared
// memory atom selection for WGMMA operands, a warpgroup GEMM wrapper over CuTe
// tiled MMAs, re-viewing an accumulator fragment as a register A operand, and
// fragment type conversion.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_conversion.h>

namespace dash_fa3 {

// Widest swizzle whose atom divides the contiguous extent of the tile.
// kContig is the extent (in elements) along the operand's contiguous mode:
// the K extent for a K-major operand, the MN extent for an MN-major one.
template <cute::GMMA::Major kMajor, class T, int kContig>
CUTE_HOST_DEVICE constexpr auto gmma_smem_atom() {
  using namespace cute;
  constexpr int kElemsPer128B = 128 / int(sizeof(T));
  if constexpr (kMajor == GMMA::Major::K) {
    if constexpr (kContig % kElemsPer128B == 0) {
      return GMMA::Layout_K_SW128_Atom<T>{};
    } else if constexpr (kContig % (kElemsPer128B / 2) == 0) {
      return GMMA::Layout_K_SW64_Atom<T>{};
    } else {
      static_assert(kContig % (kElemsPer128B / 4) == 0, "K extent must be a multiple of 32 bytes");
      return GMMA::Layout_K_SW32_Atom<T>{};
    }
  } else {
    if constexpr (kContig % kElemsPer128B == 0) {
      return GMMA::Layout_MN_SW128_Atom<T>{};
    } else if constexpr (kContig % (kElemsPer128B / 2) == 0) {
      return GMMA::Layout_MN_SW64_Atom<T>{};
    } else {
      static_assert(kContig % (kElemsPer128B / 4) == 0, "MN extent must be a multiple of 32 bytes");
      return GMMA::Layout_MN_SW32_Atom<T>{};
    }
  }
}

// A pipeline state's stage index, broadcast from lane 0, for slicing WGMMA
// shared-memory operands. Every thread holds the same value, but ptxas cannot
// always prove it: descriptors built from a thread's own copy are then
// computed per thread and moved to uniform registers (R2UR) before every
// WGMMA (forward causal kernels: 32 R2UR per key block at hdim 128; backward
// at d = 192 with the deferred dK^T wait: 85M R2UR at full 8k).
template <class State>
CUTE_DEVICE int uniform_stage(State const& state) {
  return __shfl_sync(0xffffffff, state.index(), 0);
}

// Issues one warpgroup GEMM C (+)= A * B over all K slices of the fragments.
// kZeroInit: the first K slice overwrites C instead of accumulating.
// kWaitDepth: after committing, wait until at most this many WGMMA batches are
// in flight (-1: do not wait; the caller waits with cute::warpgroup_wait<N>).
template <bool kZeroInit, int kWaitDepth, class TiledMma, class FragA, class FragB, class FragC>
CUTE_DEVICE void warpgroup_gemm(TiledMma& mma, FragA const& a, FragB const& b, FragC& c) {
  using namespace cute;
  constexpr bool kARegisters = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  // The fences keep the compiler from moving register reads/writes of the
  // operands across the asynchronous WGMMA.
  if constexpr (kARegisters) { warpgroup_fence_operand(const_cast<FragA&>(a)); }
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) { mma.accumulate_ = GMMA::ScaleOut::Zero; }
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWaitDepth >= 0) { warpgroup_wait<kWaitDepth>(); }
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) { warpgroup_fence_operand(const_cast<FragA&>(a)); }
}

// An SM90 accumulator fragment of a 16-bit GEMM has layout ((2, 2, N/8), M, N')
// (column pair, row +8, 8-column block). The A operand of a register-sourced
// 16-bit WGMMA with K = 16 wants ((2, 2, 2), M, K/16): the same registers,
// with every two consecutive 8-column blocks forming one K slice.
template <class AccLayout>
CUTE_HOST_DEVICE constexpr auto accumulator_as_a_operand(AccLayout acc) {
  using namespace cute;
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(rank(get<0>(acc)))::value == 3);
  static_assert(decltype(size<0, 0>(acc))::value == 2 && decltype(size<0, 1>(acc))::value == 2);
  auto blocks = logical_divide(get<0, 2>(acc), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(blocks)),
                     get<1>(acc),
                     coalesce(make_layout(get<0, 1>(blocks), get<2>(acc))));
}

// Element-wise conversion between register fragments of equal size, done as
// one packed cutlass array conversion (bf16x2 / half2 conversions).
template <class FragIn, class FragOut>
CUTE_DEVICE void convert_fragment(FragIn const& in, FragOut& out) {
  using namespace cute;
  using From = typename FragIn::value_type;
  using To = typename FragOut::value_type;
  constexpr int kN = decltype(size(in))::value;
  static_assert(kN == decltype(size(out))::value);
  cutlass::NumericArrayConverter<To, From, kN> converter;
  *reinterpret_cast<cutlass::Array<To, kN>*>(out.data()) =
      converter(*reinterpret_cast<cutlass::Array<From, kN> const*>(in.data()));
}

}  // namespace dash_fa3
