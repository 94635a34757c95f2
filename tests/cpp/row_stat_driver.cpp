// CPU driver of tests/test_row_stat_layout.py: csrc/common/row_stat_layout.h
// compiled with the host compiler (no CUDA). Reads block_m values from stdin;
// per block_m writes row_stat_pos(block_m, n) for n in [0, block_m), then
// row_stat_row(block_m, p) for p in [0, block_m), as raw native-endian int32.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <vector>

#include "common/row_stat_layout.h"

int main() {
  std::vector<int32_t> out;
  int block_m;
  while (std::cin >> block_m) {
    for (int n = 0; n < block_m; ++n) { out.push_back(dash_fa3::row_stat_pos(block_m, n)); }
    for (int p = 0; p < block_m; ++p) { out.push_back(dash_fa3::row_stat_row(block_m, p)); }
  }
  std::fwrite(out.data(), sizeof(int32_t), out.size(), stdout);
  return 0;
}
