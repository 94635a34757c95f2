// Host launcher of the backward main kernel: defines dash_fa3::run_bwd
// (declared in common/launch.h). Each instantiation file includes this header
// once.
//
// Requirements on the inputs (checked here, cheaply, with a clear error):
//   - q, k, v, dout, dk, dv 16-byte aligned, their strides multiples of 8
//     elements (TMA needs 16-byte aligned strides);
//   - headdim == kHeadDim, headdim_v == kHeadDimV; heads % heads_kv == 0; seqlen_q_rounded is seqlen_q
//     rounded up to bwd_block_m(kHeadDim) (kernel_contract.h), or with packed
//     documents (cu_seqlens_q/k) the padded total of common/seqlen_info.h;
//   - dq_accum (batch, heads, seqlen_q_rounded, headdim) fp32, zeroed, 128-byte
//     aligned; the kernel adds each Q tile into it in fragment order
//     (common/dq_accum_layout.h), which the postprocess reads back;
//   - the schedule header matches this call (shape, block sizes, mask kind,
//     window: local kernels the call's, full/causal their fixed one; the
//     full and causal kernels do not read the call's window); its CTA count is the grid size; dynamic
//     dispatch (bwd_tasks.h) needs task_counter, zeroed. The schedule
//     must have been validated (every needed pair once, ranks a permutation,
//     no wait cycle for this grid) by dash_fa3.schedule before launch;
//   - GQA (heads != heads_kv): dk_partial, dv_partial given; the kernel
//     leaves each query head's dK/dV there in fp32 and the postprocess
//     (run_bwd_postprocess) sums each group's heads and casts into dk/dv.
//     MHA takes the same path when they are given (fp32 dK/dV, bwd_dkv_fp32);
//     dk, dv then only back the unused TMA store descriptors.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cute/tensor.hpp>

#include "common/constants.h"
#include "common/cuda_check.h"
#include "common/dtype.h"
#include "common/launch.h"
#include "common/params.h"
#include "common/softcap.h"
#include "kernels/bwd/bwd_epilogue.h"
#include "kernels/bwd/bwd_kernel.h"
#include "kernels/bwd/bwd_traits.h"
#include "schedules/schedule_metadata.h"

namespace dash_fa3 {

namespace bwd {

inline void require(bool ok, const std::string& what) {
  if (!ok) { throw std::invalid_argument("dash_fa3 bwd: " + what); }
}

inline bool aligned(const void* ptr, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; }

inline bool tma_strides_ok(TensorStrides const& s) {
  return s.batch % 8 == 0 && s.row % 8 == 0 && s.head % 8 == 0;
}

// Checks the host copy of the schedule header against the call.
template <class Traits>
void check_schedule_header(BwdParams const& a) {
  namespace S = schedule;
  int32_t const* h = a.schedule_header_host;
  require(a.schedule != nullptr && h != nullptr, "schedule (device buffer and host header) must be given");
  require(h[S::kHMagic] == S::kMagic && h[S::kHVersion] == S::kVersion,
          "schedule buffer has a bad magic/version (not from dash_fa3.schedule.metadata)");
  require(h[S::kHNumCols] == S::kNumCols, "schedule has an unexpected number of task columns");
  bool const dynamic = h[S::kHDispatch] == S::kDispatchDynamic;
  require(dynamic || h[S::kHDispatch] == S::kDispatchStatic, "schedule has an unknown dispatch kind");
  require(h[S::kHOffsetsLen] == (dynamic ? 0 : h[S::kHNumCtas] + 1),
          dynamic ? "a dynamic-dispatch schedule has no cta_offsets"
                  : "schedule cta_offsets must have num_ctas + 1 entries");
  require(!dynamic || a.task_counter != nullptr, "dynamic dispatch needs the task counter (zeroed)");
  require(h[S::kHNumTasks] >= 1, "schedule has no tasks");
  require(h[S::kHBatch] == a.batch && h[S::kHHeads] == a.heads && h[S::kHHeadsKv] == a.heads_kv &&
              h[S::kHSeqlenQ] == a.seqlen_q && h[S::kHSeqlenK] == a.seqlen_k,
          "schedule was built for another shape (batch, heads, heads_kv, seqlen_q, seqlen_k)");
  require(h[S::kHBlockM] == Traits::kBlockM && h[S::kHBlockN] == Traits::kBlockN,
          "schedule block sizes (" + std::to_string(h[S::kHBlockM]) + ", " + std::to_string(h[S::kHBlockN]) +
              ") differ from the kernel's (" + std::to_string(Traits::kBlockM) + ", " +
              std::to_string(Traits::kBlockN) + ")");
  static_assert(int(MaskKind::kFull) == S::kMaskFull && int(MaskKind::kCausal) == S::kMaskCausal &&
                    int(MaskKind::kLocal) == S::kMaskLocal,
                "MaskKind (common/params.h) and the schedule's mask codes (contract.py) differ");
  require(h[S::kHMask] == int(Traits::kMask), "schedule mask kind (" + std::to_string(h[S::kHMask]) +
                                                  ") differs from the kernel's (" + mask_kind_name(Traits::kMask) +
                                                  ")");
  int const left = Traits::kLocal ? a.window_left : -1;
  int const right = Traits::kLocal ? a.window_right : (Traits::kCausal ? 0 : -1);
  require(h[S::kHWindowLeft] == left && h[S::kHWindowRight] == right,
          "schedule was built for the window (" + std::to_string(h[S::kHWindowLeft]) + ", " +
              std::to_string(h[S::kHWindowRight]) + "), the call has (" + std::to_string(left) + ", " +
              std::to_string(right) + ")");
  require(h[S::kHRankKind] >= S::kRankAsc && h[S::kHRankKind] <= S::kRankRun, "schedule has an unknown rank kind");
  require(h[S::kHNumSplits] == 1 || (a.dq_split_floats > 0 && a.dq_split_sems > 0),
          "a schedule of several dQ splits needs the splits' accumulators");
  require(h[S::kHNumCtas] >= 1, "schedule has no CTAs");
}

template <class Traits>
typename Traits::Params make_bwd_params(BwdParams const& a) {
  using Element = typename Traits::Element;
  typename Traits::Params p{};
  // Packed documents: the tensors are one batch of total rows.
  constexpr bool packed = Traits::kPacked;
  int const tensor_batch = tensor_batches(a.batch, a.cu_seqlens_q);
  p.shape_q = make_shape(packed ? a.total_q : a.seqlen_q, a.headdim, a.heads, tensor_batch);
  p.shape_k = make_shape(packed ? a.total_k : a.seqlen_k, a.headdim, a.heads_kv, tensor_batch);
  auto const shape_q = p.shape_q;
  auto const shape_do = Traits::shape_do(p);
  auto const shape_k = p.shape_k;
  auto const shape_v = Traits::shape_v(p);
  // (row, dim, head, batch) view of a (batch, seqlen, heads, d) tensor; ptr an Element pointer.
  auto gmem = [](auto* ptr, auto shape, TensorStrides const& s) {
    return make_tensor(make_gmem_ptr(ptr), shape, make_stride(s.row, _1{}, s.head, s.batch));
  };
  Tensor gQ = gmem(static_cast<Element const*>(a.q), shape_q, a.q_stride);
  Tensor gdO = gmem(static_cast<Element const*>(a.dout), shape_do, a.do_stride);
  Tensor gK = gmem(static_cast<Element const*>(a.k), shape_k, a.k_stride);
  Tensor gV = gmem(static_cast<Element const*>(a.v), shape_v, a.v_stride);
  using TileQ = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
  using TileDo = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDimV>>;
  using TileK = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;
  using TileV = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDimV>>;
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gQ, take<0, 2>(typename Traits::SmemLayoutQ{}), TileQ{}, _1{});
  p.tma_do = make_tma_copy(SM90_TMA_LOAD{}, gdO, take<0, 2>(typename Traits::SmemLayoutDo{}), TileDo{}, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gK, typename Traits::SmemLayoutK{}, TileK{}, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gV, typename Traits::SmemLayoutV{}, TileV{}, _1{});
  p.tma_dk = make_tma_copy(SM90_TMA_STORE{}, gmem(static_cast<Element*>(a.dk), shape_k, a.dk_stride),
                           typename Traits::SmemLayoutK{}, TileK{}, _1{});
  p.tma_dv = make_tma_copy(SM90_TMA_STORE{}, gmem(static_cast<Element*>(a.dv), shape_v, a.dv_stride),
                           typename Traits::SmemLayoutV{}, TileV{}, _1{});
  p.lse_log2 = a.lse_log2;
  p.dpsum = a.dpsum;
  p.dq_accum = a.dq_accum;  // a 1-D bulk reduce-add target: no tensor map
  p.dq_semaphore = a.dq_semaphore;
  p.dk = a.dk;
  p.dv = a.dv;
  p.dk_batch_stride = a.dk_stride.batch;
  p.dk_row_stride = a.dk_stride.row;
  p.dk_head_stride = a.dk_stride.head;
  p.dv_batch_stride = a.dv_stride.batch;
  p.dv_row_stride = a.dv_stride.row;
  p.dv_head_stride = a.dv_stride.head;
  bool const gqa = a.heads != a.heads_kv;
  p.dk_partial = a.dk_partial;
  p.dv_partial = a.dv_partial;
  p.partial_rows = packed ? a.total_k : a.seqlen_k;
  p.dkv_accumulate = gqa && a.dkv_accumulate ? 1 : 0;
  p.dkv_ordered = gqa && a.dkv_ordered ? 1 : 0;
  p.dkv_semaphore = a.dkv_semaphore;
  p.cu_seqlens_q = a.cu_seqlens_q;
  p.cu_seqlens_k = a.cu_seqlens_k;
  // The device buffer's views, and the header fields every step's decode
  // needs, from the host copy of its header (checked by check_schedule_header).
  p.cta_offsets = schedule::offsets_of(a.schedule);
  p.tasks = schedule::tasks_of(a.schedule, a.schedule_header_host);
  bool const dynamic = a.schedule_header_host[schedule::kHDispatch] == schedule::kDispatchDynamic;
  p.task_counter = dynamic ? a.task_counter : nullptr;
  p.num_tasks = a.schedule_header_host[schedule::kHNumTasks];
  p.rank = schedule::rank_params_of(a.schedule_header_host);
  p.dq_split_floats = a.dq_split_floats;
  p.dq_split_sems = a.dq_split_sems;
  p.seqlen_q = a.seqlen_q;
  p.seqlen_k = a.seqlen_k;
  p.seqlen_q_rounded = a.seqlen_q_rounded;
  p.heads = a.heads;
  p.heads_kv = a.heads_kv;
  p.batch = a.batch;
  p.softmax_scale = a.softmax_scale;
  p.score_scale_log2 = softmax_score_scale(a.softmax_scale, a.softcap) * kLog2e;
  p.softcap_prescale = softcap_prescale(a.softmax_scale, a.softcap);
  // An unbounded side as a bound that hides nothing (as the forward: same block
  // ranges and element masks as -1, so the decode of the schedule, built with
  // -1, agrees). Packed, the longest document's lengths bound every document's.
  p.window_left = a.window_left < 0 ? a.seqlen_k : a.window_left;
  p.window_right = a.window_right < 0 ? a.seqlen_q : a.window_right;
  p.deterministic = a.deterministic ? 1 : 0;
#if DASH_FA3_BWD_TRACE
  p.trace_tasks = a.trace_tasks;
  p.trace_steps = a.trace_steps;
  p.trace_max_steps = a.trace_max_steps;
#endif
  return p;
}

}  // namespace bwd

template <int kHeadDim, int kHeadDimV, DType kDType, MaskKind kMask, bool kPacked, bool kSoftcap>
void run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Traits = bwd::BwdTraits<kHeadDim, kHeadDimV, Element<kDType>, kMask, kPacked, kSoftcap>;
  using bwd::require;
  require(params.headdim == kHeadDim && params.headdim_v == kHeadDimV,
          "headdim and headdim_v do not match the instantiation");
  require(params.batch >= 1 && params.heads >= 1 && params.heads_kv >= 1, "batch and heads must be >= 1");
  require(params.seqlen_q >= 1 && params.seqlen_k >= 1, "seqlen_q and seqlen_k must be >= 1");
  require(params.heads % params.heads_kv == 0, "heads must be a multiple of heads_kv");
  require((params.softcap > 0.f) == kSoftcap,
          kSoftcap ? "the softcap instantiation needs softcap > 0" : "softcap > 0 needs the softcap instantiation");
  require(!Traits::kLocal || (params.window_left >= -1 && params.window_right >= -1),
          "window_left and window_right must be >= -1 (-1: unbounded)");
  require(!(Traits::kFixedSteps && params.deterministic),
          "this extension is a DASH_FA3_BWD_FIXED_STEPS=1 measurement build, which has no deterministic mode: "
          "rebuild without that variable");
  require((params.cu_seqlens_q != nullptr) == kPacked && (params.cu_seqlens_k != nullptr) == kPacked,
          kPacked ? "the packed instantiation needs cu_seqlens_q and cu_seqlens_k"
                  : "the dense instantiation takes no cu_seqlens (packed documents have their own)");
  if (params.cu_seqlens_q == nullptr) {
    int const n_q = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    require(params.seqlen_q_rounded == n_q * Traits::kBlockM,
            "seqlen_q_rounded must be seqlen_q rounded up to block_m = " + std::to_string(Traits::kBlockM));
  } else {
    require(params.total_q >= 1 && params.total_k >= 1, "packed documents need total_q, total_k >= 1");
    require(params.seqlen_q_rounded == packed_padded_offset(params.total_q, params.batch, Traits::kBlockM),
            "packed: seqlen_q_rounded must be the padded total (common/seqlen_info.h)");
  }
  require(bwd::aligned(params.q, 16) && bwd::aligned(params.k, 16) && bwd::aligned(params.v, 16) &&
              bwd::aligned(params.dout, 16) && bwd::aligned(params.dq_accum, 128),
          "q, k, v, dout must be 16-byte aligned and dq_accum 128-byte aligned");
  require(bwd::tma_strides_ok(params.q_stride) && bwd::tma_strides_ok(params.k_stride) &&
              bwd::tma_strides_ok(params.v_stride) && bwd::tma_strides_ok(params.do_stride),
          "q, k, v, dout strides (batch, row, head) must be multiples of 8 elements");
  require(bwd::aligned(params.dk, 16) && bwd::aligned(params.dv, 16) && bwd::tma_strides_ok(params.dk_stride) &&
              bwd::tma_strides_ok(params.dv_stride),
          "dk, dv must be 16-byte aligned with strides (batch, row, head) multiples of 8 elements (TMA stores)");
  require(params.lse_log2 && params.dpsum && params.dq_accum && params.dq_semaphore,
          "lse_log2, dpsum, dq_accum and dq_semaphore (from the preprocess) must be given");
  bool const gqa = params.heads != params.heads_kv;
  int const chained = params.schedule_header_host[schedule::kHDkvChained];
  // Chains of whole groups store dK/dV from their last row, as MHA tasks do: no partials.
  bool const whole_groups = gqa && chained == schedule::kDkvChainedWhole;
  require(!gqa || whole_groups || (params.dk_partial && params.dv_partial),
          "GQA/MQA needs dk_partial and dv_partial, or a schedule of whole-group chains");
  require(!params.dkv_accumulate || !params.deterministic,
          "dK/dV accumulated across a group's query heads have no fixed order: non-deterministic mode only");
  require(!params.dkv_ordered || (params.deterministic && gqa && !kPacked && !params.dkv_accumulate &&
                                  params.dkv_semaphore != nullptr &&
                                  params.schedule_header_host[schedule::kHDkvOrdered] == 1),
          "dK/dV in turns need deterministic dense GQA, turn counters and a schedule that orders them "
          "(header dkv_ordered)");
  // Chains (header dkv_chained): dense GQA on a static table. A chain's last row adds the sum of
  // its heads' dK/dV (kDkvChainedAdd: into the one accumulator per KV head, in turns or by
  // non-deterministic adds), or stores it, the whole group's (kDkvChainedWhole: no partials).
  bool const static_table = params.schedule_header_host[schedule::kHDispatch] == schedule::kDispatchStatic;
  // Grouped rows (header group_interleave_log2 = g > 0, schedule::GroupTile): each row is a
  // whole group of 2^g query heads, unchained, so any dispatch will do; dense GQA only.
  int const group_log2 = params.schedule_header_host[schedule::kHGroupInterleaveLog2];
  bool const grouped = group_log2 > 0;
  require(group_log2 >= 0 && group_log2 < 31 &&
              (!grouped || (!kPacked && int64_t(params.heads_kv) << group_log2 == params.heads &&
                            chained == schedule::kDkvChainedWhole)),
          "a grouped schedule (header group_interleave_log2) needs dense GQA with 2^group_interleave_log2 query "
          "heads per KV head and rows that store whole groups (dkv_chained = WHOLE)");
  require(chained == schedule::kDkvUnchained ||
              (gqa && !kPacked && (static_table || grouped) &&
               (chained == schedule::kDkvChainedWhole
                    ? params.dk_partial == nullptr && !params.dkv_accumulate && !params.dkv_ordered
                    : chained == schedule::kDkvChainedAdd &&
                          (params.deterministic ? params.dkv_ordered : params.dkv_accumulate))),
          "a schedule with chains of a group's heads (header dkv_chained) needs dense GQA, static dispatch (but "
          "grouped rows) and "
          "one dK/dV accumulator per KV head (dkv_ordered, or non-deterministic dkv_accumulate), or, with chains "
          "of whole groups, no dK/dV partials");
  // Kernels without chains (BwdTraits::kChains: the three-warpgroup one) clear and store each row's
  // dK/dV; grouped rows are whole groups without chain columns, so they run there too.
  require(Traits::kChains || chained == schedule::kDkvUnchained || grouped,
          "this backward kernel (head dim " + std::to_string(kHeadDim) +
              ", three MMA warpgroups) has no chains: a schedule whose rows chain a group's heads (header "
              "dkv_chained; groups, runs) cannot run on it");
  bwd::check_schedule_header<Traits>(params);

  typename Traits::Params p = bwd::make_bwd_params<Traits>(params);
  int const grid = params.schedule_header_host[schedule::kHNumCtas];
  int device = 0, num_sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(multiProcessorCount)");
  // Deterministic mode waits between CTAs: all of them must be resident at once.
  require(grid <= num_sms, "schedule has more CTAs (" + std::to_string(grid) + ") than the device has SMs (" +
                               std::to_string(num_sms) + ")");

  auto kernel = bwd::bwd_kernel<Traits>;
  constexpr int kSmemBytes = Traits::kSharedStorageBytes;
  set_max_dynamic_smem_once<bwd::bwd_kernel<Traits>>(
      kSmemBytes, "cudaFuncSetAttribute(bwd_kernel, max dynamic shared memory)");
  kernel<<<grid, Traits::kNumThreads, kSmemBytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "bwd_kernel launch");
}

}  // namespace dash_fa3
