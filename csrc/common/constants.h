// Numeric constants shared by host and device code (no CUDA or CuTe includes,
// so the torch binding compiled by the host compiler can use them too).
#pragma once

namespace dash_fa3 {

// log2(e): scores are scaled by it so the softmax can use exp2.
constexpr float kLog2e = 1.4426950408889634f;

// Dynamic shared memory one SM90 CTA may use (227 KiB): the budget every
// kernel's SharedStorage, and the forward's choice of O slots, are held to.
constexpr int kSm90SharedMemoryBytes = 227 * 1024;

}  // namespace dash_fa3
