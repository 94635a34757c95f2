#pragma once

#include <cuda_runtime.h>

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

}  // namespace dash_fa3
