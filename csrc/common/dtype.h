// DType -> CUTLASS element type, and a dispatch helper for the non-templated
// entry points (preprocess, postprocess).
#pragma once

#include <cutlass/numeric_types.h>

#include <stdexcept>

#include "params.h"

namespace dash_fa3 {

template <DType kDType>
struct ElementOf;
template <>
struct ElementOf<DType::kBF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct ElementOf<DType::kFP16> {
  using type = cutlass::half_t;
};
template <DType kDType>
using Element = typename ElementOf<kDType>::type;

template <class T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<Element>{}) for the runtime dtype (C++17: generic lambdas
// read the type back with `typename decltype(tag)::type`).
template <class Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16: fn(TypeTag<cutlass::bfloat16_t>{}); return;
    case DType::kFP16: fn(TypeTag<cutlass::half_t>{}); return;
  }
  throw std::invalid_argument("dash_fa3: unknown DType");
}

}  // namespace dash_fa3
