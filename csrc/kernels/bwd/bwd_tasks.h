// Which task rows of the schedule a CTA runs, in which order. Every role
// (producer, MMA, dQ writer) runs the same rows in the same order and decodes
// each step itself, so no step is passed between warps.
//
// Static dispatch (header[dispatch] == 0): CTA c runs rows [cta_offsets[c],
// cta_offsets[c + 1]) in order; the producer and the dQ writers walk them on
// their own.
//
// Dynamic dispatch (header[dispatch] == 1, the queue schedules fa3, spt,
// descending, lpt): the rows are one queue that CTAs claim from as they free
// up, as the schedules define them (dash_fa3/schedule/schedules.py). The
// producer claims the next row with an atomic add on a per-call counter (the
// preprocess zeroes it) and passes the index to the dQ writers through a ring
// of kTaskRing slots in shared memory: full[i] (one arrival, the producer's)
// says slot i holds an index, empty[i] (one arrival per writer warp) that both
// writers have read it. Index -1 ends the loop. The MMA warpgroups learn
// their tasks, in either dispatch, from the producer's announcement on k_full
// (bwd_producer.h): a ring read of their own made ptxas spill in their
// step loop, which has no register to spare.
// Claims follow the queue order over the whole grid, and a row only waits on
// rows before it in the queue (deterministic mode), so the earliest
// unfinished row can always run: every CTA is resident (grid <= SMs) and runs
// its rows in claim order.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

namespace dash_fa3::bwd {

// Slots of the task ring: the producer claims at most this many tasks ahead
// of the dQ writers; kKEmpty already keeps it within two of the MMA warps.
constexpr int kTaskRing = 4;

struct TaskRingStorage {
  alignas(8) cutlass::arch::ClusterBarrier full[kTaskRing];
  alignas(8) cutlass::arch::ClusterBarrier empty[kTaskRing];
  int index[kTaskRing];
  // The MMA warpgroups' next task (-1: none left), both dispatches: written by
  // the producer before it arrives on k_full, read by the MMA warps after
  // their k_full wait; rewritten only after they arrive on kKEmpty.
  int announced;
};

// One role's walk over its CTA's task rows. next() returns the next row or -1.
// Two registers: static, the next row and the end of the CTA's range;
// dynamic, the number of rows taken from the ring so far (its slot and phase)
// and kDynamic in place of the end.
struct TaskCursor {
  static constexpr int kDynamic = -1;
  int pos, end;

  CUTE_DEVICE bool dynamic() const { return end == kDynamic; }

  CUTE_DEVICE static TaskCursor of(int32_t const* cta_offsets, int const* counter) {
    if (counter != nullptr) { return {0, kDynamic}; }
    return {cta_offsets[blockIdx.x], cta_offsets[blockIdx.x + 1]};
  }

  // Called once, by one thread, before the block-wide barrier that publishes
  // the inits; consumer_warps: the warps that read every slot (the dQ writers).
  CUTE_DEVICE static void init(TaskRingStorage& ring, int consumer_warps) {
    for (int i = 0; i < kTaskRing; ++i) {
      ring.full[i].init(1);
      ring.empty[i].init(consumer_warps);
    }
  }

  // The producer warp (all lanes): claims the next row of the queue.
  CUTE_DEVICE int claim(TaskRingStorage& ring, int* counter, int num_tasks) {
    if (!dynamic()) { return pos < end ? pos++ : -1; }
    int const slot = pos % kTaskRing, phase = (pos / kTaskRing) & 1;
    ++pos;
    // Wait until every consumer has read what this slot held kTaskRing claims
    // ago (a fresh barrier counts as read: the producer starts one phase ahead).
    ring.empty[slot].wait(phase ^ 1);
    int row = 0;
    if (cute::elect_one_sync()) {
      row = atomicAdd(counter, 1);
      row = row < num_tasks ? row : -1;
      ring.index[slot] = row;
      // Slot written: the consumers may read it (arrive releases the store).
      ring.full[slot].arrive();
    }
    return __shfl_sync(0xffffffff, row, 0);
  }

  // A dQ writer warp (all lanes): the row the producer claimed next.
  CUTE_DEVICE int next(TaskRingStorage& ring) {
    if (!dynamic()) { return pos < end ? pos++ : -1; }
    int const slot = pos % kTaskRing, phase = (pos / kTaskRing) & 1;
    ++pos;
    // Wait until the producer has written this slot.
    ring.full[slot].wait(phase);
    int const row = ring.index[slot];
    __syncwarp();
    // This warp has read the slot: one of the writers' arrivals.
    if (cute::elect_one_sync()) { ring.empty[slot].arrive(); }
    return row;
  }
};

}  // namespace dash_fa3::bwd
