"""Random shapes through every schedule's validation and the simulator (issue 15:
no deadlock on 10 000 random shapes). CPU only:

    python tools/sim_fuzz.py [--shapes 10000] [--seed 0]

Each shape (the random geometries of tests/test_schedule_validation.py: tile
sizes 16-128, lengths up to 1200, GQA, causal or full, 132/114 SMs or a small SM
count) builds every schedule, which validates it (the wait-for graph is
checked acyclic), and simulates it with the writer pipeline and a hand-off
latency; any exception, or a makespan below the lower bound, is a failure.
Exits 1 on a failure. The tests run 1000 such shapes; this runs more.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from dash_fa3.schedule import SCHEDULES, CostModel, build_schedule, simulate  # noqa: E402
from test_schedule_validation import SMS, random_geometry  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    costs = CostModel(1.0, 0.7, latency=0.3, read=0.3, epilogue=0.2)
    start, runs, failures = time.time(), 0, []
    for i in range(args.shapes):
        g = random_geometry(rng, max_steps=3000)
        sms = int(rng.choice(SMS)) if rng.random() < 0.5 else int(rng.integers(1, 40))
        for name in SCHEDULES:
            try:
                sim = simulate(build_schedule(name, g, sms), costs)
                if not (np.isfinite(sim.makespan) and sim.makespan >= sim.lower_bound - 1e-9):
                    raise AssertionError(f"makespan {sim.makespan} below the lower bound {sim.lower_bound}")
                runs += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported
                failures.append(f"shape {i} ({g.describe()}, {sms} SMs) {name}: {e!r}"[:400])
    print(f"seed {args.seed}: {args.shapes} shapes, {runs} schedules validated and simulated, "
          f"{len(failures)} failures, {time.time() - start:.0f} s")
    for f in failures[:10]:
        print(f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
