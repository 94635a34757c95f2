// Numeric constants shared by host and device code (no CUDA or CuTe includes,
// so the torch binding compiled by the host compiler can use them too).
#pragma once

namespace dash_fa3 {

// log2(e): scores are scaled by it so the softmax can use exp2.
constexpr float kLog2e = 1.4426950408889634f;

// Dynamic shared memory one SM90 CTA may use (227 KiB): the budget every
// kernel's SharedStorage, and the forward's choice of O slots, are held to.
constexpr int kSm90SharedMemoryBytes = 227 * 1024;

// Whether setmaxnreg budgets (a producer warpgroup of 128 threads with
// producer_registers each, mma_warpgroups of 128 threads with mma_registers
// each) fit the registers a launch of one such CTA per SM holds: the SM90
// register file (64K) split evenly over its threads and rounded down to the
// allocation granularity of 8 (168 per thread for 384 threads, 128 for 512).
// setmaxnreg only moves registers within that allocation: an increase beyond
// it never completes and the kernel hangs.
constexpr bool setmaxnreg_budgets_fit(int mma_warpgroups, int producer_registers, int mma_registers) {
  int const threads = 128 * (1 + mma_warpgroups);
  int const launch_registers = 65536 / threads / 8 * 8;
  return 128 * (producer_registers + mma_warpgroups * mma_registers) <= launch_registers * threads;
}

}  // namespace dash_fa3
