// Online softmax over SM90 WGMMA accumulator fragments, in fp32 with exp2 on
// log2(e)-scaled scores.
//
// A thread of a 64xN WGMMA holds two rows of the tile (r = 0: row, r = 1:
// row + 8); its register i = c + 2*r + 4*v holds column 8*v + 2*(lane%4) + c.
// The four threads of a quad (lanes 4k..4k+3) share the same two rows.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace dash_fa3 {

// Number of 8-column blocks (v) in an accumulator fragment.
template <class Frag>
CUTE_HOST_DEVICE constexpr int fragment_col_blocks() {
  using namespace cute;
  using L = typename Frag::layout_type;
  static_assert(decltype(size<0, 0>(L{}))::value == 2 && decltype(size<0, 1>(L{}))::value == 2);
  static_assert(decltype(size<1>(L{}))::value == 1 && decltype(size<2>(L{}))::value == 1,
                "one WGMMA atom per thread along M and N");
  return decltype(size<0, 2>(L{}))::value;
}

CUTE_DEVICE float quad_allreduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

CUTE_DEVICE float quad_allreduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Running softmax state of the two rows a thread holds.
struct RowSoftmax {
  float row_max[2];  // running max of the raw (unscaled) scores, quad-uniform
  float row_sum[2];  // this thread's part of sum(exp(scale * (s - row_max)))
  float scale_log2;  // softmax_scale * log2(e); must be > 0

  CUTE_DEVICE explicit RowSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // Turns the scores in s into unnormalised probabilities in place and
  // returns in o_scale the factor by which the output accumulator (built
  // against the previous row max) must be multiplied.
  // kMaybeEmptyRow: some row may be all -inf so far (masked iterations); then
  // the max is -inf and the exponent offset is taken as 0 to avoid inf - inf.
  template <bool kFirst, bool kMaybeEmptyRow, class Frag>
  CUTE_DEVICE void update(Frag& s, float (&o_scale)[2]) {
    constexpr int kV = fragment_col_blocks<Frag>();
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      float m = kFirst ? -INFINITY : row_max[r];
      CUTE_UNROLL
      for (int v = 0; v < kV; ++v) {
        m = fmaxf(m, fmaxf(s(4 * v + 2 * r), s(4 * v + 2 * r + 1)));
      }
      m = quad_allreduce_max(m);
      float const m_scaled = (kMaybeEmptyRow && m == -INFINITY) ? 0.f : m * scale_log2;
      o_scale[r] = kFirst ? 1.f : exp2f(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum = 0.f;
      CUTE_UNROLL
      for (int v = 0; v < kV; ++v) {
        CUTE_UNROLL
        for (int c = 0; c < 2; ++c) {
          float const p = exp2f(fmaf(s(4 * v + 2 * r + c), scale_log2, -m_scaled));
          s(4 * v + 2 * r + c) = p;
          sum += p;
        }
      }
      row_sum[r] = kFirst ? sum : fmaf(row_sum[r], o_scale[r], sum);
    }
  }

  // Final normalisation: o_scale = 1 / rowsum (0 for a row that attends no
  // key), lse = natural-log logsumexp of the scaled scores (-inf for such a row).
  CUTE_DEVICE void finalize(float softmax_scale, float (&o_scale)[2], float (&lse)[2]) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      float const sum = quad_allreduce_sum(row_sum[r]);
      bool const empty = !(sum > 0.f);
      o_scale[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + logf(sum);
    }
  }
};

// Multiplies each accumulator row r of o by factor[r].
template <class Frag>
CUTE_DEVICE void scale_rows(Frag& o, float const (&factor)[2]) {
  constexpr int kV = fragment_col_blocks<Frag>();
  CUTE_UNROLL
  for (int v = 0; v < kV; ++v) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      o(4 * v + 2 * r) *= factor[r];
      o(4 * v + 2 * r + 1) *= factor[r];
    }
  }
}

}  // namespace dash_fa3
