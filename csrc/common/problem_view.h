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

}  // namespace dash_fa3
