// Timestamps of the backward's hand-offs, for measurement only (issue 15:
// hand-off latency, its spread and per-step jitter). A measurement build,
// never the default: DASH_FA3_BWD_TRACE=1 (tools/build_config.py
// MEASUREMENT_KNOBS) adds the trace buffers to BwdParams and the records
// below to the dQ writers and the row-split MMA warpgroups (d <= 128); in any
// other build the macros expand to nothing, so the kernels' code is unchanged.
//
// What is recorded (clock64 of the recording SM; %globaltimer next to some of
// them, from which the reader fits each SM's clock to the common time base):
//   per task row:  the CTA, its SM, and when the MMA warpgroups began it (the
//                  task announced, K landed), began its epilogue and ended it;
//                  when the producer issued its K and its V load
//   per (task, step):
//     dQ writer    before the semaphore wait, after it (deterministic only),
//                  after issuing the step's reduce-adds, after they were read
//                  (dq_empty arrived), after completion and release
//                  (deterministic only)
//     MMA wg 0     the step's start
//     MMA wg w     before and after its dq_empty wait (how long the MMA warps
//                  wait for the dQ writer: the deterministic mode's direct cost)
//     MMA wg 0     how long it waited for the step's Q and dO stages (the producer)
// benchmarks/cpp/bwd_bench.cu `trace` writes the buffers out;
// benchmarks/trace_summary.py reads them.
#pragma once

#include <cute/config.hpp>

#include <cstdint>

#include "common/params.h"  // DASH_FA3_BWD_TRACE
#include "schedules/schedule_metadata.h"

namespace dash_fa3::bwd::tracing {

// Layout of one (task, step) record: kNumStepFields int64 each, in
// (task row, step) order, trace_max_steps records per task row.
enum StepField : int {
  kWriterWait = 0,      // writer, before the semaphore wait (clock64)
  kWriterAcquired,      // writer, the semaphore holds its rank
  kWriterIssued,        // writer, every part's reduce-add issued
  kWriterRead,          // writer, every part read (dq_empty arrived)
  kWriterReleased,      // writer, adds complete and the semaphore incremented
  kWriterWaitNs,        // %globaltimer at kWriterWait
  kWriterAcquiredNs,    // %globaltimer at kWriterAcquired
  kWriterReleasedNs,    // %globaltimer at kWriterReleased
  kMmaStepBegin,        // MMA warpgroup 0, top of the step
  kMmaStepBeginNs,      // %globaltimer at kMmaStepBegin
  kMmaEmptyWait,        // MMA warpgroup w: before its dq_empty wait (+ 2 w)
  kMmaEmptyDone,        // MMA warpgroup w: after it (+ 2 w)
  kMmaQWait = 14,       // MMA warpgroup 0: its wait for the step's Q stage (and LSE), in clock64 cycles
  kMmaDoWait,           // MMA warpgroup 0: its wait for the step's dO stage (and dPsum), in cycles
  kNumStepFields = 16,
};

// One task-row record: kNumTaskFields int64.
enum TaskField : int {
  kTaskCta = 0,
  kTaskSm,
  kTaskBegin,    // MMA warpgroups: the task is announced and its K has landed (clock64)
  kTaskBeginNs,  // %globaltimer at kTaskBegin
  kTaskEnd,      // MMA warpgroups: after the task's epilogue (clock64)
  kTaskEndNs,
  kTaskEpilogue,  // MMA warpgroups: the task's steps done, its epilogue begins (clock64)
  kTaskKIssued,   // producer: sK free (kKEmpty), the task's K load issued (clock64)
  kTaskVIssued,   // producer: sV free (kVEmpty), the task's V load issued (clock64)
  kNumTaskFields = 12,
};

CUTE_DEVICE int64_t now_clock() { return clock64(); }

CUTE_DEVICE int64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return int64_t(t);
}

CUTE_DEVICE int sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return int(id);
}

#if DASH_FA3_BWD_TRACE
template <class Params>
CUTE_DEVICE void record_step(Params const& p, int32_t const* row, int step, int field, int64_t value) {
  int64_t const task = (row - p.tasks) / schedule::kNumCols;
  if (p.trace_steps != nullptr && step < p.trace_max_steps) {
    p.trace_steps[(task * p.trace_max_steps + step) * kNumStepFields + field] = value;
  }
}

template <class Params>
CUTE_DEVICE void record_task(Params const& p, int32_t const* row, int field, int64_t value) {
  int64_t const task = (row - p.tasks) / schedule::kNumCols;
  if (p.trace_tasks != nullptr) { p.trace_tasks[task * kNumTaskFields + field] = value; }
}

// Evaluates `value` only in a trace build.
#define DASH_FA3_TRACE_STEP(p, row, step, field, value) \
  ::dash_fa3::bwd::tracing::record_step(p, row, step, field, value)
#define DASH_FA3_TRACE_TASK(p, row, field, value) ::dash_fa3::bwd::tracing::record_task(p, row, field, value)
// Runs the statement(s) and, if `recorder`, records the cycles they took.
#define DASH_FA3_TRACE_TIMED(p, row, step, field, recorder, ...)                                        \
  do {                                                                                                  \
    int64_t const trace_t0_ = ::dash_fa3::bwd::tracing::now_clock();                                    \
    __VA_ARGS__;                                                                                        \
    if (recorder) {                                                                                     \
      ::dash_fa3::bwd::tracing::record_step(p, row, step, field, ::dash_fa3::bwd::tracing::now_clock() - trace_t0_); \
    }                                                                                                   \
  } while (0)
#else
#define DASH_FA3_TRACE_STEP(p, row, step, field, value) ((void)0)
#define DASH_FA3_TRACE_TASK(p, row, field, value) ((void)0)
#define DASH_FA3_TRACE_TIMED(p, row, step, field, recorder, ...) \
  do {                                                            \
    __VA_ARGS__;                                                  \
  } while (0)
#endif

}  // namespace dash_fa3::bwd::tracing
