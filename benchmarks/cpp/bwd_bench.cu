// Backward-kernel harness without Python: correctness against a naive fp32
// reference, determinism over repeated runs, agreement across schedules, and
// timing with CUDA events. Build: benchmarks/cpp/bwd_build.sh.
//
//   bwd_bench check            the correctness suite (hdims/dtypes that were built;
//                              full + causal, ragged, seqlen_q != seqlen_k, GQA/MQA,
//                              batch; schedules fa3 and spt, deterministic and not)
//   bwd_bench det [N]          determinism: N (default 20) deterministic runs per
//                              schedule must agree to the bit
//   bwd_bench small [hdim]     one small GQA causal configuration (for compute-sanitizer)
//   bwd_bench grid [hdims]     TFLOP/s on the paper's grid (bf16, 16384 tokens,
//                              hidden 2048): non-det, det-fa3, det-spt
//   bwd_bench one H D C B SQ SK HQ HKV   one configuration: check + time
//
// The schedules are built here by a small test-only builder in the format of
// dash_fa3/schedule/metadata.py (fa3: KV tiles ascending, ranks ascending;
// spt: KV tiles descending, ranks descending), or read from a file written by
// ScheduleMeta.as_int32_array().tofile(path) (env DASH_SCHEDULE_FILE, used for
// every call of matching shape). Steps are decoded by the kernel's own
// csrc/schedules/schedule_metadata.h.
//
// Correctness: dq, dk, dv are poisoned with NaN first. The reference runs in
// fp32 on the same 16-bit inputs; a second reference rounds S, P, dP, dS and
// the outputs to the input type (a plain 16-bit implementation). The kernel
// passes when its max error against the fp32 reference is at most twice that
// of the plain 16-bit computation (plus 1e-4 x max|ref|).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/launch.h"
#include "common/params.h"
#include "schedules/schedule_metadata.h"

using dash_fa3::DType;
namespace S = dash_fa3::schedule;

#define CHECK_CUDA(x)                                                               \
  do {                                                                              \
    cudaError_t err_ = (x);                                                         \
    if (err_ != cudaSuccess) {                                                      \
      throw std::runtime_error(std::string(#x) + ": " + cudaGetErrorString(err_)); \
    }                                                                               \
  } while (0)

static bool dispatch_bwd(int hdim, DType dtype, bool causal, const dash_fa3::BwdParams& p, cudaStream_t st) {
#define DASH_BWD_VARIANT(H, T, C)                                \
  if (hdim == H && dtype == DType::T && causal == C) {           \
    dash_fa3::run_bwd<H, DType::T, C>(p, st);                    \
    return true;                                                 \
  }
#include "bwd_variants.inc"
#undef DASH_BWD_VARIANT
  return false;
}

// ---------------------------------------------------------------------------
// Device helpers and the naive reference

template <class T> __device__ __host__ float to_float(T x);
template <> __device__ __host__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __host__ float to_float(__half x) { return __half2float(x); }
template <class T> __device__ T from_float(float x);
template <> __device__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __half from_float(float x) { return __float2half_rn(x); }
template <class T> __device__ float round_to(float x) { return to_float(from_float<T>(x)); }

__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}

template <class T>
__global__ void fill_normal(T* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float u1 = (hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i) + 1.f) / 4294967297.f;
    float u2 = hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1) / 4294967296.f;
    x[i] = from_float<T>(sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2));
  }
}

struct Dims {
  int b, h, hkv, sq, sk, d;
  bool causal;
  float scale;
};

// Tensors (b, s, h, d) contiguous; matrices (b, h, sq, sk) fp32.
__device__ __forceinline__ bool visible(Dims const& g, int i, int j) {
  return !g.causal || j <= i + g.sk - g.sq;
}

// S = scale Q K^T (masked -> -inf); rnd: round S to T.
template <class T>
__global__ void ref_scores(Dims g, T const* q, T const* k, float* s, bool rnd) {
  int64_t n = int64_t(g.b) * g.h * g.sq * g.sk;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    int j = idx % g.sk; int64_t r = idx / g.sk; int i = r % g.sq; r /= g.sq; int h = r % g.h; int b = r / g.h;
    int hk = h / (g.h / g.hkv);
    T const* qr = q + ((int64_t(b) * g.sq + i) * g.h + h) * g.d;
    T const* kr = k + ((int64_t(b) * g.sk + j) * g.hkv + hk) * g.d;
    float acc = 0.f;
    for (int t = 0; t < g.d; ++t) acc += to_float(qr[t]) * to_float(kr[t]);
    if (rnd) acc = round_to<T>(acc);
    acc *= g.scale;
    if (rnd) acc = round_to<T>(acc);
    s[idx] = visible(g, i, j) ? acc : -INFINITY;
  }
}

// Row softmax in place: S -> P; lse (natural log, -inf for empty rows). One thread per row.
template <class T>
__global__ void ref_softmax(Dims g, float* s, float* lse, bool rnd) {
  int64_t rows = int64_t(g.b) * g.h * g.sq;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    float* row = s + r * g.sk;
    float mx = -INFINITY;
    for (int j = 0; j < g.sk; ++j) mx = fmaxf(mx, row[j]);
    if (mx == -INFINITY) {
      for (int j = 0; j < g.sk; ++j) row[j] = 0.f;
      if (lse) lse[r] = -INFINITY;
      continue;
    }
    float sum = 0.f;
    for (int j = 0; j < g.sk; ++j) sum += expf(row[j] - mx);
    for (int j = 0; j < g.sk; ++j) {
      float p = expf(row[j] - mx) / sum;
      row[j] = rnd ? round_to<T>(p) : p;
    }
    if (lse) lse[r] = mx + logf(sum);
  }
}

// out[b,i,h,:] = sum_j M[b,h,i,j] X[b,j,hk,:] (O = P V, dQ = scale dS K)
template <class T>
__global__ void ref_rowmix(Dims g, float const* m, T const* x, float* out, float mul, bool rnd) {
  int64_t n = int64_t(g.b) * g.sq * g.h * g.d;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    int t = idx % g.d; int64_t r = idx / g.d; int h = r % g.h; r /= g.h; int i = r % g.sq; int b = r / g.sq;
    int hk = h / (g.h / g.hkv);
    float const* mr = m + ((int64_t(b) * g.h + h) * g.sq + i) * g.sk;
    float acc = 0.f;
    for (int j = 0; j < g.sk; ++j) acc += mr[j] * to_float(x[((int64_t(b) * g.sk + j) * g.hkv + hk) * g.d + t]);
    acc *= mul;
    out[idx] = rnd ? round_to<T>(acc) : acc;
  }
}

// out[b,j,hk,:] = mul * sum_{h in group(hk)} sum_i M[b,h,i,j] Y[b,i,h,:] (dV = P^T dO, dK = scale dS^T Q)
template <class T>
__global__ void ref_colmix(Dims g, float const* m, T const* y, float* out, float mul, bool rnd) {
  int64_t n = int64_t(g.b) * g.sk * g.hkv * g.d;
  int group = g.h / g.hkv;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    int t = idx % g.d; int64_t r = idx / g.d; int hk = r % g.hkv; r /= g.hkv; int j = r % g.sk; int b = r / g.sk;
    float acc = 0.f;
    for (int h = hk * group; h < (hk + 1) * group; ++h) {
      float const* mc = m + (int64_t(b) * g.h + h) * g.sq * g.sk + j;
      T const* yc = y + (int64_t(b) * g.sq * g.h + h) * g.d + t;
      for (int i = 0; i < g.sq; ++i) acc += mc[int64_t(i) * g.sk] * to_float(yc[int64_t(i) * g.h * g.d]);
    }
    acc *= mul;
    out[idx] = rnd ? round_to<T>(acc) : acc;
  }
}

// dS = P (dP - D) where dP = dO V^T (computed here), D_i = sum dO_i O_i (O fp32).
template <class T>
__global__ void ref_ds(Dims g, float const* p, T const* dout, T const* v, float const* o, float* ds, bool rnd) {
  int64_t n = int64_t(g.b) * g.h * g.sq * g.sk;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    int j = idx % g.sk; int64_t r = idx / g.sk; int i = r % g.sq; r /= g.sq; int h = r % g.h; int b = r / g.h;
    int hk = h / (g.h / g.hkv);
    T const* dor = dout + ((int64_t(b) * g.sq + i) * g.h + h) * g.d;
    T const* vr = v + ((int64_t(b) * g.sk + j) * g.hkv + hk) * g.d;
    float const* orow = o + ((int64_t(b) * g.sq + i) * g.h + h) * g.d;
    float dp = 0.f, dsum = 0.f;
    for (int t = 0; t < g.d; ++t) {
      dp += to_float(dor[t]) * to_float(vr[t]);
      dsum += to_float(dor[t]) * orow[t];
    }
    if (rnd) { dp = round_to<T>(dp); dsum = round_to<T>(dsum); }
    float val = p[idx] * (dp - dsum);
    ds[idx] = rnd ? round_to<T>(val) : val;
  }
}

template <class T>
__global__ void to_elem(float const* x, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = from_float<T>(x[i]);
}

// ---------------------------------------------------------------------------
// Test-only schedule builder (format of dash_fa3/schedule/metadata.py).

static int kv_end_of(int q, int sq, int sk, int bm, int bn, bool causal, int n_kv) {
  if (!causal) return n_kv;
  int last_row = std::min((q + 1) * bm, sq) - 1;
  int reach = last_row + sk - sq;
  return reach < 0 ? 0 : std::min(n_kv, reach / bn + 1);
}

static std::vector<int32_t> build_schedule(const std::string& name, Dims const& g, int bm, int bn, int num_sms) {
  int n_q = (g.sq + bm - 1) / bm, n_kv = (g.sk + bn - 1) / bn;
  bool spt = name == "spt";
  if (!spt && name != "fa3") throw std::invalid_argument("unknown schedule " + name);
  std::vector<int> q_begin(n_kv, n_q);
  for (int kv = 0; kv < n_kv; ++kv)
    for (int q = 0; q < n_q; ++q)
      if (kv_end_of(q, g.sq, g.sk, bm, bn, g.causal, n_kv) > kv) { q_begin[kv] = q; break; }
  struct Row { int32_t c[S::kNumCols]; };
  std::vector<Row> rows;
  int group = g.h / g.hkv;
  int64_t steps = 0;
  for (int b = 0; b < g.b; ++b)
    for (int h = 0; h < g.h; ++h)
      for (int t = 0; t < n_kv; ++t) {
        int kv = spt ? n_kv - 1 - t : t;
        Row r{};
        r.c[S::kCBatch] = b; r.c[S::kCHead] = h; r.c[S::kCKv] = kv;
        r.c[S::kCNSteps] = n_q - q_begin[kv];
        r.c[S::kCLinBase] = q_begin[kv]; r.c[S::kCLinDir] = 1;
        r.c[S::kCRankDkv] = h % group; r.c[S::kCHeadKv] = h / group; r.c[S::kCUnit] = kv;
        steps += r.c[S::kCNSteps];
        rows.push_back(r);
      }
  int num_tasks = int(rows.size());
  int ctas = std::min(num_sms, num_tasks);
  std::vector<int32_t> hdr(S::kHeaderLen, 0);
  hdr[S::kHMagic] = S::kMagic; hdr[S::kHVersion] = S::kVersion; hdr[S::kHSchedule] = spt ? 1 : 0;
  hdr[S::kHDispatch] = S::kDispatchStatic; hdr[S::kHRankKind] = spt ? S::kRankDesc : S::kRankAsc;
  hdr[S::kHNumCtas] = ctas; hdr[S::kHNumTasks] = num_tasks; hdr[S::kHNumCols] = S::kNumCols;
  hdr[S::kHBatch] = g.b; hdr[S::kHHeads] = g.h; hdr[S::kHHeadsKv] = g.hkv; hdr[S::kHSeqlenQ] = g.sq;
  hdr[S::kHSeqlenK] = g.sk; hdr[S::kHBlockM] = bm; hdr[S::kHBlockN] = bn; hdr[S::kHCausal] = g.causal;
  hdr[S::kHNQ] = n_q; hdr[S::kHNKv] = n_kv; hdr[S::kHUnitsPerHead] = n_kv; hdr[S::kHNumSteps] = int(steps);
  hdr[S::kHOffsetsLen] = ctas + 1;
  // task t -> CTA t % ctas, in order; rows grouped by CTA.
  std::vector<int32_t> out = hdr;
  std::vector<Row> sorted;
  for (int c = 0; c < ctas; ++c) {
    out.push_back(int32_t(sorted.size()));
    for (int t = c; t < num_tasks; t += ctas) { Row r = rows[t]; r.c[S::kCCta] = c; sorted.push_back(r); }
  }
  out.push_back(int32_t(sorted.size()));
  for (auto& r : sorted) out.insert(out.end(), r.c, r.c + S::kNumCols);
  return out;
}

static std::vector<int32_t> load_schedule_file(Dims const& g, int bm) {
  const char* path = getenv("DASH_SCHEDULE_FILE");
  if (!path) return {};
  FILE* f = fopen(path, "rb");
  if (!f) throw std::runtime_error(std::string("cannot open ") + path);
  std::vector<int32_t> buf;
  int32_t x;
  while (fread(&x, 4, 1, f) == 1) buf.push_back(x);
  fclose(f);
  if (buf.size() < size_t(S::kHeaderLen) || buf[S::kHBatch] != g.b || buf[S::kHHeads] != g.h ||
      buf[S::kHSeqlenQ] != g.sq || buf[S::kHSeqlenK] != g.sk || buf[S::kHCausal] != int(g.causal) ||
      buf[S::kHBlockM] != bm)
    return {};
  return buf;
}

// Host check of a schedule: every needed (kv, q) pair once; ranks a permutation per dQ tile.
static void validate_schedule(std::vector<int32_t> const& m) {
  int32_t const* h = m.data();
  int n_q = h[S::kHNQ], n_kv = h[S::kHNKv], heads = h[S::kHHeads], batch = h[S::kHBatch];
  std::vector<int> seen(size_t(batch) * heads * n_q * n_kv, 0);
  std::vector<uint8_t> rank_seen(size_t(batch) * heads * n_q * n_kv, 0);
  for (int t = 0; t < h[S::kHNumTasks]; ++t) {
    int32_t const* row = S::task_row(m.data(), t);
    for (int s = 0; s < row[S::kCNSteps]; ++s) {
      S::StepInfo st = S::decode_step(h, row, s);
      size_t bh = size_t(row[S::kCBatch]) * heads + row[S::kCHead];
      if (st.q_tile < 0 || st.q_tile >= n_q) throw std::runtime_error("schedule: q tile out of range");
      seen[(bh * n_q + st.q_tile) * n_kv + row[S::kCKv]]++;
      int kv_end = kv_end_of(st.q_tile, h[S::kHSeqlenQ], h[S::kHSeqlenK], h[S::kHBlockM], h[S::kHBlockN],
                             h[S::kHCausal], n_kv);
      if (st.rank < 0 || st.rank >= kv_end) throw std::runtime_error("schedule: rank out of range");
      uint8_t& r = rank_seen[(bh * n_q + st.q_tile) * n_kv + st.rank];
      if (r) throw std::runtime_error("schedule: duplicate rank");
      r = 1;
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    size_t q = (i / n_kv) % n_q; int kv = int(i % n_kv);
    int need = kv < kv_end_of(int(q), h[S::kHSeqlenQ], h[S::kHSeqlenK], h[S::kHBlockM], h[S::kHBlockN],
                              h[S::kHCausal], n_kv) ? 1 : 0;
    if (seen[i] != need) throw std::runtime_error("schedule: pair visited " + std::to_string(seen[i]) + " times");
  }
}

// ---------------------------------------------------------------------------
// One problem: inputs, reference, and kernel runs.

static dim3 grid_for(int64_t n) { return dim3(unsigned(std::min<int64_t>((n + 255) / 256, 132 * 16))); }

struct Problem {
  Dims g;
  DType dtype;
  int bm, bn, n_q, n_kv, sq_rounded, num_sms;
  size_t esize = 2;
  void *q, *k, *v, *dout, *o, *dq, *dk, *dv;
  float *lse, *dpsum, *lse_log2, *dq_accum, *dk_accum = nullptr, *dv_accum = nullptr;
  int *dq_sem, *dkv_sem = nullptr;
  int32_t* sched_dev = nullptr;
  std::vector<int32_t> sched_host;
  float *ref_dq = nullptr, *ref_dk = nullptr, *ref_dv = nullptr;  // fp32 reference
  float *emu_dq = nullptr, *emu_dk = nullptr, *emu_dv = nullptr;  // plain 16-bit computation
  cudaStream_t stream = 0;

  int64_t nq() const { return int64_t(g.b) * g.sq * g.h * g.d; }
  int64_t nk() const { return int64_t(g.b) * g.sk * g.hkv * g.d; }

  Problem(Dims g_, DType dt, uint64_t seed) : g(g_), dtype(dt) {
    bm = dash_fa3::bwd_block_m(g.d);
    bn = dash_fa3::bwd_block_n(g.d);
    n_q = (g.sq + bm - 1) / bm;
    n_kv = (g.sk + bn - 1) / bn;
    sq_rounded = n_q * bm;
    int dev = 0;
    CHECK_CUDA(cudaGetDevice(&dev));
    CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
    for (void** p : {&q, &dout, &o, &dq}) CHECK_CUDA(cudaMalloc(p, nq() * esize));
    for (void** p : {&k, &v, &dk, &dv}) CHECK_CUDA(cudaMalloc(p, nk() * esize));
    int64_t rows = int64_t(g.b) * g.h * g.sq, rows_r = int64_t(g.b) * g.h * sq_rounded;
    CHECK_CUDA(cudaMalloc(&lse, rows * 4));
    CHECK_CUDA(cudaMalloc(&dpsum, rows_r * 4));
    CHECK_CUDA(cudaMalloc(&lse_log2, rows_r * 4));
    CHECK_CUDA(cudaMalloc(&dq_accum, rows_r * g.d * 4));
    CHECK_CUDA(cudaMalloc(&dq_sem, int64_t(g.b) * g.h * n_q * 4));
    if (g.h != g.hkv) {
      CHECK_CUDA(cudaMalloc(&dk_accum, nk() * 4));
      CHECK_CUDA(cudaMalloc(&dv_accum, nk() * 4));
      CHECK_CUDA(cudaMalloc(&dkv_sem, int64_t(g.b) * g.hkv * n_kv * 4));
    }
    auto fill = [&](void* p, int64_t n, uint64_t s) {
      if (dtype == DType::kBF16) fill_normal<<<grid_for(n), 256>>>((__nv_bfloat16*)p, n, s);
      else fill_normal<<<grid_for(n), 256>>>((__half*)p, n, s);
    };
    fill(q, nq(), seed * 4 + 1); fill(k, nk(), seed * 4 + 2); fill(v, nk(), seed * 4 + 3);
    fill(dout, nq(), seed * 4 + 4);
    CHECK_CUDA(cudaGetLastError());
  }

  // Forward reference (O in the input type and LSE, what a forward kernel gives),
  // then the fp32 and plain-16-bit backward references.
  template <class T>
  void reference_impl(bool with_emulated) {
    int64_t mat = int64_t(g.b) * g.h * g.sq * g.sk;
    float *pm, *dsm, *of;
    CHECK_CUDA(cudaMalloc(&pm, mat * 4));
    CHECK_CUDA(cudaMalloc(&dsm, mat * 4));
    CHECK_CUDA(cudaMalloc(&of, nq() * 4));
    for (float** p : {&ref_dq}) CHECK_CUDA(cudaMalloc(p, nq() * 4));
    for (float** p : {&ref_dk, &ref_dv}) CHECK_CUDA(cudaMalloc(p, nk() * 4));
    T const *tq = (T*)q, *tk = (T*)k, *tv = (T*)v, *tdo = (T*)dout;
    for (int pass = 0; pass < (with_emulated ? 2 : 1); ++pass) {
      bool rnd = pass == 1;
      float *xdq = ref_dq, *xdk = ref_dk, *xdv = ref_dv;
      if (rnd) {
        CHECK_CUDA(cudaMalloc(&emu_dq, nq() * 4));
        CHECK_CUDA(cudaMalloc(&emu_dk, nk() * 4));
        CHECK_CUDA(cudaMalloc(&emu_dv, nk() * 4));
        xdq = emu_dq; xdk = emu_dk; xdv = emu_dv;
      }
      ref_scores<T><<<grid_for(mat), 256>>>(g, tq, tk, pm, rnd);
      ref_softmax<T><<<grid_for(int64_t(g.b) * g.h * g.sq), 128>>>(g, pm, rnd ? nullptr : lse, rnd);
      ref_rowmix<T><<<grid_for(nq()), 256>>>(g, pm, tv, of, 1.f, rnd);
      if (!rnd) to_elem<T><<<grid_for(nq()), 256>>>(of, (T*)o, nq());
      ref_ds<T><<<grid_for(mat), 256>>>(g, pm, tdo, tv, of, dsm, rnd);
      ref_rowmix<T><<<grid_for(nq()), 256>>>(g, dsm, tk, xdq, g.scale, rnd);
      ref_colmix<T><<<grid_for(nk()), 256>>>(g, dsm, tq, xdk, g.scale, rnd);
      ref_colmix<T><<<grid_for(nk()), 256>>>(g, pm, tdo, xdv, 1.f, rnd);
      CHECK_CUDA(cudaGetLastError());
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    cudaFree(pm); cudaFree(dsm); cudaFree(of);
  }
  void reference(bool with_emulated) {
    if (dtype == DType::kBF16) reference_impl<__nv_bfloat16>(with_emulated);
    else reference_impl<__half>(with_emulated);
  }
  // Inputs for timing only: O and LSE need plausible values, not exact ones.
  void fake_forward() {
    CHECK_CUDA(cudaMemcpy(o, dout, nq() * esize, cudaMemcpyDeviceToDevice));
    std::vector<float> l(size_t(g.b) * g.h * g.sq, std::log(float(g.sk)) + 2.f);
    CHECK_CUDA(cudaMemcpy(lse, l.data(), l.size() * 4, cudaMemcpyHostToDevice));
  }

  void set_schedule(const std::string& name) {
    sched_host = load_schedule_file(g, bm);
    if (sched_host.empty()) sched_host = build_schedule(name, g, bm, bn, num_sms);
    validate_schedule(sched_host);
    if (sched_dev) cudaFree(sched_dev);
    CHECK_CUDA(cudaMalloc(&sched_dev, sched_host.size() * 4));
    CHECK_CUDA(cudaMemcpy(sched_dev, sched_host.data(), sched_host.size() * 4, cudaMemcpyHostToDevice));
  }

  void poison() {
    CHECK_CUDA(cudaMemset(dq, 0xFF, nq() * esize));
    CHECK_CUDA(cudaMemset(dk, 0xFF, nk() * esize));
    CHECK_CUDA(cudaMemset(dv, 0xFF, nk() * esize));
  }

  // preprocess + main + postprocess (the timed unit, as FA3's backward op).
  void run(bool det) {
    dash_fa3::BwdPreprocessParams pre{};
    pre.o = o; pre.dout = dout; pre.lse = lse;
    pre.o_stride = pre.dout_stride = {int64_t(g.sq) * g.h * g.d, int64_t(g.h) * g.d, g.d};
    pre.dpsum = dpsum; pre.lse_log2 = lse_log2; pre.dq_accum = dq_accum; pre.dq_semaphore = dq_sem;
    pre.dq_semaphore_numel = int64_t(g.b) * g.h * n_q;
    pre.batch = g.b; pre.seqlen_q = g.sq; pre.seqlen_q_rounded = sq_rounded; pre.heads = g.h; pre.headdim = g.d;
    dash_fa3::run_bwd_preprocess(pre, dtype, stream);
    if (dk_accum) {
      CHECK_CUDA(cudaMemsetAsync(dk_accum, 0, nk() * 4, stream));
      CHECK_CUDA(cudaMemsetAsync(dv_accum, 0, nk() * 4, stream));
      CHECK_CUDA(cudaMemsetAsync(dkv_sem, 0, int64_t(g.b) * g.hkv * n_kv * 4, stream));
    }
    dash_fa3::BwdParams p{};
    p.q = q; p.k = k; p.v = v; p.dout = dout;
    p.q_stride = p.do_stride = {int64_t(g.sq) * g.h * g.d, int64_t(g.h) * g.d, g.d};
    p.k_stride = p.v_stride = p.dk_stride = p.dv_stride = {int64_t(g.sk) * g.hkv * g.d, int64_t(g.hkv) * g.d, g.d};
    p.lse_log2 = lse_log2; p.dpsum = dpsum; p.dq_accum = dq_accum; p.dq_semaphore = dq_sem;
    p.dk = dk; p.dv = dv; p.dk_accum = dk_accum; p.dv_accum = dv_accum; p.dkv_semaphore = dkv_sem;
    p.schedule = sched_dev; p.schedule_header_host = sched_host.data();
    p.batch = g.b; p.seqlen_q = g.sq; p.seqlen_k = g.sk; p.seqlen_q_rounded = sq_rounded;
    p.heads = g.h; p.heads_kv = g.hkv; p.headdim = g.d;
    p.softmax_scale = g.scale; p.softmax_scale_log2 = g.scale * 1.4426950408889634f;
    p.deterministic = det;
    if (!dispatch_bwd(g.d, dtype, g.causal, p, stream))
      throw std::runtime_error("variant not built: hdim " + std::to_string(g.d));
    dash_fa3::BwdPostprocessParams post{};
    post.dq_accum = dq_accum; post.dq = dq;
    post.dq_stride = {int64_t(g.sq) * g.h * g.d, int64_t(g.h) * g.d, g.d};
    post.softmax_scale = g.scale; post.batch = g.b; post.seqlen_q = g.sq; post.seqlen_q_rounded = sq_rounded;
    post.heads = g.h; post.headdim = g.d;
    dash_fa3::run_bwd_postprocess(post, dtype, stream);
  }

  std::vector<uint16_t> fetch(void* p, int64_t n) {
    std::vector<uint16_t> h(n);
    CHECK_CUDA(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
    return h;
  }
  float elem_to_float(uint16_t x) const {
    uint32_t u;
    if (dtype == DType::kBF16) { u = uint32_t(x) << 16; float f; memcpy(&f, &u, 4); return f; }
    __half_raw r; r.x = x; return __half2float(__half(r));
  }
};

struct ErrStat { double max_err = 0, max_ref = 0, l2_err = 0, l2_ref = 0; bool nan = false; };
static ErrStat compare(Problem& P, void* out, float* ref, int64_t n) {
  std::vector<uint16_t> o = P.fetch(out, n);
  std::vector<float> r(n);
  CHECK_CUDA(cudaMemcpy(r.data(), ref, n * 4, cudaMemcpyDeviceToHost));
  ErrStat s;
  for (int64_t i = 0; i < n; ++i) {
    double x = P.elem_to_float(o[i]);
    if (!std::isfinite(x)) s.nan = true;
    double e = std::fabs(x - r[i]);
    s.max_err = std::max(s.max_err, e); s.max_ref = std::max(s.max_ref, double(std::fabs(r[i])));
    s.l2_err += e * e; s.l2_ref += double(r[i]) * r[i];
  }
  return s;
}
static ErrStat compare_f(float* a, float* ref, int64_t n) {
  std::vector<float> x(n), r(n);
  CHECK_CUDA(cudaMemcpy(x.data(), a, n * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(r.data(), ref, n * 4, cudaMemcpyDeviceToHost));
  ErrStat s;
  for (int64_t i = 0; i < n; ++i) {
    double e = std::fabs(double(x[i]) - r[i]);
    s.max_err = std::max(s.max_err, e); s.max_ref = std::max(s.max_ref, double(std::fabs(r[i])));
    s.l2_err += e * e; s.l2_ref += double(r[i]) * r[i];
  }
  return s;
}

static int g_failures = 0;

static std::string describe(Dims const& g, DType dt) {
  char buf[200];
  snprintf(buf, sizeof buf, "d%d %s %s b%d h%d/%d sq%d sk%d", g.d, dt == DType::kBF16 ? "bf16" : "fp16",
           g.causal ? "causal" : "full", g.b, g.h, g.hkv, g.sq, g.sk);
  return buf;
}

// Checks one configuration under several (schedule, mode) runs against the
// references; all runs must also agree with each other within rounding.
static void check_case(Dims g, DType dt, uint64_t seed) {
  Problem P(g, dt, seed);
  P.reference(true);
  ErrStat edq = compare_f(P.emu_dq, P.ref_dq, P.nq()), edk = compare_f(P.emu_dk, P.ref_dk, P.nk()),
          edv = compare_f(P.emu_dv, P.ref_dv, P.nk());
  struct Mode { const char* sched; bool det; } modes[] = {{"fa3", false}, {"fa3", true}, {"spt", true}};
  for (auto m : modes) {
    P.set_schedule(m.sched);
    P.poison();
    P.run(m.det);
    CHECK_CUDA(cudaDeviceSynchronize());
    ErrStat a = compare(P, P.dq, P.ref_dq, P.nq()), b = compare(P, P.dk, P.ref_dk, P.nk()),
            c = compare(P, P.dv, P.ref_dv, P.nk());
    auto ok = [](ErrStat const& x, ErrStat const& e) {
      return !x.nan && x.max_err <= 2 * e.max_err + 1e-4 * x.max_ref;
    };
    bool pass = ok(a, edq) && ok(b, edk) && ok(c, edv);
    if (!pass) ++g_failures;
    printf("%-4s %-40s %-3s %-6s  dq %.2e (16b %.2e, rel %.1e)  dk %.2e (16b %.2e)  dv %.2e (16b %.2e)\n",
           pass ? "ok" : "FAIL", describe(g, dt).c_str(), m.sched, m.det ? "det" : "nondet", a.max_err,
           edq.max_err, std::sqrt(a.l2_err / std::max(a.l2_ref, 1e-30)), b.max_err, edk.max_err, c.max_err,
           edv.max_err);
  }
}

// Runs each deterministic schedule n times; every run must match the first to the bit.
static void det_case(Dims g, DType dt, int n) {
  Problem P(g, dt, 7);
  P.fake_forward();
  std::vector<uint16_t> first_all;
  for (const char* sched : {"fa3", "spt"}) {
    P.set_schedule(sched);
    std::vector<uint16_t> first[3];
    int mismatches = 0;
    for (int it = 0; it < n; ++it) {
      P.poison();
      P.run(true);
      CHECK_CUDA(cudaDeviceSynchronize());
      std::vector<uint16_t> cur[3] = {P.fetch(P.dq, P.nq()), P.fetch(P.dk, P.nk()), P.fetch(P.dv, P.nk())};
      if (it == 0) { for (int i = 0; i < 3; ++i) first[i] = cur[i]; continue; }
      for (int i = 0; i < 3; ++i) mismatches += cur[i] != first[i];
    }
    // The non-deterministic mode on the same inputs, for contrast.
    int nondet_diff = 0;
    for (int it = 0; it < 5; ++it) {
      P.run(false);
      CHECK_CUDA(cudaDeviceSynchronize());
      nondet_diff += P.fetch(P.dq, P.nq()) != first[0];
    }
    if (mismatches) ++g_failures;
    printf("%-4s det %-40s %s: %d runs, %d tensors differ from run 0 (nondet: %d/5 dq differ)\n",
           mismatches ? "FAIL" : "ok", describe(g, dt).c_str(), sched, n, mismatches, nondet_diff);
  }
}

static double time_ms(Problem& P, bool det, int iters) {
  for (int i = 0; i < 3; ++i) P.run(det);
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a)); CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    P.run(det);
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms; CHECK_CUDA(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static void bench_case(Dims g, DType dt) {
  Problem P(g, dt, 3);
  P.fake_forward();
  double flops = 2.5 * 4.0 * g.b * g.h * double(g.sq) * g.sk * g.d * (g.causal ? 0.5 : 1.0);
  P.set_schedule("fa3");
  double t_nd = time_ms(P, false, 20), t_fa3 = time_ms(P, true, 20);
  P.set_schedule("spt");
  double t_spt = time_ms(P, true, 20);
  printf("%-40s  nondet %6.1f  det-fa3 %6.1f  det-spt %6.1f TFLOP/s  (%.3f / %.3f / %.3f ms)\n",
         describe(g, dt).c_str(), flops / t_nd * 1e-9, flops / t_fa3 * 1e-9, flops / t_spt * 1e-9, t_nd, t_fa3,
         t_spt);
}

static std::vector<int> built_hdims() {
  std::vector<int> h;
#define DASH_BWD_VARIANT(H, T, C) if (std::find(h.begin(), h.end(), H) == h.end()) h.push_back(H);
#include "bwd_variants.inc"
#undef DASH_BWD_VARIANT
  return h;
}
static bool built(int hdim, DType dt, bool causal) {
#define DASH_BWD_VARIANT(H, T, C) if (hdim == H && dt == DType::T && causal == C) return true;
#include "bwd_variants.inc"
#undef DASH_BWD_VARIANT
  return false;
}

int main(int argc, char** argv) {
  std::string cmd = argc > 1 ? argv[1] : "check";
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  try {
    if (cmd == "check") {
      for (int d : built_hdims())
        for (DType dt : {DType::kBF16, DType::kFP16})
          for (bool causal : {false, true}) {
            if (!built(d, dt, causal)) continue;
            float sc = 1.f / std::sqrt(float(d));
            check_case({2, 4, 4, 1024, 1024, d, causal, sc}, dt, 1);   // aligned, batch
            check_case({1, 4, 4, 1000, 1000, d, causal, sc}, dt, 2);   // ragged
            check_case({1, 2, 2, 700, 1200, d, causal, sc}, dt, 3);    // seqlen_q < seqlen_k
            check_case({1, 2, 2, 1100, 333, d, causal, sc}, dt, 4);    // seqlen_q > seqlen_k
            check_case({2, 8, 2, 512, 777, d, causal, sc}, dt, 5);     // GQA 4:1
            check_case({1, 4, 1, 300, 300, d, causal, sc}, dt, 6);     // MQA
          }
    } else if (cmd == "det") {
      int n = argc > 2 ? atoi(argv[2]) : 20;
      for (int d : built_hdims()) {
        det_case({2, 16, 16, 2048, 2048, d, true, 0.088f}, DType::kBF16, n);
        det_case({2, 8, 2, 1000, 1500, d, false, 0.088f}, DType::kBF16, n);
      }
    } else if (cmd == "small") {
      int d = argc > 2 ? atoi(argv[2]) : built_hdims()[0];
      check_case({1, 2, 1, 200, 300, d, true, 0.1f}, DType::kBF16, 9);
    } else if (cmd == "grid") {
      std::vector<int> hd = built_hdims();
      if (argc > 2) { hd.clear(); for (int i = 2; i < argc; ++i) hd.push_back(atoi(argv[i])); }
      for (int d : hd)
        for (bool causal : {false, true})
          for (int s : {512, 1024, 2048, 4096, 8192, 16384}) {
            if (!built(d, DType::kBF16, causal)) continue;
            bench_case({16384 / s, 2048 / d, 2048 / d, s, s, d, causal, 1.f / std::sqrt(float(d))}, DType::kBF16);
          }
    } else if (cmd == "one" && argc >= 10) {
      Dims g{atoi(argv[5]), atoi(argv[8]), atoi(argv[9]), atoi(argv[6]), atoi(argv[7]), atoi(argv[2]),
             atoi(argv[4]) != 0, 1.f / std::sqrt(float(atoi(argv[2])))};
      DType dt = std::string(argv[3]) == "fp16" ? DType::kFP16 : DType::kBF16;
      check_case(g, dt, 11);
      bench_case(g, dt);
    } else {
      fprintf(stderr, "usage: see the header of benchmarks/cpp/bwd_bench.cu\n");
      return 2;
    }
  } catch (std::exception const& e) {
    fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  printf("%s (%d failures)\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}
