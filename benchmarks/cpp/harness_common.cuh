// Helpers shared by the kernel harnesses (fwd_bench.cu, bwd_bench.cu): error
// checks, 16-bit conversions and counter-hash random numbers (reproducible
// inputs without a host RNG).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#define CHECK_CUDA(x)                                                               \
  do {                                                                              \
    cudaError_t err_ = (x);                                                         \
    if (err_ != cudaSuccess) {                                                      \
      throw std::runtime_error(std::string(#x) + ": " + cudaGetErrorString(err_)); \
    }                                                                               \
  } while (0)

template <class T> __device__ __host__ float to_float(T x);
template <> __device__ __host__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __host__ inline float to_float(__half x) { return __half2float(x); }
template <class T> __device__ T from_float(float x);
template <> __device__ inline __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <> __device__ inline __half from_float(float x) { return __float2half_rn(x); }

__device__ inline uint32_t hash32(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}

// A standard normal value for counter i of stream `seed` (Box-Muller).
__device__ inline float hash_normal(uint64_t seed, int64_t i) {
  float const u1 = (hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i) + 1.f) * 2.3283064e-10f;
  float const u2 = hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1) * 2.3283064e-10f;
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

// Busy-waits on the GPU for `ns` nanoseconds of the global timer.
static __global__ void gpu_spin_ns(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}

// Queued before a timed call's start event: the host work of the call
// (parameter and TMA-descriptor setup, tens of microseconds) then runs while
// the GPU spins, so the events measure GPU time only. Without it a sample
// started from an idle GPU and counted that host work, which made A/B
// comparisons of kernels disagree with their profiled kernel times.
inline void hide_host_time() { gpu_spin_ns<<<1, 1>>>(500 * 1000); }
