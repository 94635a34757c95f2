// Named (hardware) barriers addressed by enum values. Each kernel declares its
// barriers as an enum class of small integers ending in kCount; value v is
// hardware barrier 1 + v. Id 0 is __syncthreads. Our kernels use no CUTLASS
// collective that synchronises on the ids CUTLASS reserves for itself (1-7),
// so all 15 are ours: the backward needs 12 (a per-warpgroup dQ hand-off with
// two sdQ buffers), more than the 8 left above CUTLASS's reservation.
#pragma once

#include <cute/config.hpp>

#include <cstdint>

namespace dash_fa3 {

constexpr uint32_t kNumNamedBarriers = 15;

template <class BarrierId>
CUTE_DEVICE uint32_t named_barrier_hw_id(BarrierId id) {
  static_assert(static_cast<uint32_t>(BarrierId::kCount) <= kNumNamedBarriers, "more named barriers than the SM has");
  return 1u + static_cast<uint32_t>(id);
}

// Blocks until num_threads threads (a multiple of 32) have arrived at id.
template <class BarrierId>
CUTE_DEVICE void named_barrier_sync(BarrierId id, int num_threads) {
  asm volatile("bar.sync %0, %1;" : : "r"(named_barrier_hw_id(id)), "r"(num_threads) : "memory");
}

// Counts this warp's threads towards id without waiting.
template <class BarrierId>
CUTE_DEVICE void named_barrier_arrive(BarrierId id, int num_threads) {
  asm volatile("bar.arrive %0, %1;" : : "r"(named_barrier_hw_id(id)), "r"(num_threads) : "memory");
}

}  // namespace dash_fa3
