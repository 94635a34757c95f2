// The packed forward's order kernel, one launch before the main kernel: the
// documents in descending key blocks and the first unit of each
// (common/packed_order.h), and the tile counter zeroed. One CTA: a counting
// sort over kPackedOrderBuckets buckets in shared memory, then a running scan
// of the units in the sorted order.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <stdexcept>

#include "common/cuda_check.h"
#include "common/launch.h"
#include "common/packed_order.h"

namespace dash_fa3 {
namespace {

constexpr int kThreads = 1024;
constexpr int kBucketsPerThread = kPackedOrderBuckets / kThreads;
static_assert(kPackedOrderBuckets % kThreads == 0, "buckets are scanned in a blocked arrangement");

__global__ void __launch_bounds__(kThreads) fwd_packed_order_kernel(FwdPackedOrderParams const p) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int cursor[kPackedOrderBuckets];
  int const tid = threadIdx.x;
  int* const documents = p.order + packed_order_document_index(p.batch, 0);

  auto bucket_of = [&](int d) { return packed_order_bucket(p.cu_seqlens_k[d + 1] - p.cu_seqlens_k[d], p.block_n); };

  for (int i = tid; i < kPackedOrderBuckets; i += kThreads) { cursor[i] = 0; }
  __syncthreads();
  for (int d = tid; d < p.batch; d += kThreads) { atomicAdd(&cursor[bucket_of(d)], 1); }
  __syncthreads();

  // Each bucket's first position: an exclusive scan of the counts, thread t
  // owning buckets [t * kBucketsPerThread, (t + 1) * kBucketsPerThread).
  int counts[kBucketsPerThread];
  for (int i = 0; i < kBucketsPerThread; ++i) { counts[i] = cursor[tid * kBucketsPerThread + i]; }
  Scan(scan_storage).ExclusiveSum(counts, counts);
  for (int i = 0; i < kBucketsPerThread; ++i) { cursor[tid * kBucketsPerThread + i] = counts[i]; }
  __syncthreads();

  // Scatter: within a bucket the atomics pick the order (see packed_order.h).
  for (int d = tid; d < p.batch; d += kThreads) { documents[atomicAdd(&cursor[bucket_of(d)], 1)] = d; }
  // Global writes of this CTA are visible to its threads after the barrier.
  __syncthreads();

  // First units in the sorted order, kThreads documents per step; the scan's
  // storage is reused, hence the barrier closing each step.
  int first_of_step = 0;
  for (int s0 = 0; s0 < p.batch; s0 += kThreads) {
    int const s = s0 + tid;
    int units = 0;
    if (s < p.batch) {
      int const d = documents[s];
      int const seqlen_q = p.cu_seqlens_q[d + 1] - p.cu_seqlens_q[d];
      units = fwd_units_per_head((seqlen_q + p.block_m - 1) / p.block_m, p.causal_pairs) * p.heads;
    }
    int first = 0, step_units = 0;
    Scan(scan_storage).ExclusiveSum(units, first, step_units);
    if (s < p.batch) { p.order[packed_order_first_index(s)] = first_of_step + first; }
    first_of_step += step_units;
    __syncthreads();
  }
  if (tid == 0) {
    p.order[kPackedOrderUnitsIndex] = first_of_step;
    p.order[packed_order_first_index(p.batch)] = first_of_step;
    p.order[packed_order_counter_index(p.batch)] = 0;
  }
}

}  // namespace

void run_fwd_packed_order(const FwdPackedOrderParams& params, cudaStream_t stream) {
  if (params.batch < 1 || params.heads < 1 || params.block_m < 1 || params.block_n < 1 || params.order == nullptr) {
    throw std::invalid_argument("dash_fa3: the packed forward's order needs batch, heads, tile sizes >= 1 and a buffer");
  }
  fwd_packed_order_kernel<<<1, kThreads, 0, stream>>>(params);
  check_cuda(cudaGetLastError(), "fwd_packed_order launch");
}

}  // namespace dash_fa3
