// How fast the L2 takes the dQ adds of the backward, by kind of add: the
// question behind an order-free exact dQ accumulation (64-bit fixed point,
// whose integer adds commute) is whether 64-bit reduce-adds carry twice the
// bytes of the fp32 ones at the rate the kernel issues them.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/cpp/reduce_bench.cu -o reduce_bench
//   ./reduce_bench [n_tiles ...]
//
// Every CTA adds tiles of 64 x 128 elements (one dQ tile of the hdim-128
// kernel) into n_tiles accumulator tiles, tile (cta + step * ctas) % n_tiles at
// each step, as the backward's CTAs add into the Q tiles of their heads. Kinds:
//   bulk f32      cp.reduce.async.bulk .add.f32 from shared memory, two 32 KB
//                 buffers (the kernel's hand-off), one thread issues
//   bulk u64 1buf cp.reduce.async.bulk .add.u64, one 64 KB buffer: each step
//                 waits until the previous one's source has been read
//   bulk u64 2buf the same with two 64 KB buffers
//   red u64       red.global.add.u64 from registers, 32 per thread, a warp's
//                 32 lanes on 32 consecutive elements
//   red f32       red.global.add.f32, the same pattern
// Prints GB/s counted in fp32 elements (4 bytes each) so the kinds compare
// by the dQ they carry.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                           \
  do {                                                                                     \
    cudaError_t e = (x);                                                                   \
    if (e != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));       \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

constexpr int kTile = 64 * 128;
constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <bool kU64>
__device__ __forceinline__ void bulk_add(void* gmem, const void* smem, uint32_t bytes) {
  if constexpr (kU64) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;"
                 :: "l"(gmem), "r"(smem_addr(smem)), "r"(bytes) : "memory");
  } else {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(gmem), "r"(smem_addr(smem)), "r"(bytes) : "memory");
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(kPending) : "memory");
}

// kind 0: bulk f32 (2 buffers), 1: bulk u64 (1 buffer), 2: bulk u64 (2 buffers)
template <int kKind>
__global__ void bulk_kernel(void* acc, int n_tiles, int steps) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr bool kU64 = kKind != 0;
  constexpr int kElem = kU64 ? 8 : 4;
  constexpr uint32_t kBufBytes = kTile * kElem;
  constexpr int kBufs = kKind == 1 ? 1 : 2;
  for (int i = threadIdx.x; i < kBufs * kTile; i += blockDim.x) {
    if constexpr (kU64) {
      reinterpret_cast<int64_t*>(smem)[i] = int64_t(i % 7) - 3;
    } else {
      reinterpret_cast<float*>(smem)[i] = float(i % 7) - 3.f;
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x != 0) { return; }
  for (int s = 0; s < steps; ++s) {
    int const t = (blockIdx.x + s * gridDim.x) % n_tiles;
    unsigned char* dst = static_cast<unsigned char*>(acc) + size_t(t) * kBufBytes;
    unsigned char const* src = smem + (s % kBufs) * kBufBytes;
    // Two halves, as the two MMA warpgroups hand them over.
    bulk_add<kU64>(dst, src, kBufBytes / 2);
    bulk_add<kU64>(dst + kBufBytes / 2, src + kBufBytes / 2, kBufBytes / 2);
    if constexpr (kBufs == 1) {
      wait_read<0>();
    } else {
      wait_read<2>();
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// kind 3: red u64, 4: red f32
template <int kKind>
__global__ void red_kernel(void* acc, int n_tiles, int steps) {
  constexpr int kPer = kTile / kThreads;
  for (int s = 0; s < steps; ++s) {
    int const t = (blockIdx.x + s * gridDim.x) % n_tiles;
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      int const e = r * kThreads + threadIdx.x;
      if constexpr (kKind == 3) {
        unsigned long long* p = static_cast<unsigned long long*>(acc) + size_t(t) * kTile + e;
        asm volatile("red.global.add.u64 [%0], %1;" :: "l"(p), "l"((unsigned long long)(r + s)) : "memory");
      } else {
        float* p = static_cast<float*>(acc) + size_t(t) * kTile + e;
        asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(float(r))  : "memory");
      }
    }
  }
}

template <class K>
float time_kernel(K kernel, int ctas, size_t smem, void* acc, int n_tiles, int steps) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  kernel<<<ctas, kThreads, smem>>>(acc, n_tiles, steps);  // warm-up
  CHECK(cudaGetLastError());
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(a));
    kernel<<<ctas, kThreads, smem>>>(acc, n_tiles, steps);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    best = ms < best ? ms : best;
  }
  CHECK(cudaGetLastError());
  return best;
}

int main(int argc, char** argv) {
  std::vector<int> tiles;
  for (int i = 1; i < argc; ++i) { tiles.push_back(std::atoi(argv[i])); }
  if (tiles.empty()) { tiles = {16, 64, 512, 4096}; }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int const ctas = prop.multiProcessorCount;
  int const steps = 400;
  std::printf("device %s, %d SMs, L2 %d MB; %d CTAs x %d steps of a 64x128 tile\n", prop.name, ctas,
              prop.l2CacheSize >> 20, ctas, steps);
  size_t const max_tiles = 4096;
  void* acc;
  CHECK(cudaMalloc(&acc, max_tiles * kTile * 8));
  CHECK(cudaMemset(acc, 0, max_tiles * kTile * 8));
  CHECK(cudaFuncSetAttribute(bulk_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * kTile * 4));
  CHECK(cudaFuncSetAttribute(bulk_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kTile * 8));
  CHECK(cudaFuncSetAttribute(bulk_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * kTile * 8));
  double const elems = double(ctas) * steps * kTile;
  std::printf("%8s %14s %14s %14s %14s %14s\n", "n_tiles", "bulk_f32", "bulk_u64_1buf", "bulk_u64_2buf",
              "red_u64", "red_f32");
  for (int n : tiles) {
    if (size_t(n) > max_tiles) { continue; }
    float ms[5];
    ms[0] = time_kernel(bulk_kernel<0>, ctas, 2 * kTile * 4, acc, n, steps);
    ms[1] = time_kernel(bulk_kernel<1>, ctas, kTile * 8, acc, n, steps);
    ms[2] = time_kernel(bulk_kernel<2>, ctas, 2 * kTile * 8, acc, n, steps);
    ms[3] = time_kernel(red_kernel<3>, ctas, 0, acc, n, steps);
    ms[4] = time_kernel(red_kernel<4>, ctas, 0, acc, n, steps);
    std::printf("%8d", n);
    for (float m : ms) { std::printf(" %9.0f GB/s", elems * 4 / (m * 1e-3) / 1e9); }
    std::printf("\n");
  }
  // Per-step time of each kind at 512 tiles, for the kernel's step budget.
  std::printf("us per step per CTA at 512 tiles: ");
  {
    float const m0 = time_kernel(bulk_kernel<0>, ctas, 2 * kTile * 4, acc, 512, steps);
    float const m1 = time_kernel(bulk_kernel<1>, ctas, kTile * 8, acc, 512, steps);
    float const m2 = time_kernel(bulk_kernel<2>, ctas, 2 * kTile * 8, acc, 512, steps);
    float const m3 = time_kernel(red_kernel<3>, ctas, 0, acc, 512, steps);
    std::printf("bulk_f32 %.3f bulk_u64_1buf %.3f bulk_u64_2buf %.3f red_u64 %.3f\n", m0 * 1e3 / steps,
                m1 * 1e3 / steps, m2 * 1e3 / steps, m3 * 1e3 / steps);
  }
  CHECK(cudaFree(acc));
  return 0;
}
