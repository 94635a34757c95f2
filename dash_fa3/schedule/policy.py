"""``auto``: which concrete schedule a call runs.

The policy sits above both layers: it reads the kernel contract (geometry,
the schedules' entry points) and, under the opt-in ``model`` policy, the
research model's calibrated prediction. Neither layer imports it, so the
contract stays free of the model. ``dash_fa3.schedule`` exports the entry
points below, which accept ``auto``; the contract's own
(:mod:`.schedules`, :mod:`.lowering`) take concrete names only.

Policies of a deterministic ``auto``: ``table`` (the default: the rule of
:func:`table_pick`, from the measured bench grid) or ``model`` (the schedule
the calibrated simulator predicts fastest for the shape,
:func:`.model.calibration.best_schedule`). The environment variable
``DASH_FA3_AUTO_POLICY`` sets it at import; :func:`set_auto_policy` at run time.

A non-deterministic ``auto`` is :func:`nd_pick`'s order, or, where a Q tile takes few dQ adds
(:func:`nd_runs_ordered`), the deterministic ``auto`` in the kernel's deterministic mode, which
is the faster there; :func:`resolve_call` returns the schedule and that mode.
"""

from __future__ import annotations

import os

from . import grouped, lowering, schedules
from .contract import SCHEDULES, WHOLE_GROUP_SCHEDULES
from .geometry import Geometry, head_section
from .metadata import ScheduleMeta
from .schedules import SCHEDULE_NAMES, Schedule, _check_num_sms

AUTO_POLICIES = ("table", "model")
#: A non-deterministic GQA ``auto`` is ``groups`` where its plan's busiest CTA holds at most this
#: many times the steps of ``lpt``'s (:func:`nd_pick`).
GROUPS_MAX_LOAD_RATIO = 1.10
#: Keys per query from which a full or causal ``auto`` is ``sections`` (:func:`table_pick`).
SECTIONS_KEYS_PER_QUERY = 2
#: Within that region, under GQA, ``runs`` where a head has at most this many Q tiles and the runs'
#: dQ accumulators stay within RUNS_MAX_DQ_BYTES_PER_KV_BYTE of K's and V's bytes (:func:`table_pick`).
RUNS_MAX_Q_TILES = 4
RUNS_MAX_DQ_BYTES_PER_KV_BYTE = 4
#: Within that region, under GQA with a power-of-two group, a grouped schedule (:mod:`.grouped`)
#: where a head has at most this many Q tiles (:func:`table_pick`).
GROUPED_MAX_Q_TILES = 64
#: There ``grouped_split`` where an L2 section of the grouped view holds at most this many KV
#: heads, else ``grouped_sections`` (:func:`table_pick`).
GROUPED_SPLIT_MAX_SECTION_HEADS = 2
#: Outside it, ``grouped_split`` for a full mask where a head has at most GROUPED_FULL_MAX_Q_TILES
#: Q tiles, ``grouped_sections`` for a causal one where a KV head's group has at most
#: GROUPED_CAUSAL_MAX_GROUP_Q_TILES, its task's steps (:func:`table_pick`).
GROUPED_FULL_MAX_Q_TILES = 64
GROUPED_CAUSAL_MAX_GROUP_Q_TILES = 40
#: A full mask with keys within the queries takes the grouped view only where its tasks fill their
#: waves of the SMs at least this much on average (:func:`wave_fill`, :func:`table_pick`).
GROUPED_FULL_MIN_WAVE_FILL = 0.8
#: Under GQA where the grouped view is not taken, a full mask on head dim 128's 64 x 128 tiles with
#: at most this many Q tiles per head takes ``groups`` (:func:`table_pick`).
GROUPS_FULL_MAX_Q_TILES = 40
#: A full mask on head dim 64's square tiles with keys within the queries takes ``sections`` from
#: and up to these many KV tiles (:func:`table_pick`).
SECTIONS_FULL_SQUARE_KV_TILES = (16, 96)
#: Causal, otherwise ``spt``: from this many KV tiles, where the (query head, KV tile) tasks fill
#: fewer than SECTIONS_MAX_WAVES waves of the SMs ``sections`` up to SECTIONS_MAX_KV_TILES KV
#: tiles, else up to SYMMETRIC_MAX_WAVES waves ``symmetric_shift`` (:func:`table_pick`).
FEW_WAVES_MIN_KV_TILES = 16
SECTIONS_MAX_WAVES = 3
SECTIONS_MAX_KV_TILES = 48
SYMMETRIC_MAX_WAVES = 6
#: A non-deterministic ``auto`` of a full or causal mask runs the deterministic backward (the
#: deterministic ``auto`` schedule, its dQ adds in turns) where a Q tile takes at most this many
#: adds on average, and at most ND_ORDERED_DKV_TURNS_MAX_ADDS where the schedule also takes the
#: GQA dK/dV adds in turns (:func:`nd_runs_ordered`).
ND_ORDERED_MAX_ADDS = 4.5
ND_ORDERED_DKV_TURNS_MAX_ADDS = 4.0
_auto_policy = os.environ.get("DASH_FA3_AUTO_POLICY", "table")
if _auto_policy not in AUTO_POLICIES:
    raise ValueError(f"DASH_FA3_AUTO_POLICY must be one of {AUTO_POLICIES}, got {_auto_policy!r}")


def set_auto_policy(policy: str) -> str:
    """Set how a deterministic ``auto`` resolves ("table" or "model"); returns the previous
    policy.  Resolved schedules are cached per shape, so set it before the first call."""
    global _auto_policy
    if policy not in AUTO_POLICIES:
        raise ValueError(f"auto policy must be one of {AUTO_POLICIES}, got {policy!r}")
    old, _auto_policy = _auto_policy, policy
    return old


def get_auto_policy() -> str:
    return _auto_policy


def wave_fill(tasks: int, num_sms: int) -> float:
    """How full the waves of ``tasks`` equal tasks on ``num_sms`` SMs are on average (1.0: every wave full)."""
    waves = -(-tasks // num_sms)
    return tasks / (waves * num_sms) if waves else 1.0


def runs_dq_bytes_per_kv_byte(g: Geometry, num_sms: int = 132) -> float:
    """The bytes of ``runs``'s fp32 dQ accumulators (one per split) per byte of 16-bit K and V."""
    from .runs import run_layout
    num_splits = run_layout(g, num_sms)[-1]
    return num_splits * g.seqlen_q * g.heads * 4 / (g.seqlen_k * g.heads_kv * 2 * 2)


def table_pick(g: Geometry, headdim: int | None = None, num_sms: int = 132, *, whole_groups: bool = True) -> str:
    """The ``table`` policy's deterministic schedule for a full or causal mask.

    The rule is the best measured deterministic schedule per region of the H100
    bench grids (their runs and figures: docs/journal/auto-rule-history.md); a
    shape off the grids gets the rule of its region.

    Causal: ``spt`` (shortest KV tile first, descending accumulation) is the
    fastest measured order except with head dim 128's 64 x 128 tiles from 32 KV
    tiles on, where ``symmetric_shift``'s pairs of a long and a short KV tile per
    CTA level the work. Head dim 96 shares those tiles but not that result, so
    ``headdim`` tells the two apart.

    Full: every KV tile has the same length, and ``shift`` starts the KV tiles of
    a wave on distinct Q tiles of their cyclic walks, so their dQ adds do not
    wait on each other; it is fastest from a few KV tiles up to a length that
    depends on the tile shape, past which the queue order ``fa3`` is as fast or
    faster. Below those few KV tiles ``split``'s cyclic starts (1.03x ``fa3``'s
    speed at head dim 128 with 4 KV tiles). With head dim 64's square tiles, within
    ``SECTIONS_FULL_SQUARE_KV_TILES`` KV tiles ``sections`` instead: its heads side by side
    led ``shift`` by 0.6-2.5% on the grid from 16 to 64 KV tiles and off it at 48 and 96
    (run 16 of docs/journal/rect-bwd.md); at 128 it read 0.96-1.01 of ``fa3`` over three
    runs, and at head dim 128 it trails.

    Both shift orders measured slower where keys outnumber queries, so they are
    picked only where ``seqlen_k <= seqlen_q``.

    From ``SECTIONS_KEYS_PER_QUERY`` keys per query on, ``sections``: ``spt``'s
    tasks queued in L2 sections of heads, a section KV tile by KV tile with its
    heads side by side, so a head has few KV tiles in flight and they reach its
    Q tiles one step apart instead of all waiting on the same ones. Measured on
    the H100 on 16 of 17 rectangular shapes (2-32 keys per query, causal and
    full, MHA to MQA, head dim 64 and 128) it was the fastest of ``spt``,
    ``split``, ``interleave`` and ``sections``, at 0.61-0.97 of ``split``'s
    time (docs/journal/rect-bwd.md, run 9). The exception is a large GQA group with
    few Q tiles (8 x 256 x 8192, 16/2): a queue schedule writes a slab of fp32
    dK/dV per query head there, and ``runs``' chains add the group's once per
    KV tile. So with GQA, at most ``RUNS_MAX_Q_TILES`` Q tiles per head, and
    the runs' dQ accumulators (one per run a head meets) within
    ``RUNS_MAX_DQ_BYTES_PER_KV_BYTE`` of K's and V's bytes, ``runs``; not for head dim 192,
    whose kernel has no chains (:attr:`.Geometry.kernel_chains`).

    Where the group is a power of two, the grouped schedules make a task of a KV tile's whole
    group instead (:mod:`.grouped`): no fp32 dK/dV at all. Measured on the H100 (run 13 of
    docs/journal/rect-bwd.md) on 11 rectangular GQA shapes, ``grouped_sections`` took 0.44-0.91
    of the time of the better of ``sections`` and ``runs`` on 10, but 1.05x ``sections``' with 64
    Q tiles per head (1 x 4096 x 65536: with long tasks the epilogue weighs little); under MQA
    with two KV heads ``grouped_split`` took 0.93x ``grouped_sections``' time: there a KV head's
    virtual Q tiles fill the L2 budget alone (:func:`.geometry.head_section` of the grouped view
    is 1), and ``sections``' queue runs its KV tiles side by side from the same dQ tiles, which
    ``split``'s cyclic starts avoid; so did 1 x 4096 x 65536 (32/8, 64 Q tiles per head, two KV
    heads per section: ``grouped_split`` 0.93x ``sections``' time, where the queue schedules'
    fp32 dK/dV slabs of 32 query heads over 65536 keys are 2 GB written and read back). So under
    such GQA, at most ``GROUPED_MAX_Q_TILES`` Q tiles per head: ``grouped_split`` where the
    view's sections hold at most ``GROUPED_SPLIT_MAX_SECTION_HEADS`` KV heads, else
    ``grouped_sections``; for the tiles of head dims up to 128 (block_n 128), the ones measured
    and GPU-tested with them.
    ``whole_groups=False`` (a call that wants fp32 dK/dV partials) leaves them out.

    The grouped view pays off with fewer keys too, wherever the per-query-head fp32 dK/dV
    weighs against the work (run 14a of docs/journal/rect-bwd.md): under such GQA a full mask with
    at most ``GROUPED_FULL_MAX_Q_TILES`` Q tiles per head takes ``grouped_split`` (0.81-0.94 of
    ``shift``'s or ``sections``' time, 8-64 Q tiles per head), a causal one with at most
    ``GROUPED_CAUSAL_MAX_GROUP_Q_TILES`` Q tiles in a group (its longest task's steps)
    ``grouped_sections`` (0.79 of ``spt``'s time at 16, run 14a; 0.94 at 40, run 15). Causal with
    longer tasks keeps the MHA rule: the view's long triangular tasks ran 1.11x slower at 48
    (run 16) and 1.06-1.8x from 64 on (runs 14a, 15).

    The grouped view has a group's worth fewer tasks, so it is picked only where its (KV head,
    KV tile) tasks fill at least one wave of the SMs: with 96 of them on 132 SMs
    ``grouped_split`` ran at 0.84 of ``shift``'s speed (H200, run 15 of docs/journal/rect-bwd.md).
    Full tasks are all of one length, so there the waves must also be nearly full where ``shift``
    is the alternative: 192 tasks on 132 SMs fill their two waves 73%, and ``grouped_split`` ran at
    0.87 of ``shift``'s speed (run 16); at least ``GROUPED_FULL_MIN_WAVE_FILL``.

    Where the grouped view is not taken (a group that is not a power of two, or waves too empty),
    a full mask on head dim 128's 64 x 128 tiles with at most ``GROUPS_FULL_MAX_Q_TILES`` Q tiles
    per head takes ``groups``: it chains a group's query heads at a KV tile on one CTA and stores
    their dK/dV once, and ran at 1.04-1.07x ``shift``'s (or ``sections``') speed at 16-40 Q tiles
    per head, groups of 4 and 5, and 0.92x at 128 (run 16).

    A causal ``spt`` queue runs its longest KV tiles last, and where the tasks fill only a few
    waves their tail is the makespan. From ``FEW_WAVES_MIN_KV_TILES`` KV tiles, at most
    ``SYMMETRIC_MAX_WAVES`` waves of tasks take ``symmetric_shift``, which pairs a long and a
    short KV tile per CTA (measured 1.10x faster than ``spt`` at 3.9 and 5.8 waves, run 14a),
    and fewer than ``SECTIONS_MAX_WAVES`` waves take ``sections``, whose heads side by side
    keep the SMs on short KV tiles too (1.10-1.18x ``symmetric_shift``'s speed at 2.4 and 2.9
    waves, run 15), up to ``SECTIONS_MAX_KV_TILES`` KV tiles: with few long heads (64 and 128 KV
    tiles, 1.9 waves) it ran at 0.73-0.75 of ``symmetric_shift``'s speed (run 16); neither at
    head dim 96's tiles.
    """
    grouped_ok = (whole_groups and g.heads > g.heads_kv and grouped.applies(g) and g.block_n == 128
                  and g.batch * g.heads_kv * g.n_kv >= num_sms)
    if g.seqlen_k >= SECTIONS_KEYS_PER_QUERY * g.seqlen_q:
        if grouped_ok and g.n_q <= GROUPED_MAX_Q_TILES:
            return ("grouped_split" if head_section(g.grouped()) <= GROUPED_SPLIT_MAX_SECTION_HEADS
                    else "grouped_sections")
        if (g.kernel_chains and g.heads > g.heads_kv and g.n_q <= RUNS_MAX_Q_TILES
                and runs_dq_bytes_per_kv_byte(g, num_sms) <= RUNS_MAX_DQ_BYTES_PER_KV_BYTE):
            return "runs"
        return "sections"
    keys_within = g.seqlen_k <= g.seqlen_q
    if grouped_ok and (g.grouped().n_q <= GROUPED_CAUSAL_MAX_GROUP_Q_TILES if g.causal
                       else g.n_q <= GROUPED_FULL_MAX_Q_TILES
                       and (not keys_within or wave_fill(g.batch * g.heads_kv * g.n_kv, num_sms)
                            >= GROUPED_FULL_MIN_WAVE_FILL)):
        return "grouped_sections" if g.causal else "grouped_split"
    if (not g.causal and whole_groups and g.heads > g.heads_kv and g.kernel_chains and headdim != 96
            and (g.block_m, g.block_n) == (64, 128) and g.n_q <= GROUPS_FULL_MAX_Q_TILES):
        return "groups"
    square = g.block_m == g.block_n == 128  # head dim 64
    if g.causal:
        waves = g.num_heads_total * g.n_kv / num_sms
        few_waves = (keys_within and g.block_n >= 128 and headdim != 96 and g.n_kv >= FEW_WAVES_MIN_KV_TILES
                     and waves <= SYMMETRIC_MAX_WAVES)
        if few_waves and waves < SECTIONS_MAX_WAVES and g.n_kv <= SECTIONS_MAX_KV_TILES:
            return "sections"
        sym = keys_within and g.block_n >= 128 and headdim != 96 and g.n_kv >= 32 and not square
        return "symmetric_shift" if sym or few_waves else "spt"
    lo, hi = SECTIONS_FULL_SQUARE_KV_TILES
    if square and keys_within and lo <= g.n_kv <= hi:
        return "sections"
    # KV tiles where shift wins: square tiles 4..127; 64 x 96 (head dim 192) 5..171; 64 x 128 and 64 x 64 5..128
    shift_kv = (4, 127) if square else (5, 171) if g.block_n == 96 else (5, 128)
    if keys_within and g.n_kv < shift_kv[0]:
        return "split"
    return "shift" if keys_within and g.n_kv <= shift_kv[1] else "fa3"


def dq_adds_per_q_tile(g: Geometry) -> float:
    """How many KV tiles' partial dQ a Q tile of ``g`` takes on average (its steps per Q tile)."""
    return g.num_steps / max(1, g.num_heads_total * g.n_q)


def nd_runs_ordered(g: Geometry, headdim: int | None = None, num_sms: int = 132, *, policy: str | None = None) -> bool:
    """Whether a non-deterministic ``auto`` runs the deterministic backward instead.

    In turns, a dQ tile's first add stores, so the fp32 dQ accumulator is not zeroed before the
    kernel; in any order every add adds, into an accumulator zeroed first (a write of all of
    it). Where a Q tile takes few adds, that write costs more than the turns: on the H100
    (818979a's 88 shapes with both calls; docs/journal/rect-bwd.md, "Non-deterministic auto")
    the deterministic ``auto`` ran 1.02-1.75x faster than the non-deterministic one at up to 4.5
    adds per Q tile on 16 of 17 shapes; the one loss, 0.96, orders the GQA dK/dV adds too,
    hence the lower bound there (ND_ORDERED_DKV_TURNS_MAX_ADDS). From 6.5 adds on the two are
    level or the non-deterministic one leads. Full and causal masks only, which the table's
    rule covers."""
    if g.local:
        return False
    adds = dq_adds_per_q_tile(g)
    if adds > ND_ORDERED_MAX_ADDS:
        return False
    pick = _deterministic_pick(g, headdim, num_sms, policy)
    dkv_turns = g.heads != g.heads_kv and pick not in WHOLE_GROUP_SCHEDULES
    return adds <= (ND_ORDERED_DKV_TURNS_MAX_ADDS if dkv_turns else ND_ORDERED_MAX_ADDS)


def nd_pick(g: Geometry, num_sms: int = 132) -> str:
    """The non-deterministic ``auto``: ``groups`` under GQA where its chains fit the CTAs about as
    evenly as ``lpt``'s tasks, else ``lpt``.

    ``groups`` runs a group's query heads at a KV tile back to back on one CTA and stores their
    dK/dV once (no fp32 partials); ``lpt`` claims (query head, KV tile) tasks one by one, the
    best-balanced order, and carries each task's fp32 dK/dV out. Measured on the H200 and H100
    (docs/journal/rect-bwd.md, run 11), ``groups`` was 0.56-0.94 of ``lpt``'s time on every
    rectangular GQA shape and on square ones whose chains balanced, and up to 1.2x slower where its
    plan's busiest CTA held 1.23x the steps of ``lpt``'s (long causal chains, few per CTA). Both
    plans come from the claim model (:func:`.schedules.claim_loads`), so the rule is their
    ratio: ``groups`` up to ``GROUPS_MAX_LOAD_RATIO``. Never for head dim 192, whose kernel has no
    chains (:attr:`.Geometry.kernel_chains`)."""
    from . import groups
    from .schedules import claim_loads, task_claim_cost
    import numpy as np

    if not (g.kernel_chains and groups.chainable(g)):
        return "lpt"
    num_ctas = max(1, min(num_sms, g.num_heads_total * g.n_kv))
    _, ckv, _ = groups.chain_queue(g, num_sms)
    chains = claim_loads(g.group * task_claim_cost(g.task_len[ckv]), num_ctas).max()
    hidx = np.repeat(np.arange(g.num_heads_total, dtype=np.int64), g.n_kv)
    kv = np.tile(np.arange(g.n_kv, dtype=np.int64), g.num_heads_total)
    order, _ = schedules.lpt_order(g, hidx, kv, num_sms)
    tasks = claim_loads(task_claim_cost(g.task_len[kv[order]]), num_ctas).max()
    return "groups" if chains <= GROUPS_MAX_LOAD_RATIO * tasks else "lpt"



def resolve_schedule_name(name: str, geometry: Geometry, deterministic: bool = True, *,
                          num_sms: int | None = None, headdim: int | None = None,
                          policy: str | None = None, dkv_fp32: bool = False) -> str:
    """Map ``auto`` to a concrete schedule; check the name.

    Non-deterministic, the accumulation order is free and ``auto`` is :func:`nd_pick`:
    ``groups`` under GQA where its chains balance, else ``lpt``, the best-balanced task
    order; except where :func:`nd_runs_ordered`, where it is the deterministic ``auto``
    (:func:`resolve_call` says which mode the kernel then runs). Deterministic with a local
    (window) mask, it is ``spt``: the calibration and the table cover full and causal masks only,
    and a band's KV tiles reach a Q tile in descending order when they start
    together (a later KV tile's Q range starts no earlier), which is ``spt``'s
    dQ order. Otherwise ``policy`` (default :func:`get_auto_policy`) decides:
    ``model`` picks the calibrated model's fastest deterministic schedule for
    ``num_sms`` SMs (default 132) and ``headdim`` (default: from the tile
    sizes); ``table`` is :func:`table_pick`. ``dkv_fp32``: the call keeps dK/dV as fp32
    partials (``ops.bwd_dkv_fp32``), which a GQA schedule of whole-group rows
    (:data:`WHOLE_GROUP_SCHEDULES`) does not write: ``auto`` picks none, and naming one raises.
    """
    if name == "auto":
        g = geometry
        if not deterministic and not nd_runs_ordered(g, headdim, num_sms or 132, policy=policy):
            return nd_pick(g, num_sms or 132)
        return _deterministic_pick(g, headdim, num_sms or 132, policy, dkv_fp32=dkv_fp32)
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {SCHEDULE_NAMES}")
    if dkv_fp32 and name in WHOLE_GROUP_SCHEDULES and geometry.heads != geometry.heads_kv:
        raise ValueError(f"schedule {name!r} stores each GQA group's dK/dV in 16 bits: it has no fp32 dK/dV "
                         f"partials to give")
    return name


def _deterministic_pick(g: Geometry, headdim: int | None, num_sms: int, policy: str | None, *,
                        dkv_fp32: bool = False) -> str:
    """The deterministic ``auto`` under ``policy`` (default: the one set)."""
    policy = policy or _auto_policy
    if policy not in AUTO_POLICIES:
        raise ValueError(f"auto policy must be one of {AUTO_POLICIES}, got {policy!r}")
    if g.local:
        return "spt"
    if policy == "model":
        from .model.calibration import best_schedule  # the model loads only for this policy
        return best_schedule(g, num_sms, headdim, whole_groups=not dkv_fp32)
    return table_pick(g, headdim, num_sms, whole_groups=not dkv_fp32)


def resolve_call(name: str, geometry: Geometry, deterministic: bool = True, *, num_sms: int | None = None,
                 headdim: int | None = None, policy: str | None = None, dkv_fp32: bool = False) -> tuple[str, bool]:
    """(schedule, ordered) of a backward call: :func:`resolve_schedule_name`'s schedule, and
    whether the kernel takes the dQ adds in the schedule's turns (its deterministic mode): when
    asked to, and for a non-deterministic ``auto`` where :func:`nd_runs_ordered`."""
    schedule = resolve_schedule_name(name, geometry, deterministic, num_sms=num_sms, headdim=headdim, policy=policy,
                                     dkv_fp32=dkv_fp32)
    ordered = deterministic or (name == "auto" and nd_runs_ordered(geometry, headdim, num_sms or 132, policy=policy))
    return schedule, ordered


# ---------------------------------------------------------------- entry points that accept ``auto``
def build_schedule(name: str, geometry: Geometry, num_sms: int, *, validate: bool = True) -> Schedule:
    """:func:`.schedules.build_schedule`, ``auto`` resolved first."""
    if not isinstance(geometry, Geometry):
        raise TypeError(f"geometry must be a Geometry, got {type(geometry).__name__}")
    num_sms = _check_num_sms(num_sms)
    return schedules.build_schedule(resolve_schedule_name(name, geometry, num_sms=num_sms), geometry, num_sms,
                                    validate=validate)


def build_metadata(name: str, geometry: Geometry, num_sms: int) -> ScheduleMeta:
    """:func:`.schedules.build_metadata`, ``auto`` resolved first."""
    if not isinstance(geometry, Geometry):
        raise TypeError(f"geometry must be a Geometry, got {type(geometry).__name__}")
    num_sms = _check_num_sms(num_sms)
    return schedules.build_metadata(resolve_schedule_name(name, geometry, num_sms=num_sms), geometry, num_sms)


def get_schedule(name: str, geometry: Geometry, num_sms: int) -> Schedule:
    """:func:`.schedules.get_schedule` (validated, cached), ``auto`` resolved first."""
    num_sms = _check_num_sms(num_sms)
    return schedules.get_schedule(resolve_schedule_name(name, geometry, num_sms=num_sms), geometry, num_sms)


def get_metadata(name: str, geometry: Geometry, num_sms: int) -> ScheduleMeta:
    """:func:`.schedules.get_metadata` (the kernel's input, cached), ``auto`` resolved first."""
    num_sms = _check_num_sms(num_sms)
    return schedules.get_metadata(resolve_schedule_name(name, geometry, num_sms=num_sms), geometry, num_sms)


def get_kernel_metadata(name: str, geometry: Geometry, num_sms: int, dispatch: str | None = None) -> ScheduleMeta:
    """:func:`.lowering.get_kernel_metadata` (what the backward kernel runs), ``auto`` resolved first."""
    num_sms = _check_num_sms(num_sms)
    return lowering.get_kernel_metadata(resolve_schedule_name(name, geometry, num_sms=num_sms), geometry, num_sms,
                                        dispatch)
