"""benchmarks/bench_auto.py on the CPU: the off-grid shapes are off the grid, every schedule
builds on them, and the report picks the best schedule and the policies' distance to it."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_auto  # noqa: E402

from dash_fa3.schedule import SCHEDULES  # noqa: E402
from dash_fa3.schedule.export import DEFAULT_GRID, grid_geometries  # noqa: E402


def test_at_least_twelve_shapes_none_on_the_grid():
    grid = {(g.batch, g.heads, g.heads_kv, g.seqlen_q, g.seqlen_k, g.block_m, g.block_n, g.mask)
            for _, g in grid_geometries(DEFAULT_GRID)}
    assert len(bench_auto.SHAPES) >= 12
    for shape in bench_auto.SHAPES:
        g = bench_auto.geometry_of(shape)
        assert (g.batch, g.heads, g.heads_kv, g.seqlen_q, g.seqlen_k, g.block_m, g.block_n, g.mask) not in grid


def test_dry_run_builds_every_schedule(capsys):
    assert bench_auto.main(["--dry-run", "--shapes", "5,12"]) == 0
    out = capsys.readouterr().out
    assert "b8 640x640 h16/16 d128 causal" in out and "auto: table" in out and "model" in out


def test_report_row_distance_to_best():
    shape = bench_auto.SHAPES[5]
    tf = {"nd": 200.0} | {f"det {n}": 100.0 for n in SCHEDULES}
    tf["det spt"] = 150.0
    row = bench_auto.report_row(shape, tf, 132)
    assert row["best"] == "spt" and row["best_det_vs_nd"] == pytest.approx(0.75)
    picks = bench_auto.picks(shape, 132)
    assert row["table"] == picks["table"]
    assert row["table_vs_best"] == pytest.approx(tf[f"det {picks['table']}"] / 150.0)


def test_bad_shape_index_is_an_error():
    with pytest.raises(SystemExit):
        bench_auto.main(["--dry-run", "--shapes", "99"])


def test_report_row_with_every_non_deterministic_schedule():
    shape = bench_auto.SHAPES[5]
    tf = {"nd": 200.0} | {f"det {n}": 100.0 for n in SCHEDULES} | {f"nd {n}": 150.0 for n in SCHEDULES}
    tf["nd lpt"] = 210.0
    row = bench_auto.report_row(shape, tf, 132)
    assert row["nd_best"] == "lpt" and row["nd_best_tf"] == 210.0
    assert row["nd_vs_best"] == pytest.approx(200 / 210) and row["best_det_vs_nd_best"] == pytest.approx(100 / 210)
    # auto faster than every named call (it may run the deterministic mode): auto is the best.
    tf["nd"] = 220.0
    row = bench_auto.report_row(shape, tf, 132)
    assert row["nd_best"] == "auto" and row["nd_vs_best"] == 1.0
    assert row["nd_pick"] == bench_auto.picks(shape, 132)["nd"]


def test_grid_set_is_the_bench_grid():
    shapes = bench_auto.grid_shapes()
    assert len(shapes) == 24 and (1, 16384, 16384, 16, 16, 128, True) in shapes
    assert bench_auto.sets_of("grid,first") == ["grid", "first"]
    with pytest.raises(ValueError, match="--set takes"):
        bench_auto.sets_of("nope")
