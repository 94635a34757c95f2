#include "bwd_workspace.h"

namespace dash_fa3 {
namespace {

// dq_accum is a bulk reduce-add target (16-byte aligned addresses): 128-byte
// alignment keeps every region, and so every dQ tile (a multiple of 128 bytes),
// on cache-line boundaries however the sizes before it round.
constexpr int64_t kAlign = 128;

int64_t round_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

BwdWorkspace make_bwd_workspace(const BwdWorkspaceShape& s, const at::Device& device) {
  const int64_t rows = s.batch * s.heads * s.seqlen_q_rounded;
  const int64_t slabs = s.dkv_slabs > 0 ? s.dkv_slabs : s.heads;
  const int64_t partial_k = s.gqa ? s.batch * slabs * s.seqlen_k * s.headdim : 0;
  const int64_t partial_v = s.gqa ? s.batch * slabs * s.seqlen_k * s.headdim_v : 0;
  const bool accumulate = s.gqa && slabs != s.heads && !s.dkv_ordered;  // added into: zeroed with the rest
  BwdWorkspace w{};
  int64_t off = 0;
  w.dpsum_offset = off;
  off = round_up(off + rows * int64_t(sizeof(float)));
  w.lse_log2_offset = off;
  off = round_up(off + rows * int64_t(sizeof(float)));
  const int64_t dk_offset = off;
  const int64_t zero_from_partials = off;
  off = round_up(off + partial_k * int64_t(sizeof(float)));
  const int64_t dv_offset = off;
  off = round_up(off + partial_v * int64_t(sizeof(float)));
  TORCH_CHECK(!(accumulate && s.dq_stored), "dash_fa3: internal: dK/dV accumulators are added into in "
              "non-deterministic calls only");
  const int64_t dq_offset = off;
  w.dq_split_floats = rows * s.headdim;  // a multiple of 128 bytes: whole tiles
  w.dq_split_sems = s.batch * s.heads * s.n_q;
  w.dq_accum_offset = off;
  off = round_up(off + s.dq_splits * w.dq_split_floats * int64_t(sizeof(float)));
  w.dq_semaphore_offset = off;
  const int64_t zero_begin = accumulate ? zero_from_partials : s.dq_stored ? off : dq_offset;
  off = round_up(off + s.dq_splits * w.dq_split_sems * int64_t(sizeof(int)));
  const int64_t dkv_sem_offset = off;
  off = round_up(off + s.dkv_sems * int64_t(sizeof(int)));
  const int64_t counter_offset = off;
  off = round_up(off + int64_t(sizeof(int)));

  w.buffer = at::empty({off}, at::TensorOptions().dtype(at::kByte).device(device));
  auto* base = static_cast<uint8_t*>(w.buffer.data_ptr());
  w.dpsum = reinterpret_cast<float*>(base + w.dpsum_offset);
  w.lse_log2 = reinterpret_cast<float*>(base + w.lse_log2_offset);
  w.dk_partial = s.gqa ? reinterpret_cast<float*>(base + dk_offset) : nullptr;
  w.dv_partial = s.gqa ? reinterpret_cast<float*>(base + dv_offset) : nullptr;
  w.dq_accum = reinterpret_cast<float*>(base + w.dq_accum_offset);
  w.dq_semaphore = reinterpret_cast<int*>(base + w.dq_semaphore_offset);
  w.dkv_semaphore = s.dkv_sems > 0 ? reinterpret_cast<int*>(base + dkv_sem_offset) : nullptr;
  w.task_counter = reinterpret_cast<int*>(base + counter_offset);
  w.zero_begin = base + zero_begin;
  w.zero_bytes = off - zero_begin;
  return w;
}

}  // namespace dash_fa3
