"""The kernel contract, defined once: the schedule metadata layout and the
backward tile sizes.

Python imports the names below; the build (``tools/build_config.py``) turns this
module into the C++ header ``kernel_contract.h`` (:func:`cpp_header`), so the
kernels, the launcher and the C++ harnesses read the same values.  Change a
field here and both languages change together.

This module is loaded by path by the build, before torch or numpy may be
importable: standard library only, no relative imports.

Flat buffer of one schedule (int32)::

    [ header (HEADER_LEN) | cta_offsets (header[offsets_len]) | tasks (num_tasks x NUM_COLS) ]

Static dispatch: CTA i runs task rows [cta_offsets[i], cta_offsets[i+1]) in
order.  Dynamic dispatch: CTAs claim rows in order from an atomic counter (no
offsets).  How a row's steps decode into (Q tile, rank) is
``csrc/schedules/schedule_metadata.h`` (C++, host and device) and
:mod:`.metadata` (Python); ``tests/test_contract_cpp.py`` compares the two.
"""

from __future__ import annotations

MAGIC = 0x44415348  # 'DASH'
# Bumped with every layout change (2: the GQA dK/dV turn column removed;
# 3: the mask kind and the window instead of the causal flag; 4: the cyclic
# legs' stride, as its log2, in the former reserved field; 5: dQ splits, each
# its own fp32 dQ accumulator, with the per-row rectangle of the SPLIT rank kind;
# 6: dkv_ordered, a GQA group's dK/dV added in head order into one accumulator;
# 7: the runs schedule, its RUN rank kind, and chains of a group's heads on one CTA;
# 8: head_section, the interleave schedule's unit order; 9: the groups schedule and
# dkv_chained = DKV_CHAINED_WHOLE; 10: group_interleave_log2, a row's steps over its whole
# group's Q tiles).
METADATA_VERSION = 10

# Header fields, by index.
HEADER_FIELDS = (
    "magic",           # MAGIC
    "version",         # METADATA_VERSION
    "schedule",        # index into SCHEDULES
    "dispatch",        # DISPATCH_STATIC / DISPATCH_DYNAMIC
    "rank_kind",       # RANK_ASC / RANK_DESC / RANK_SHIFT / RANK_SPLIT / RANK_RUN: which rank rule decodes the steps
    "num_ctas",        # persistent CTAs to launch (<= SM count)
    "num_tasks",       # rows in the task table
    "num_cols",        # NUM_COLS
    "batch", "heads", "heads_kv", "seqlen_q", "seqlen_k", "block_m", "block_n",
    "mask",            # MASK_FULL / MASK_CAUSAL / MASK_LOCAL: the kernel family the schedule is for
    "window_left",     # the window (bottom-right aligned, -1 unbounded): (-1, -1) full,
    "window_right",    # (-1, 0) causal, anything for local (csrc/common/block_range.h)
    "n_q", "n_kv",     # Q and KV tiles per head (n_q: the Q tiles the steps index, see group_interleave_log2)
    "rect_begin",      # R: first Q tile of the dense rectangle (SHIFT)
    "units_per_head",  # CTA units (KV tile pairs) per head (SHIFT; n_kv otherwise)
    "pairs_hi",        # units that carry a second ("hi") KV tile (SHIFT)
    "num_steps",       # total (task, step) pairs
    "offsets_len",     # num_ctas + 1 (static) or 0 (dynamic)
    "cyc_stride_log2", # slot i of a wave's segment starts its cyclic leg i << cyc_stride_log2 tiles on (SHIFT)
    "num_splits",      # dQ splits: fp32 dQ accumulators (and semaphore sets) the postprocess sums in order
    "dkv_ordered",     # 1: deterministic GQA adds each KV tile's dK/dV into one accumulator per KV head,
                       # the group's query heads in ascending order (a turn counter per KV tile)
    "dkv_chained",     # DKV_CHAINED_*: rows form chains (columns chain_before/after): consecutive query
                       # heads of a group at one KV tile on one CTA, dK/dV summed in registers, one
                       # epilogue each; ADD: it adds into the KV head's accumulator; WHOLE: every
                       # row is in a chain of its whole group (or, group_interleave_log2 > 0, is its
                       # whole group), which stores dK/dV in 16 bits
    "head_section",    # static units: 0 head by head (unit u = head * units + p); s > 0: heads in sections
                       # of s, a section's units KV tile by KV tile, its heads side by side (metadata.planned_wave)
    "group_interleave_log2",  # g > 0: a row is a KV tile of a whole group of 2^g query heads (columns head =
                       # the group's first, head_kv); its steps index the group's *virtual* Q tiles
                       # v = q * 2^g + j (query head head + j, Q tile q), whose KV ranges are Q tile q's,
                       # and every rank rule reads v as a Q tile of n_q * 2^g (.grouped); n_q is that count
)
(H_MAGIC, H_VERSION, H_SCHEDULE, H_DISPATCH, H_RANK_KIND, H_NUM_CTAS, H_NUM_TASKS, H_NUM_COLS,
 H_BATCH, H_HEADS, H_HEADS_KV, H_SEQLEN_Q, H_SEQLEN_K, H_BLOCK_M, H_BLOCK_N, H_MASK, H_WINDOW_LEFT,
 H_WINDOW_RIGHT, H_N_Q, H_N_KV, H_RECT_BEGIN, H_UNITS_PER_HEAD, H_PAIRS_HI, H_NUM_STEPS, H_OFFSETS_LEN,
 H_CYC_STRIDE_LOG2, H_NUM_SPLITS, H_DKV_ORDERED, H_DKV_CHAINED, H_HEAD_SECTION,
 H_GROUP_INTERLEAVE_LOG2) = range(len(HEADER_FIELDS))
HEADER_LEN = len(HEADER_FIELDS)

# Task-table columns, by index; one row per task (batch, q head, KV tile).
COLUMNS = (
    "batch", "head",   # q head
    "kv_tile",
    "n_steps",         # Q tiles the task visits
    "cyc_len", "cyc_base", "cyc_off",  # step s < cyc_len visits cyc_base + (cyc_off + s) % cyc_len
    "lin_base", "lin_dir",             # later steps visit lin_base + lin_dir * (s - cyc_len), lin_dir = +-1
    "role",            # ROLE_LO (lo or single tile of its unit) / ROLE_HI
    "seg_begin", "seg_end",  # units [seg_begin, seg_end) of this head run in this task's wave (SHIFT)
    "head_kv",
    "cta",             # static: the CTA that runs the row; dynamic: -1
    "unit",            # unit (pair) index within the head (informational)
    "split",           # the dQ split the task's adds go to (0 without splits)
    "split_begin",     # first KV tile of that split (SPLIT)
    "rect",            # first Q tile of the split's dense rectangle (SPLIT)
    "chain_before",    # rows of this row's chain before it (the CTA's previous rows): K, V and the dK/dV
                       # registers carry over from them (0: not continued)
    "chain_after",     # rows of the chain after it (0: the chain's epilogue is this row's)
)
(C_BATCH, C_HEAD, C_KV, C_N_STEPS, C_CYC_LEN, C_CYC_BASE, C_CYC_OFF, C_LIN_BASE, C_LIN_DIR,
 C_ROLE, C_SEG_BEGIN, C_SEG_END, C_HEAD_KV, C_CTA, C_UNIT, C_SPLIT, C_SPLIT_BEGIN, C_RECT, C_CHAIN_BEFORE,
 C_CHAIN_AFTER) = range(len(COLUMNS))
NUM_COLS = len(COLUMNS)

# Codes stored in the header and the rows (C++ enum name, codes in order).
SCHEDULES: tuple[str, ...] = ("fa3", "spt", "descending", "shift", "symmetric_shift", "lpt", "split", "runs",
                              "interleave", "sections", "groups", "grouped_sections", "grouped_shift",
                              "grouped_split")
#: Schedules whose rows hold a whole GQA group's dK/dV and store them in 16 bits: no fp32 partials.
WHOLE_GROUP_SCHEDULES = ("groups", "grouped_sections", "grouped_shift", "grouped_split")
DISPATCH_STATIC, DISPATCH_DYNAMIC = 0, 1
RANK_ASC, RANK_DESC, RANK_SHIFT, RANK_SPLIT, RANK_RUN = 0, 1, 2, 3, 4
ROLE_LO, ROLE_HI = 0, 1
DKV_UNCHAINED, DKV_CHAINED_ADD, DKV_CHAINED_WHOLE = 0, 1, 2
# Mask kinds by name (dash_fa3.variants.MASKS; C++: csrc/common/params.h MaskKind has the same values).
MASK_FULL, MASK_CAUSAL, MASK_LOCAL = 0, 1, 2
MASK_CODES = {"full": MASK_FULL, "causal": MASK_CAUSAL, "local": MASK_LOCAL}
ENUMS = {
    "Dispatch": (("kDispatchStatic", DISPATCH_STATIC), ("kDispatchDynamic", DISPATCH_DYNAMIC)),
    "RankKind": (("kRankAsc", RANK_ASC), ("kRankDesc", RANK_DESC), ("kRankShift", RANK_SHIFT),
                 ("kRankSplit", RANK_SPLIT), ("kRankRun", RANK_RUN)),
    "Role": (("kRoleLo", ROLE_LO), ("kRoleHi", ROLE_HI)),
    "DkvChained": (("kDkvUnchained", DKV_UNCHAINED), ("kDkvChainedAdd", DKV_CHAINED_ADD),
                   ("kDkvChainedWhole", DKV_CHAINED_WHOLE)),
    "MaskCode": (("kMaskFull", MASK_FULL), ("kMaskCausal", MASK_CAUSAL), ("kMaskLocal", MASK_LOCAL)),
}

# Backward tile sizes (block_m = Q rows per tile, block_n = KV rows per tile)
# per head dim.  64, 128 and 192 follow FlashAttention-3's Hopper backward;
# the others are our choice.  Above 128 the kernel's MMA warpgroups split the
# head dim of dK and dV and share the KV rows (csrc/kernels/bwd/bwd_traits.h):
# at 256 two warpgroups with one 64-row WGMMA of KV rows (dK and dV of 64 rows
# take d / 2 registers per thread), at 192 three warpgroups, 64 head-dim
# columns each, with 96 KV rows (96 registers per thread).  Head dims between
# entries round up to the next entry.
BWD_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    64: (128, 128),
    96: (64, 128),
    128: (64, 128),
    192: (64, 96),
    256: (64, 64),
}
# MMA warpgroups of the backward kernel per head dim (same entries).
BWD_MMA_WARPGROUPS: dict[int, int] = {64: 2, 96: 2, 128: 2, 192: 3, 256: 2}
# Whether the backward kernel of each entry runs chains (header dkv_chained, columns
# chain_before / chain_after: consecutive rows of one CTA sum their dK/dV in registers). Not with
# three MMA warpgroups: a chain keeps the dK/dV accumulators live across the MMA warps' task
# loop, and in their 160 registers that spills (csrc/kernels/bwd/bwd_traits.h, kChains). There
# every task clears and stores its own dK/dV, the launcher refuses chained tables, and the
# chaining schedules (groups, runs) are not defined for those tiles.
BWD_CHAINS: dict[int, bool] = {d: w != 3 for d, w in BWD_MMA_WARPGROUPS.items()}


def bwd_entry(headdim: int) -> int | None:
    """The entry of BWD_BLOCK_SIZES / BWD_MMA_WARPGROUPS / BWD_CHAINS that ``headdim`` uses: the first >= it
    (None: none)."""
    return next((d for d in sorted(BWD_BLOCK_SIZES) if 0 < headdim <= d), None)


def bwd_tiles_chain(block_m: int, block_n: int) -> bool:
    """Whether the backward kernel of (block_m, block_n) tiles runs chains (:data:`BWD_CHAINS`): every
    head dim with those tiles does; tiles of no head dim (the research model's) count as chaining."""
    return all(BWD_CHAINS[d] for d, tiles in BWD_BLOCK_SIZES.items() if tiles == (block_m, block_n))


def _check() -> None:
    assert sorted(BWD_MMA_WARPGROUPS) == sorted(BWD_BLOCK_SIZES), "one warpgroup count per backward tile entry"
    # The index constants above are unpacked from range(): a field inserted in
    # one list only must fail at import, not decode garbage on a GPU.
    g = globals()
    for prefix, names in (("H_", HEADER_FIELDS), ("C_", COLUMNS)):
        for i, name in enumerate(names):
            alias = "C_KV" if name == "kv_tile" else prefix + name.upper()
            if g[alias] != i:
                raise AssertionError(f"contract: {alias} = {g[alias]}, but field {name!r} is at {i}")
    if len(set(COLUMNS)) != NUM_COLS or len(set(HEADER_FIELDS)) != HEADER_LEN:
        raise AssertionError("contract: duplicate field name")


_check()


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def cpp_header() -> str:
    """The generated C++ header (``kernel_contract.h``): constants only, plain C++17."""
    out = [
        "// Generated by tools/build_config.py from dash_fa3/schedule/contract.py. Do not edit.",
        "// The kernel contract: schedule metadata layout and backward tile sizes (plain C++17,",
        "// host and device).",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace dash_fa3 {",
        "namespace schedule {",
        "",
        f"constexpr int32_t kMagic = 0x{MAGIC:08X};",
        f"constexpr int32_t kVersion = {METADATA_VERSION};",
        f"constexpr int kHeaderLen = {HEADER_LEN};",
        f"constexpr int kNumCols = {NUM_COLS};",
        "",
        "// Header indices (contract.H_*).",
        "enum Header : int {",
        *(f"  kH{_camel(n)} = {i}," for i, n in enumerate(HEADER_FIELDS)),
        "};",
        "",
        "// Task-table columns (contract.C_*).",
        "enum Column : int {",
        *(f"  kC{_camel(n)} = {i}," for i, n in enumerate(COLUMNS)),
        "};",
    ]
    for enum, members in ENUMS.items():
        out += ["", f"enum {enum} : int32_t {{", *(f"  {m} = {v}," for m, v in members), "};"]
    names = ", ".join(f'"{s}"' for s in SCHEDULES)
    out += [
        "",
        "// header[kHSchedule] indexes this list (contract.SCHEDULES).",
        f"constexpr int kNumSchedules = {len(SCHEDULES)};",
        f"inline constexpr char const* kScheduleNames[kNumSchedules] = {{{names}}};",
        "",
        "}  // namespace schedule",
        "",
        "// Backward tile sizes, MMA warpgroups and chains (contract.BWD_BLOCK_SIZES,",
        "// BWD_MMA_WARPGROUPS, BWD_CHAINS): a head dim uses the first entry >= it; 0",
        "// (false) means no backward kernel for that head dim.",
    ]
    dims = sorted(BWD_BLOCK_SIZES)
    for fn, kind, none, table in (("bwd_block_m", "int", 0, {d: BWD_BLOCK_SIZES[d][0] for d in dims}),
                                  ("bwd_block_n", "int", 0, {d: BWD_BLOCK_SIZES[d][1] for d in dims}),
                                  ("bwd_mma_warpgroups", "int", 0, BWD_MMA_WARPGROUPS),
                                  ("bwd_chains", "bool", False, BWD_CHAINS)):
        body = " : ".join(f"headdim <= {d} ? {str(table[d]).lower()}" for d in dims)
        none = str(none).lower()
        out.append(f"constexpr {kind} {fn}(int headdim) {{ return headdim <= 0 ? {none} : {body} : {none}; }}")
    out += ["", "}  // namespace dash_fa3", ""]
    return "\n".join(out)
