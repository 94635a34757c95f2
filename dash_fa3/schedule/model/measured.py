"""Measured backward calls of any shape: what the calibration is fitted to and judged by.

A :class:`MeasuredCall` is one timed backward call (shape, schedule, deterministic or not, GPU ms)
and a :class:`CallSet` the calls of one run of the benchmarks on one GPU at one commit. The shipped
set, :data:`H100_818979A` (``data/h100_calls_818979a.json``), holds the run of
docs/journal/rect-bwd.md run 16: ``bench_rect.py --set all`` (source ``rect``), ``bench_auto.py
--set all`` (sources ``first``, ``held_out``, ``probe``, ``probe2``) and the square grid of
``bench_peers.py --direction bwd`` (``grid``). :func:`calls_from_bench` turns those scripts' JSON
outputs into a set, so a new run becomes a new data file.

``schedule`` is the name the benchmark asked for; ``auto`` in a non-deterministic call is what the
op runs without a schedule (:func:`..policy.nd_pick`), which :meth:`MeasuredCall.resolved` names.
Where the non-deterministic ``auto`` runs the deterministic mode (:func:`..policy.nd_runs_ordered`,
from 293253d on) it is the deterministic call of its schedule, measured beside it, and
:func:`calls_from_bench` leaves it out; 818979a's calls predate that rule.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..geometry import Geometry

_LABEL = re.compile(r"b(\d+) (\d+)x(\d+) h(\d+)/(\d+) d(\d+) (full|causal)")


@dataclass(frozen=True)
class MeasuredCall:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    headdim: int
    causal: bool
    schedule: str
    deterministic: bool
    ms: float
    source: str

    def geometry(self) -> Geometry:
        return Geometry.from_shape(batch=self.batch, heads=self.heads, heads_kv=self.heads_kv, seqlen_q=self.seqlen_q,
                                   seqlen_k=self.seqlen_k, headdim=self.headdim, causal=self.causal)

    def shape(self) -> tuple:
        return (self.batch, self.seqlen_q, self.seqlen_k, self.heads, self.heads_kv, self.headdim, self.causal)

    def resolved(self, num_sms: int) -> str:
        """The schedule the call ran: ``schedule``, or the non-deterministic ``auto``'s pick."""
        if self.schedule != "auto":
            return self.schedule
        if self.deterministic:
            raise ValueError("a deterministic `auto` call names no schedule; record the one it resolved to")
        from ..policy import nd_pick
        return nd_pick(self.geometry(), num_sms)


@dataclass(frozen=True)
class CallSet:
    """The measured calls of one benchmark run."""

    device: str
    date: str
    commit: str
    num_sms: int
    source: str      # where the run is written down
    calls: tuple

    def sources(self) -> list[str]:
        return sorted({c.source for c in self.calls})

    def to_dict(self) -> dict:
        fields = list(MeasuredCall.__dataclass_fields__)
        return dict(device=self.device, date=self.date, commit=self.commit, num_sms=self.num_sms, source=self.source,
                    fields=fields, calls=[[getattr(c, f) for f in fields] for c in self.calls])


def call_set_from_dict(d: dict) -> CallSet:
    fields = tuple(MeasuredCall.__dataclass_fields__)
    if tuple(d["fields"]) != fields:
        raise ValueError(f"measured calls have fields {d['fields']}, expected {list(fields)}")
    calls = tuple(MeasuredCall(**dict(zip(fields, row))) for row in d["calls"])
    return CallSet(device=d["device"], date=d["date"], commit=d["commit"], num_sms=int(d["num_sms"]),
                   source=d["source"], calls=calls)


def parse_label(label: str) -> tuple:
    """``bench_auto.py``'s shape label ("b2 3072x3072 h24/8 d128 causal") as (batch, seqlen_q, seqlen_k,
    heads, heads_kv, headdim, causal)."""
    m = _LABEL.fullmatch(label.strip())
    if not m:
        raise ValueError(f"not a bench_auto shape label: {label!r}")
    *nums, mask = m.groups()
    return (*map(int, nums), mask == "causal")


def _flops(shape) -> float:
    """The benchmarks' count of a backward (dash_fa3._timing.attention_flops): 2.5 x 4 b h sq sk d,
    halved when causal."""
    b, sq, sk, h, _, d, causal = shape
    return 10.0 * b * h * sq * sk * d / (2 if causal else 1)


def calls_from_bench(*, rect: dict | None = None, auto: dict | None = None, peers: dict | None = None) -> list:
    """The calls in the ``--json`` outputs of ``bench_rect.py`` (ms per call), ``bench_auto.py``
    (TFLOP/s per schedule, each set its own source; with ``--nd`` the non-deterministic call of
    every schedule too) and ``bench_peers.py --direction bwd`` (the median of each
    implementation's rounds); ours only. ``auto`` of a deterministic call is left out (it is one of
    the schedules timed beside it), and so is a non-deterministic ``auto`` that runs the
    deterministic mode under this checkout's rule (the outputs of a run at 293253d or later)."""
    from ..policy import nd_runs_ordered

    out = []

    def add(shape, schedule, deterministic, ms, source):
        call = MeasuredCall(*shape, schedule=schedule, deterministic=deterministic, ms=float(ms), source=source)
        if schedule == "auto" and not deterministic and nd_runs_ordered(call.geometry(), call.headdim):
            return
        out.append(call)

    for r in (rect or {}).get("rows", []):
        b, sq, sk, h, hkv, d, mask = r["shape"]
        shape = (b, sq, sk, h, hkv, d, mask == "causal")
        for name, ms in r["ms"].items():
            if name == "ours nd":
                add(shape, "auto", False, ms, "rect")
            elif name.startswith("ours ") and name != "ours auto":
                add(shape, name[5:], True, ms, "rect")
    for r in (auto or {}).get("rows", []):
        shape = parse_label(r["shape"])
        to_ms = _flops(shape) / 1e9
        add(shape, "auto", False, to_ms / r["nd"], r["set"])
        for name, tf in r["det"].items():
            add(shape, name, True, to_ms / tf, r["set"])
        for name, tf in r.get("nd_sched", {}).items():
            add(shape, name, False, to_ms / tf, r["set"])
    for p in (peers or {}).get("points", []):
        shape = (p["batch"], p["seqlen"], p["seqlen"], p["heads"], p.get("heads_kv", p["heads"]), p["hdim"],
                 p["mask"] == "causal")
        for name, rounds in p["round_ms"].items():
            if name == "ours nd":
                add(shape, "auto", False, statistics.median(rounds), "grid")
            elif name.startswith("ours det "):
                add(shape, name[9:], True, statistics.median(rounds), "grid")
    return out


DATA_PATH = Path(__file__).with_name("data") / "h100_calls_818979a.json"
H100_818979A = call_set_from_dict(json.loads(DATA_PATH.read_text()))
