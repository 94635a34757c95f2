// Named (hardware) barriers addressed by enum values. Each kernel declares its
// barriers as an enum class whose values are small integers; the ids are
// offset past the ids CUTLASS reserves for itself.
#pragma once

#include <cutlass/arch/barrier.h>

namespace dash_fa3 {

// Blocks until num_threads threads (a multiple of 32) have arrived at id.
template <class BarrierId>
CUTE_DEVICE void named_barrier_sync(BarrierId id, int num_threads) {
  cutlass::arch::NamedBarrier::sync(num_threads, static_cast<uint32_t>(id));
}

// Counts this warp's threads towards id without waiting.
template <class BarrierId>
CUTE_DEVICE void named_barrier_arrive(BarrierId id, int num_threads) {
  cutlass::arch::NamedBarrier::arrive(num_threads, static_cast<uint32_t>(id));
}

}  // namespace dash_fa3
