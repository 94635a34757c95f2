#include "api.h"
#include "message.h"

#include <c10/util/Exception.h>

namespace dash_fa3 {

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kFP16;
    default: TORCH_CHECK(false, msg("dash_fa3: ", name, " must be bfloat16 or float16, got ", t.scalar_type()));
  }
}

TensorStrides bshd_strides(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), msg("dash_fa3: ", name, " must be a CUDA tensor"));
  TORCH_CHECK(t.dim() == 4, msg("dash_fa3: ", name, " must be (batch, seqlen, heads, headdim), got ", t.sizes()));
  TORCH_CHECK(t.stride(-1) == 1, msg("dash_fa3: ", name, " must have a contiguous last dim"));
  // TMA addresses rows in 16-byte units.
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.stride(d) % 8 == 0 || t.size(d) == 1, msg("dash_fa3: ", name,
                " strides must be multiples of 8 elements (16 bytes), got ", t.strides()));
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, msg("dash_fa3: ", name,
              " must be 16-byte aligned"));
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

}  // namespace dash_fa3
