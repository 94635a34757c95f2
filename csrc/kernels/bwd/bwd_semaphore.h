// Inter-CTA semaphores of the deterministic backward, and the bulk reduce-add
// and bulk-group waits they order. One int32 counter per dQ tile. A
// contribution of rank r waits until the counter reads r, adds (rank 0:
// stores, so the accumulator starts out unwritten), waits for its add to
// complete, then sets the counter to r + 1. Counters start at zero (the
// preprocess zeroes them); after the kernel a counter holds its tile's number
// of contributions, 0 for a tile nobody wrote (the postprocess reads it so).
//
// Memory ordering. The adds into the fp32 dQ accumulator are done by the bulk
// copy engine (async proxy); the counter is an ordinary global int (generic
// proxy).
//   release side: [adds complete] -> fence.proxy.async.global (orders the
//                 completed async-proxy writes before this thread's later
//                 generic accesses) -> red.release.gpu (gpu-scope release:
//                 everything this thread has observed so far, the completed
//                 adds included, happens before any acquire that reads it)
//   acquire side: ld.acquire.gpu spin until the counter == rank ->
//                 fence.proxy.async.global (orders the acquire before the
//                 async-proxy reduce this thread issues next)
// "Complete" for the bulk reduce is cp.async.bulk.wait_group 0, not the .read
// variant: .read only says the engine has finished READING shared memory; the
// global writes may still be in flight, and a release after it would let the
// next rank's add race with ours (suspected in flash-attention issue 2244).
#pragma once

#include <cute/arch/util.hpp>
#include <cute/config.hpp>

#include <cstdint>

namespace dash_fa3::bwd {

CUTE_DEVICE int semaphore_load_acquire(int const* sem) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem) : "memory");
  return v;
}

// Spins until *sem == rank (one thread).
CUTE_DEVICE void semaphore_wait_for(int const* sem, int rank) {
  while (semaphore_load_acquire(sem) != rank) {}
}

// Adds 1 to *sem with gpu-scope release semantics (one thread).
CUTE_DEVICE void semaphore_release_increment(int* sem) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" : : "l"(sem) : "memory");
}

// Adds n to *sem with gpu-scope release semantics (one thread).
CUTE_DEVICE void semaphore_release_add(int* sem, int n) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" : : "l"(sem), "r"(n) : "memory");
}

// Orders this thread's generic-proxy and async-proxy global accesses.
CUTE_DEVICE void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Adds `bytes` (a multiple of 16; both addresses 16-byte aligned) of fp32
// from shared memory into global memory, element by element, as one bulk
// async operation of the async proxy (one thread). A plain 1-D copy: the dQ
// tiles are contiguous in both places (common/dq_accum_layout.h), so no tensor
// map is needed. Completes with the bulk async-group it is committed to
// (cute's tma_store_arrive commits the group). `l2_policy` is an L2 cache
// policy (cute's TMA::CacheHintSm90 values).
CUTE_DEVICE void bulk_reduce_add_f32(float* gmem, float const* smem, uint32_t bytes, uint64_t l2_policy) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, %3;"
               :
               : "l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes), "l"(l2_policy)
               : "memory");
}

// Copies `bytes` of fp32 from shared to global memory as one bulk async
// operation (one thread): bulk_reduce_add_f32's form, with the sum replaced by
// the source. A dQ tile's first add in the rank order stores this way, so the
// accumulator needs no zeroing; its ordering is the add's (same proxy, same
// bulk group, same completion wait before the release).
CUTE_DEVICE void bulk_store_f32(float* gmem, float const* smem, uint32_t bytes, uint64_t l2_policy) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;"
               :
               : "l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes), "l"(l2_policy)
               : "memory");
}

// bulk_store_f32 if `store`, else bulk_reduce_add_f32.
CUTE_DEVICE void bulk_store_or_add_f32(bool store, float* gmem, float const* smem, uint32_t bytes,
                                       uint64_t l2_policy) {
  if (store) {
    bulk_store_f32(gmem, smem, bytes, l2_policy);
  } else {
    bulk_reduce_add_f32(gmem, smem, bytes, l2_policy);
  }
}

// Waits until every bulk async-group this thread committed has COMPLETED,
// its global writes included.
CUTE_DEVICE void bulk_wait_all_complete() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Waits until all but the kPending most recent bulk async-groups this thread
// committed have finished reading their shared-memory sources (the writes may
// still be in flight).
template <int kPending>
CUTE_DEVICE void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" : : "n"(kPending) : "memory");
}

// Waits until every bulk async-group this thread committed has finished
// reading its shared-memory source.
CUTE_DEVICE void bulk_wait_all_read() { bulk_wait_read<0>(); }

}  // namespace dash_fa3::bwd
