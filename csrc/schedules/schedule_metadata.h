// Device side of the backward schedules: the C++ mirror of
// dash_fa3/schedule/metadata.py (the specification; docs/schedule.md).
//
// A schedule reaches the kernel as one flat int32 buffer
//   [ header (kHeaderLen) | cta_offsets (header[kOffsetsLen]) | tasks (num_tasks x kNumCols) ]
// and decode_step() turns (task row, step) into (Q tile, rank). The function
// mirrors metadata.decode_step operation for operation: every division and
// modulo has non-negative operands, so C's truncation equals Python's floor.
// Nothing here depends on which schedule produced the buffer: adding a
// schedule adds no kernel instantiation.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DASH_FA3_HD __host__ __device__ __forceinline__
#else
#define DASH_FA3_HD inline
#endif

namespace dash_fa3::schedule {

constexpr int32_t kMagic = 0x44415348;  // 'DASH'
constexpr int32_t kVersion = 1;
constexpr int kHeaderLen = 24;
constexpr int kNumCols = 16;

// Header indices (metadata.H_*).
enum Header : int {
  kHMagic = 0, kHVersion, kHSchedule, kHDispatch, kHRankKind, kHNumCtas, kHNumTasks, kHNumCols,
  kHBatch, kHHeads, kHHeadsKv, kHSeqlenQ, kHSeqlenK, kHBlockM, kHBlockN, kHCausal,
  kHNQ, kHNKv, kHRectBegin, kHUnitsPerHead, kHPairsHi, kHNumSteps, kHOffsetsLen, kHReserved,
};

// Task-table columns (metadata.C_*).
enum Column : int {
  kCBatch = 0, kCHead, kCKv, kCNSteps, kCCycLen, kCCycBase, kCCycOff, kCLinBase, kCLinDir,
  kCRole, kCSegBegin, kCSegEnd, kCRankDkv, kCHeadKv, kCCta, kCUnit,
};

enum Dispatch : int32_t { kDispatchStatic = 0, kDispatchDynamic = 1 };
enum RankKind : int32_t { kRankAsc = 0, kRankDesc = 1, kRankShift = 2 };
enum Role : int32_t { kRoleLo = 0, kRoleHi = 1 };

DASH_FA3_HD int imin(int a, int b) { return a < b ? a : b; }
DASH_FA3_HD int imax(int a, int b) { return a > b ? a : b; }

struct StepInfo {
  int q_tile;  // Q tile this step visits
  int rank;    // position of this contribution in dQ tile q_tile's accumulation order
};

// metadata.decode_step. header and row point at int32 arrays laid out as above.
DASH_FA3_HD StepInfo decode_step(int32_t const* header, int32_t const* row, int step) {
  // ---- which Q tile
  int const cyc_len = row[kCCycLen];
  int q;
  if (step < cyc_len) {
    q = row[kCCycBase] + (row[kCCycOff] + step) % cyc_len;
  } else {
    q = row[kCLinBase] + row[kCLinDir] * (step - cyc_len);
  }
  int const kv = row[kCKv];
  // ---- kv_end(q): dQ tile q receives contributions from KV tiles [0, kv_end)
  int const n_kv = header[kHNKv];
  int kv_end;
  if (header[kHCausal]) {
    int const last_row = imin((q + 1) * header[kHBlockM], header[kHSeqlenQ]) - 1;
    int const reach = last_row + header[kHSeqlenK] - header[kHSeqlenQ];
    kv_end = reach < 0 ? 0 : imin(n_kv, reach / header[kHBlockN] + 1);
  } else {
    kv_end = n_kv;
  }
  // ---- rank in the accumulation order of dQ tile q
  int const kind = header[kHRankKind];
  if (kind == kRankAsc) { return {q, kv}; }
  if (kind == kRankDesc) { return {q, kv_end - 1 - kv}; }
  // kRankShift
  int const pa = row[kCSegBegin];
  int const pb = row[kCSegEnd];
  int const seg = pb - pa;
  int const pairs_hi = header[kHPairsHi];
  int const rect = header[kHRectBegin];
  int const base = imin(kv_end, pa) + imax(0, kv_end - n_kv + imin(pa, pairs_hi));
  int local;
  if (row[kCRole] == kRoleHi) {
    local = seg + kv - (n_kv - imin(pb, pairs_hi));
  } else if (q < rect) {
    local = imin(kv_end, pb) - 1 - kv;
  } else {
    int const width = header[kHNQ] - rect;
    int const qq = q - rect;
    int const slot = kv - pa;
    int const reps = seg / width;
    int const rem = seg % width;
    int const lt = imax(0, imin(qq + 1, rem) - imax(qq - step + 1, 0)) +
                   imax(0, rem - (width + qq - step + 1));
    local = step * reps + lt + slot / width;
  }
  return {q, base + local};
}

// Views into the flat buffer.
DASH_FA3_HD int32_t const* offsets_of(int32_t const* meta) { return meta + kHeaderLen; }
DASH_FA3_HD int32_t const* tasks_of(int32_t const* meta) {
  return meta + kHeaderLen + meta[kHOffsetsLen];
}
DASH_FA3_HD int32_t const* task_row(int32_t const* meta, int task) {
  return tasks_of(meta) + int64_t(task) * kNumCols;
}

}  // namespace dash_fa3::schedule
