// Host driver of tests/test_contract_cpp.py's cute check: for the backward
// kernel's own TiledMmaDq (kernels/bwd/bwd_traits.h) of each head dim, the
// (m, c) that cute's partition_C of an identity tensor gives every register of
// every MMA thread, written to stdout as raw int32 (per head dim: block_m,
// hdim, MMA threads, registers per thread, then per thread, per register: m, c).
// The kernel stores register i of mma_tid at the fragment-order offset of
// (warpgroup mma_tid / 128, mma_tid % 128, i); Python checks that this is
// where common/dq_accum_layout.h puts that (m, c).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/bwd/bwd_traits.h"

namespace {

template <int kHeadDim>
void emit_tile(std::vector<int32_t>& out) {
  using namespace cute;
  using Traits = dash_fa3::bwd::BwdTraits<kHeadDim, kHeadDim, cutlass::bfloat16_t, dash_fa3::MaskKind::kFull, false, false>;
  using Tile = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>;
  typename Traits::TiledMmaDq mma;
  auto const id = make_identity_tensor(Tile{});
  int const regs = int(size(partition_fragment_C(mma, Tile{})));
  out.insert(out.end(), {Traits::kBlockM, kHeadDim, Traits::kNumMmaThreads, regs});
  for (int t = 0; t < Traits::kNumMmaThreads; ++t) {
    auto const coords = mma.get_thread_slice(t).partition_C(id);
    for (int i = 0; i < regs; ++i) {
      out.push_back(int32_t(get<0>(coords(i))));
      out.push_back(int32_t(get<1>(coords(i))));
    }
  }
}

}  // namespace

int main() {
  std::vector<int32_t> out;
  emit_tile<64>(out);
  emit_tile<96>(out);
  emit_tile<128>(out);
  emit_tile<192>(out);
  std::fwrite(out.data(), sizeof(int32_t), out.size(), stdout);
  return 0;
}
