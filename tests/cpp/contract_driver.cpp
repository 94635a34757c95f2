// CPU driver of tests/test_contract_cpp.py: runs the kernels' plain-C++
// headers (the schedule decode, the block ranges, the backward tile sizes,
// the dQ fragment order) on
// inputs from Python, compiled with the host compiler (no CUDA), and writes
// the results to stdout as raw native-endian int32.
//
//   contract_driver decode BUNDLE   per buffer of the bundle, per task row, per
//                                   step: q_tile, rank
//   contract_driver geometry        stdin: "seqlen_q seqlen_k block_m block_n
//                                   window_left window_right" lines; per line:
//                                   per Q tile kv_range begin, end, kv_unmasked
//                                   begin, end; per KV tile q_range begin, end,
//                                   q_unmasked begin, end
//   contract_driver blocks          stdin: head dims; per head dim bwd_block_m,
//                                   bwd_block_n, bwd_mma_warpgroups, bwd_chains
//   contract_driver dqfrag          stdin: "block_m hdim" pairs; per pair
//                                   dq_frag_layout_ok, then if it holds:
//                                   dq_frag_atom_cols, dq_frag_offset of every
//                                   (m, c), row-major,
//                                   and the offset of every (warpgroup, tid, r)
//                                   (dq_frag_wg_base + dq_frag_reg_offset)
//   contract_driver packed          stdin: "block_m batch cu_0 ... cu_batch" lines
//                                   (packed document offsets); per line: the
//                                   padded total packed_padded_offset(cu_batch,
//                                   batch, block_m), then packed_row_of of every
//                                   padded row below it
// A bundle is flat schedule buffers back to back (dash_fa3/schedule/export.py).
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "common/dq_accum_layout.h"
#include "common/packed_order.h"
#include "common/seqlen_info.h"
#include "kernel_contract.h"
#include "schedules/schedule_metadata.h"

namespace S = dash_fa3::schedule;

namespace {

int fail(std::string const& what) {
  std::cerr << "contract_driver: " << what << "\n";
  return 2;
}

void emit(std::vector<int32_t> const& out) {
  std::fwrite(out.data(), sizeof(int32_t), out.size(), stdout);
}

int decode(char const* path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) { return fail(std::string("cannot open ") + path); }
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::vector<int32_t> buf(bytes.size() / sizeof(int32_t));
  std::copy(bytes.begin(), bytes.begin() + buf.size() * sizeof(int32_t), reinterpret_cast<char*>(buf.data()));
  std::vector<int32_t> out;
  for (size_t pos = 0; pos < buf.size();) {
    int32_t const* header = buf.data() + pos;
    if (buf.size() - pos < size_t(S::kHeaderLen) || header[S::kHMagic] != S::kMagic ||
        header[S::kHVersion] != S::kVersion) {
      return fail("bad schedule header at entry " + std::to_string(pos));
    }
    int64_t const len = S::buffer_len(header);
    if (int64_t(buf.size() - pos) < len) { return fail("truncated schedule buffer"); }
    dash_fa3::TileGeometry const geo = S::tile_geometry_of(header);
    S::RankParams const rank = S::rank_params_of(header);
    int32_t const* tasks = S::tasks_of(header, header);
    for (int t = 0; t < header[S::kHNumTasks]; ++t) {
      int32_t const* row = S::task_row(tasks, t);
      for (int s = 0; s < row[S::kCNSteps]; ++s) {
        S::StepInfo const st = S::decode_step(geo, rank, row, s);
        out.push_back(st.q_tile);
        out.push_back(st.rank);
      }
    }
    pos += size_t(len);
  }
  emit(out);
  return 0;
}

int geometry() {
  std::vector<int32_t> out;
  int seqlen_q, seqlen_k, block_m, block_n, left, right;
  while (std::cin >> seqlen_q >> seqlen_k >> block_m >> block_n >> left >> right) {
    dash_fa3::TileGeometry const g{seqlen_q, seqlen_k, block_m, block_n, left, right};
    for (int q = 0; q < g.n_q(); ++q) {
      dash_fa3::BlockRange const r = g.kv_range(q), u = g.kv_unmasked(q);
      out.insert(out.end(), {r.begin, r.end, u.begin, u.end});
    }
    for (int kv = 0; kv < g.n_kv(); ++kv) {
      dash_fa3::BlockRange const r = g.q_range(kv), u = g.q_unmasked(kv);
      out.insert(out.end(), {r.begin, r.end, u.begin, u.end});
    }
  }
  emit(out);
  return 0;
}

int blocks() {
  std::vector<int32_t> out;
  int headdim;
  while (std::cin >> headdim) {
    out.insert(out.end(), {dash_fa3::bwd_block_m(headdim), dash_fa3::bwd_block_n(headdim),
                           dash_fa3::bwd_mma_warpgroups(headdim), dash_fa3::bwd_chains(headdim) ? 1 : 0});
  }
  emit(out);
  return 0;
}

int dqfrag() {
  std::vector<int32_t> out;
  int block_m, hdim;
  while (std::cin >> block_m >> hdim) {
    bool const ok = dash_fa3::dq_frag_layout_ok(block_m, hdim);
    out.push_back(ok ? 1 : 0);
    if (!ok) { continue; }
    out.push_back(dash_fa3::dq_frag_atom_cols(block_m, hdim));
    for (int m = 0; m < block_m; ++m) {
      for (int c = 0; c < hdim; ++c) { out.push_back(dash_fa3::dq_frag_offset(block_m, hdim, m, c)); }
    }
    int const regs = dash_fa3::dq_frag_wg_cols(block_m, hdim) / 2;
    for (int wg = 0; wg < dash_fa3::dq_frag_warpgroups(hdim); ++wg) {
      for (int tid = 0; tid < dash_fa3::kDqFragWgThreads; ++tid) {
        for (int r = 0; r < regs; ++r) {
          out.push_back(dash_fa3::dq_frag_wg_base(block_m, hdim, wg) + dash_fa3::dq_frag_reg_offset(tid, r));
        }
      }
    }
  }
  emit(out);
  return 0;
}

int packed() {
  std::vector<int32_t> out;
  int block_m = 0, batch = 0;
  while (std::cin >> block_m >> batch) {
    std::vector<int> cu(batch + 1);
    for (int& c : cu) { std::cin >> c; }
    int64_t const total = dash_fa3::packed_padded_offset(cu[batch], batch, block_m);
    out.push_back(int32_t(total));
    for (int64_t r = 0; r < total; ++r) { out.push_back(dash_fa3::packed_row_of(r, cu.data(), batch, block_m)); }
  }
  emit(out);
  return 0;
}

// Per case: the buckets of the documents, then for every unit of the order
// buffer given (dash_fa3/fwd_order.py) its document and its unit within it.
int fwd_order() {
  std::vector<int32_t> out;
  int block_n = 0, batch = 0;
  while (std::cin >> block_n >> batch) {
    std::vector<int> cu_k(batch + 1), order(dash_fa3::packed_order_ints(batch));
    for (int& c : cu_k) { std::cin >> c; }
    for (int& o : order) { std::cin >> o; }
    for (int d = 0; d < batch; ++d) { out.push_back(dash_fa3::packed_order_bucket(cu_k[d + 1] - cu_k[d], block_n)); }
    for (int u = 0; u < order[0]; ++u) {
      int const s = dash_fa3::packed_order_position(order.data(), batch, u);
      out.push_back(dash_fa3::packed_order_document(order.data(), batch, s));
      out.push_back(u - dash_fa3::packed_order_first_unit(order.data(), s));
    }
  }
  emit(out);
  return 0;
}

// Per line "num_m_blocks grid": the dense causal forward's KV heads per section.
int causal_sections() {
  std::vector<int32_t> out;
  int num_m_blocks = 0, grid = 0;
  while (std::cin >> num_m_blocks >> grid) { out.push_back(dash_fa3::fwd_causal_section_kv_heads(num_m_blocks, grid)); }
  emit(out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string const cmd = argc > 1 ? argv[1] : "";
  if (cmd == "decode" && argc == 3) { return decode(argv[2]); }
  if (cmd == "geometry") { return geometry(); }
  if (cmd == "blocks") { return blocks(); }
  if (cmd == "dqfrag") { return dqfrag(); }
  if (cmd == "packed") { return packed(); }
  if (cmd == "fwd_order") { return fwd_order(); }
  if (cmd == "causal_sections") { return causal_sections(); }
  return fail("usage: contract_driver decode BUNDLE | geometry | blocks | dqfrag | packed | fwd_order | "
              "causal_sections");
}
