#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace dash_fa3 {

// Kernels report launch failures as exceptions; the binding turns them into
// Python errors. Never printf-and-continue.
inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("dash_fa3: ") + what + ": " + cudaGetErrorString(err));
  }
}

// Raises Kernel's dynamic shared-memory limit to `bytes` on the current device.
// The setting persists per device and the call costs microseconds of host time,
// so it runs once per (kernel, device); devices past 63 set it every time.
template <auto Kernel>
void set_max_dynamic_smem_once(int bytes, const char* what) {
  static std::atomic<uint64_t> done{0};  // bit d: set on device d
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t bit = device < 64 ? (uint64_t(1) << device) : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  check_cuda(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
  done.fetch_or(bit, std::memory_order_release);
}

}  // namespace dash_fa3
