// Qualifiers for small functions shared by host and device code. Headers that
// use them include no CUDA header, so a plain host compiler (the torch binding,
// the CPU tests' C++ drivers) compiles them too: there the macro is plain
// `inline`.
#pragma once

#if defined(__CUDACC__)
#define DASH_FA3_HD __host__ __device__ __forceinline__
#else
#define DASH_FA3_HD inline
#endif

namespace dash_fa3 {

DASH_FA3_HD int imin(int a, int b) { return a < b ? a : b; }
DASH_FA3_HD int imax(int a, int b) { return a > b ? a : b; }

}  // namespace dash_fa3
