// Logit softcapping (FA3's softcap, the Gemma 2 family): the scores become
// softcap * tanh(softmax_scale * q.k / softcap). The softcap instantiations
// (kSoftcap) take t = tanh(q.k * prescale), prescale = softmax_scale / softcap,
// and hand the softmax t with the scale softcap, so the softmax, its LSE and
// the backward's P = exp(softcap * t - lse) keep their code. The backward
// multiplies dS by the derivative 1 - t^2; dQ and dK keep softmax_scale.
#pragma once

#include "common/host_device.h"

namespace dash_fa3 {

// The scale the softmax applies to the scores it sees: softmax_scale, or with a
// softcap the softcap itself (its scores are then t in (-1, 1)).
DASH_FA3_HD float softmax_score_scale(float softmax_scale, float softcap) {
  return softcap > 0.f ? softcap : softmax_scale;
}

// The factor of q.k inside the tanh (unused without a softcap).
DASH_FA3_HD float softcap_prescale(float softmax_scale, float softcap) {
  return softcap > 0.f ? softmax_scale / softcap : 0.f;
}

#if defined(__CUDACC__)
// tanh.approx.f32 (one MUFU op; absolute error about 2^-11, below the 16-bit
// inputs' and P's rounding). FA3 uses the same instruction.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

}  // namespace dash_fa3
