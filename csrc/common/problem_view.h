// A problem's view of a (rows, d) tensor, or of a transposed (d, rows) one,
// from the problem's first row (common/seqlen_info.h), for the kernels' TMA
// loads and stores. A packed document starts at its row offset, and its last
// tiles also reach into the next document's rows, which the kernels mask or
// leave unstored. A dense problem's view is the tensor's own.
#pragma once

#include <cute/tensor.hpp>

namespace dash_fa3 {

// kRowMode: the mode that indexes rows (1 for a transposed (d, rows) view).
template <bool kPacked, int kRowMode = 0, class View>
CUTE_DEVICE auto rows_from(View const& view, int row0) {
  if constexpr (!kPacked) {
    return view;
  } else if constexpr (kRowMode == 0) {
    return cute::domain_offset(cute::make_coord(row0, 0), view);
  } else {
    return cute::domain_offset(cute::make_coord(0, row0), view);
  }
}

// The (row, dim, head, batch) shape of a value-head-dim tensor (V, O, dO, dV)
// from its head-dim counterpart's (K, Q, Q, K): the same rows, heads and
// batch, kHeadDimV columns. With equal head dims the shape itself, so those
// kernels address the value tensors exactly as the others.
template <int kHeadDim, int kHeadDimV, class Shape>
CUTE_HOST_DEVICE Shape value_shape(Shape const& head_dim_shape) {
  if constexpr (kHeadDimV == kHeadDim) {
    return head_dim_shape;
  } else {
    using cute::get;
    return cute::make_shape(get<0>(head_dim_shape), int32_t(kHeadDimV), get<2>(head_dim_shape),
                            get<3>(head_dim_shape));
  }
}

}  // namespace dash_fa3
