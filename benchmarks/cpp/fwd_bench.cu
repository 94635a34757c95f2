// Forward-kernel harness without Python: correctness against a naive fp32
// reference, and timing with CUDA events.
//
//   fwd_bench [--hdim 128] [--dtype bf16|fp16] [--causal 0|1] [--batch 2]
//             [--seqlen_q 1024] [--seqlen_k SQ] [--heads 16] [--heads_kv H]
//             [--pad 0|1] [--check 1] [--time 1] [--iters 20] [--warmup 5]
//             [--seed 1] [--scale 1/sqrt(d)]
//   fwd_bench --grid [--hdims 64,128]   the paper's grid: bf16, 16384 tokens,
//             hidden 2048 (heads = 2048 / hdim), seqlen 512..16384, full and
//             causal; timing only.
//
// --pad 1 allocates Q, K, V and O with padded row and batch strides (still
// multiples of 8 elements), to exercise arbitrary strides.
//
// Correctness: O and LSE are poisoned with NaN before the call. The reference
// runs in fp32 on the same bf16/fp16 inputs (one warp per query row, two
// passes). A second reference rounds P to the input type before P V, as any
// 16-bit attention kernel does; the kernel passes when its error against the
// fp32 reference is within 2x (L2) / 4x (max) of that rounded reference's
// error, plus a small floor, and its LSE is within 1e-3 + 1e-5 |lse|.
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

using dash_fa3::DType;

#define CHECK_CUDA(x)                                                                     \
  do {                                                                                    \
    cudaError_t err_ = (x);                                                               \
    if (err_ != cudaSuccess) {                                                            \
      throw std::runtime_error(std::string(#x) + ": " + cudaGetErrorString(err_));       \
    }                                                                                     \
  } while (0)

// Calls the instantiation for (hdim, dtype, causal); false if it was not built.
static bool dispatch_fwd(int hdim, DType dtype, bool causal, const dash_fa3::FwdParams& p,
                         cudaStream_t stream) {
#define DASH_FWD_VARIANT(H, T, C)                                  \
  if (hdim == H && dtype == DType::T && causal == C) {             \
    dash_fa3::run_fwd<H, DType::T, C>(p, stream);                  \
    return true;                                                   \
  }
#include "fwd_variants.inc"
#undef DASH_FWD_VARIANT
  return false;
}

// ---------------------------------------------------------------------------
// Device helpers

template <class T> __device__ __host__ float to_float(T x);
template <> __device__ __host__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __host__ float to_float(__half x) { return __half2float(x); }
template <class T> __device__ T from_float(float x);
template <> __device__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __half from_float(float x) { return __float2half_rn(x); }

__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}

// Standard normal values (Box-Muller on a counter hash) in the logical
// (batch, seq, heads, d) tensor with the given strides. Padding keeps NaN.
template <class T>
__global__ void fill_normal(T* x, int b, int s, int h, int d, int64_t sb, int64_t sr, int64_t sh,
                            uint64_t seed) {
  int64_t const n = int64_t(b) * s * h * d;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t r = i;
    int const di = r % d; r /= d;
    int const hi = r % h; r /= h;
    int const si = r % s; r /= s;
    int const bi = int(r);
    float const u1 = (hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i) + 1.f) * 2.3283064e-10f;
    float const u2 = hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1) * 2.3283064e-10f;
    float const z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    x[bi * sb + si * sr + hi * sh + di] = from_float<T>(z);
  }
}

template <class T>
__global__ void fill_value(T* x, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = from_float<T>(value);
  }
}

__global__ void fill_float(float* x, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = value;
  }
}

struct RefArgs {
  const void* q; const void* k; const void* v;
  dash_fa3::TensorStrides qs, ks, vs;
  float* o32;    // (b, sq, h, d) contiguous, fp32 P
  float* o16p;   // same, P rounded to the input type, O rounded too
  float* lse;    // (b, h, sq)
  int b, sq, sk, h, hkv, d;
  float scale;
  bool causal;
};

constexpr int kRefMaxDimPerLane = 8;  // head dim <= 256

// One warp per query row. Pass 1: running max / sum of the scaled scores.
// Pass 2: O = sum_j p_j v_j / l, with p_j in fp32 and, separately, rounded.
template <class T>
__global__ void reference_fwd(RefArgs a) {
  int const warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  int const lane = threadIdx.x % 32;
  int const rows = a.b * a.h * a.sq;
  if (warp >= rows) return;
  int const i = warp % a.sq;
  int const hi = (warp / a.sq) % a.h;
  int const bi = warp / (a.sq * a.h);
  int const hk = hi / (a.h / a.hkv);
  T const* q = static_cast<T const*>(a.q) + bi * a.qs.batch + i * a.qs.row + hi * a.qs.head;
  T const* k = static_cast<T const*>(a.k) + bi * a.ks.batch + hk * a.ks.head;
  T const* v = static_cast<T const*>(a.v) + bi * a.vs.batch + hk * a.vs.head;
  float qr[kRefMaxDimPerLane];
  for (int t = 0; t < kRefMaxDimPerLane; ++t) {
    int const di = lane + 32 * t;
    qr[t] = di < a.d ? to_float(q[di]) : 0.f;
  }
  int j_end = a.sk;
  if (a.causal) { j_end = min(a.sk, max(0, i + a.sk - a.sq + 1)); }
  auto score = [&](int j) {
    float s = 0.f;
    for (int t = 0; t < kRefMaxDimPerLane; ++t) {
      int const di = lane + 32 * t;
      if (di < a.d) s += qr[t] * to_float(k[j * a.ks.row + di]);
    }
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
    return s * a.scale;
  };
  float m = -INFINITY, l = 0.f;
  for (int j = 0; j < j_end; ++j) {
    float const s = score(j);
    float const m_new = fmaxf(m, s);
    l = l * expf(m - m_new) + expf(s - m_new);
    m = m_new;
  }
  float o32[kRefMaxDimPerLane] = {}, o16[kRefMaxDimPerLane] = {};
  for (int j = 0; j < j_end; ++j) {
    float const p = expf(score(j) - m);
    float const p16 = to_float(from_float<T>(p));
    for (int t = 0; t < kRefMaxDimPerLane; ++t) {
      int const di = lane + 32 * t;
      if (di < a.d) {
        float const vv = to_float(v[j * a.vs.row + di]);
        o32[t] += p * vv;
        o16[t] += p16 * vv;
      }
    }
  }
  float const inv = j_end > 0 ? 1.f / l : 0.f;
  int64_t const orow = ((int64_t(bi) * a.sq + i) * a.h + hi) * a.d;
  for (int t = 0; t < kRefMaxDimPerLane; ++t) {
    int const di = lane + 32 * t;
    if (di < a.d) {
      a.o32[orow + di] = o32[t] * inv;
      a.o16p[orow + di] = to_float(from_float<T>(o16[t] * inv));
    }
  }
  if (lane == 0) {
    a.lse[(int64_t(bi) * a.h + hi) * a.sq + i] = j_end > 0 ? m + logf(l) : -INFINITY;
  }
}

// ---------------------------------------------------------------------------
// Host side

struct Config {
  int hdim = 128;
  DType dtype = DType::kBF16;
  bool causal = false;
  int batch = 2, seqlen_q = 1024, seqlen_k = -1, heads = 16, heads_kv = -1;
  bool pad = false, check = true, time = true;
  int iters = 20, warmup = 5;
  uint64_t seed = 1;
  float scale = -1.f;
};

struct Tensor4 {
  void* ptr = nullptr;
  dash_fa3::TensorStrides st{};
  int64_t numel = 0;  // allocated elements
};

static Tensor4 alloc_bshd(int b, int s, int h, int d, bool pad) {
  Tensor4 t;
  int64_t const row_pad = pad ? 24 : 0;    // elements; keeps 16-byte alignment
  int64_t const batch_pad = pad ? 64 : 0;
  t.st.head = d;
  t.st.row = int64_t(h) * d + row_pad;
  t.st.batch = int64_t(s) * t.st.row + batch_pad;
  t.numel = int64_t(b) * t.st.batch;
  CHECK_CUDA(cudaMalloc(&t.ptr, t.numel * 2));
  return t;
}

static const char* dtype_name(DType t) { return t == DType::kBF16 ? "bf16" : "fp16"; }

struct Result {
  bool ok = true;
  double err_l2 = 0, ref16_l2 = 0, err_max = 0, ref16_max = 0, lse_err = 0;
  int64_t nan_o = 0, bad_lse = 0;
  double ms = 0, tflops = 0;
};

template <class T>
static void launch_fill(void* p, const Tensor4& t, int b, int s, int h, int d, uint64_t seed) {
  fill_value<T><<<1024, 256>>>(static_cast<T*>(p), t.numel, NAN);
  fill_normal<T><<<2048, 256>>>(static_cast<T*>(p), b, s, h, d, t.st.batch, t.st.row, t.st.head, seed);
  CHECK_CUDA(cudaGetLastError());
}

static Result run_one(const Config& c) {
  int const sk = c.seqlen_k > 0 ? c.seqlen_k : c.seqlen_q;
  int const hkv = c.heads_kv > 0 ? c.heads_kv : c.heads;
  int const d = c.hdim;
  float const scale = c.scale > 0 ? c.scale : 1.f / std::sqrt(float(d));
  Tensor4 q = alloc_bshd(c.batch, c.seqlen_q, c.heads, d, c.pad);
  Tensor4 k = alloc_bshd(c.batch, sk, hkv, d, c.pad);
  Tensor4 v = alloc_bshd(c.batch, sk, hkv, d, c.pad);
  Tensor4 o = alloc_bshd(c.batch, c.seqlen_q, c.heads, d, c.pad);
  int64_t const lse_n = int64_t(c.batch) * c.heads * c.seqlen_q;
  float* lse = nullptr;
  CHECK_CUDA(cudaMalloc(&lse, lse_n * sizeof(float)));
  bool const bf16 = c.dtype == DType::kBF16;
  auto fill = [&](Tensor4& t, int s, int h, uint64_t seed) {
    if (bf16) launch_fill<__nv_bfloat16>(t.ptr, t, c.batch, s, h, d, seed);
    else launch_fill<__half>(t.ptr, t, c.batch, s, h, d, seed);
  };
  fill(q, c.seqlen_q, c.heads, c.seed * 3 + 0);
  fill(k, sk, hkv, c.seed * 3 + 1);
  fill(v, sk, hkv, c.seed * 3 + 2);
  auto poison = [&]() {
    if (bf16) fill_value<__nv_bfloat16><<<1024, 256>>>(static_cast<__nv_bfloat16*>(o.ptr), o.numel, NAN);
    else fill_value<__half><<<1024, 256>>>(static_cast<__half*>(o.ptr), o.numel, NAN);
    fill_float<<<1024, 256>>>(lse, lse_n, NAN);
    CHECK_CUDA(cudaGetLastError());
  };

  int num_sms = 0, dev = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  dash_fa3::FwdParams p{};
  p.q = q.ptr; p.k = k.ptr; p.v = v.ptr; p.o = o.ptr; p.lse = lse;
  p.q_stride = q.st; p.k_stride = k.st; p.v_stride = v.st; p.o_stride = o.st;
  p.batch = c.batch; p.seqlen_q = c.seqlen_q; p.seqlen_k = sk; p.heads = c.heads; p.heads_kv = hkv;
  p.headdim = d; p.softmax_scale = scale; p.softmax_scale_log2 = scale * 1.4426950408889634f;
  p.num_sms = num_sms; p.tile_counter = nullptr;

  Result r;
  poison();
  if (!dispatch_fwd(d, c.dtype, c.causal, p, 0)) {
    throw std::runtime_error("variant not built: hdim " + std::to_string(d) + " " + dtype_name(c.dtype) +
                             (c.causal ? " causal" : " full"));
  }
  CHECK_CUDA(cudaDeviceSynchronize());

  if (c.check) {
    int64_t const on = int64_t(c.batch) * c.seqlen_q * c.heads * d;
    float *o32, *o16p, *lse_ref;
    CHECK_CUDA(cudaMalloc(&o32, on * 4));
    CHECK_CUDA(cudaMalloc(&o16p, on * 4));
    CHECK_CUDA(cudaMalloc(&lse_ref, lse_n * 4));
    RefArgs a{q.ptr, k.ptr, v.ptr, q.st, k.st, v.st, o32, o16p, lse_ref,
              c.batch, c.seqlen_q, sk, c.heads, hkv, d, scale, c.causal};
    int const rows = c.batch * c.heads * c.seqlen_q;
    int const blocks = (rows + 3) / 4;
    if (bf16) reference_fwd<__nv_bfloat16><<<blocks, 128>>>(a);
    else reference_fwd<__half><<<blocks, 128>>>(a);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<float> h32(on), h16(on), hl(lse_n), hlr(lse_n);
    std::vector<uint16_t> ho(o.numel);
    CHECK_CUDA(cudaMemcpy(h32.data(), o32, on * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(h16.data(), o16p, on * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hl.data(), lse, lse_n * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hlr.data(), lse_ref, lse_n * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(ho.data(), o.ptr, o.numel * 2, cudaMemcpyDeviceToHost));
    auto half_bits_to_float = [&](uint16_t bits) {
      if (bf16) { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
      __half_raw raw; raw.x = bits; return __half2float(__half(raw));
    };
    double se = 0, s16 = 0, sref = 0;
    for (int bi = 0; bi < c.batch; ++bi)
      for (int i = 0; i < c.seqlen_q; ++i)
        for (int hi = 0; hi < c.heads; ++hi)
          for (int di = 0; di < d; ++di) {
            int64_t const ri = ((int64_t(bi) * c.seqlen_q + i) * c.heads + hi) * d + di;
            float const got = half_bits_to_float(ho[bi * o.st.batch + i * o.st.row + hi * o.st.head + di]);
            if (!std::isfinite(got)) { ++r.nan_o; continue; }
            double const e = double(got) - h32[ri], e16 = double(h16[ri]) - h32[ri];
            se += e * e; s16 += e16 * e16; sref += double(h32[ri]) * h32[ri];
            r.err_max = std::max(r.err_max, std::fabs(e));
            r.ref16_max = std::max(r.ref16_max, std::fabs(e16));
          }
    double const norm = std::sqrt(std::max(sref, 1e-30));
    r.err_l2 = std::sqrt(se) / norm;
    r.ref16_l2 = std::sqrt(s16) / norm;
    for (int64_t i = 0; i < lse_n; ++i) {
      float const got = hl[i], want = hlr[i];
      if (std::isinf(want) && want < 0) {
        if (!(std::isinf(got) && got < 0)) ++r.bad_lse;
        continue;
      }
      if (!std::isfinite(got)) { ++r.bad_lse; continue; }
      double const e = std::fabs(double(got) - want);
      r.lse_err = std::max(r.lse_err, e);
      if (e > 1e-3 + 1e-5 * std::fabs(want)) ++r.bad_lse;
    }
    r.ok = r.nan_o == 0 && r.bad_lse == 0 && r.err_l2 <= 2 * r.ref16_l2 + 1e-4 &&
           r.err_max <= 4 * r.ref16_max + 1e-3;
    CHECK_CUDA(cudaFree(o32));
    CHECK_CUDA(cudaFree(o16p));
    CHECK_CUDA(cudaFree(lse_ref));
  }

  if (c.time) {
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    for (int i = 0; i < c.warmup; ++i) dispatch_fwd(d, c.dtype, c.causal, p, 0);
    std::vector<float> times;
    for (int i = 0; i < c.iters; ++i) {
      CHECK_CUDA(cudaEventRecord(e0));
      dispatch_fwd(d, c.dtype, c.causal, p, 0);
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    r.ms = times[times.size() / 2];
    double flops = 4.0 * c.batch * c.heads * double(c.seqlen_q) * sk * d;
    if (c.causal) flops /= 2;
    r.tflops = flops / (r.ms * 1e-3) / 1e12;
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
  }
  CHECK_CUDA(cudaFree(q.ptr)); CHECK_CUDA(cudaFree(k.ptr)); CHECK_CUDA(cudaFree(v.ptr));
  CHECK_CUDA(cudaFree(o.ptr)); CHECK_CUDA(cudaFree(lse));
  return r;
}

static void print_result(const Config& c, const Result& r) {
  int const sk = c.seqlen_k > 0 ? c.seqlen_k : c.seqlen_q;
  int const hkv = c.heads_kv > 0 ? c.heads_kv : c.heads;
  std::printf("hdim=%3d %s %-6s b=%d sq=%d sk=%d h=%d hkv=%d pad=%d", c.hdim, dtype_name(c.dtype),
              c.causal ? "causal" : "full", c.batch, c.seqlen_q, sk, c.heads, hkv, int(c.pad));
  if (c.check) {
    std::printf(" | %s err_l2=%.2e (ref16 %.2e) err_max=%.2e (ref16 %.2e) lse_err=%.2e nan_o=%lld bad_lse=%lld",
                r.ok ? "PASS" : "FAIL", r.err_l2, r.ref16_l2, r.err_max, r.ref16_max, r.lse_err,
                (long long)r.nan_o, (long long)r.bad_lse);
  }
  if (c.time) std::printf(" | %.3f ms %.1f TFLOP/s", r.ms, r.tflops);
  std::printf("\n");
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  Config c;
  bool grid = false;
  std::vector<int> grid_hdims = {64, 128};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("missing value for " + a);
      return argv[++i];
    };
    if (a == "--hdim") c.hdim = std::stoi(next());
    else if (a == "--dtype") { std::string t = next(); c.dtype = t == "fp16" ? DType::kFP16 : DType::kBF16; }
    else if (a == "--causal") c.causal = std::stoi(next()) != 0;
    else if (a == "--batch") c.batch = std::stoi(next());
    else if (a == "--seqlen_q" || a == "--seqlen") c.seqlen_q = std::stoi(next());
    else if (a == "--seqlen_k") c.seqlen_k = std::stoi(next());
    else if (a == "--heads") c.heads = std::stoi(next());
    else if (a == "--heads_kv") c.heads_kv = std::stoi(next());
    else if (a == "--pad") c.pad = std::stoi(next()) != 0;
    else if (a == "--check") c.check = std::stoi(next()) != 0;
    else if (a == "--time") c.time = std::stoi(next()) != 0;
    else if (a == "--iters") c.iters = std::stoi(next());
    else if (a == "--warmup") c.warmup = std::stoi(next());
    else if (a == "--seed") c.seed = std::stoull(next());
    else if (a == "--scale") c.scale = std::stof(next());
    else if (a == "--grid") grid = true;
    else if (a == "--hdims") {
      grid_hdims.clear();
      std::string s = next();
      for (size_t pos = 0; pos < s.size();) {
        size_t e = s.find(',', pos);
        if (e == std::string::npos) e = s.size();
        grid_hdims.push_back(std::stoi(s.substr(pos, e - pos)));
        pos = e + 1;
      }
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  try {
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
    if (!grid) {
      Result r = run_one(c);
      print_result(c, r);
      return r.ok ? 0 : 1;
    }
    c.check = false;
    c.time = true;
    for (int hd : grid_hdims) {
      for (int causal = 0; causal < 2; ++causal) {
        for (int s = 512; s <= 16384; s *= 2) {
          Config g = c;
          g.hdim = hd; g.causal = causal; g.dtype = DType::kBF16;
          g.seqlen_q = s; g.seqlen_k = s; g.heads = 2048 / hd; g.heads_kv = g.heads; g.batch = 16384 / s;
          print_result(g, run_one(g));
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 3;
  }
  return 0;
}
