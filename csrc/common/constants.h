// Numeric constants shared by host and device code (no CUDA or CuTe includes,
// so the torch binding compiled by the host compiler can use them too).
#pragma once

namespace dash_fa3 {

// log2(e): scores are scaled by it so the softmax can use exp2.
constexpr float kLog2e = 1.4426950408889634f;

}  // namespace dash_fa3
