"""The DASH schedules of the deterministic backward (pure Python + numpy;
matplotlib only for plots).  See docs/design/schedule.md.

Two layers:

* the kernel contract (this package): :mod:`.contract` (metadata layout and
  tile sizes, generated into the kernels' C++ header), :mod:`.geometry`,
  :mod:`.schedules`, :mod:`.metadata`, :mod:`.lowering`, :mod:`.validate`
  with its wait-for graph (:mod:`.waitgraph`), :mod:`.export`;
* the research model (:mod:`.model`): DAG and critical path, simulator, the
  paper's closed forms, Gantt charts, the CLI.  It depends on the contract,
  never the reverse;
* above both, :mod:`.policy`: what ``auto`` resolves to (a table of measured
  picks, or the calibrated model's), and the entry points that accept ``auto``.

Public API (all importable from here):

* :class:`Geometry`, :func:`bwd_block_sizes` -- tile geometry of one backward call;
* :func:`get_schedule` / :func:`get_metadata` (cached), :func:`build_schedule`, :class:`Schedule`,
  ``SCHEDULES`` / ``SCHEDULE_NAMES``, :func:`schedules_for` (those defined for a call),
  :func:`resolve_schedule_name`, :func:`resolve_call` (with the mode the kernel runs), :func:`set_auto_policy`,
  :func:`get_auto_policy`;
* :func:`validate`, :class:`ScheduleError`, :class:`ValidationReport`;
* :class:`ScheduleMeta`, :func:`decode_step`, :func:`decode_all` -- the kernel's input;
* :func:`simulate`, :class:`CostModel`, :class:`SimResult`, :func:`unit_model`;
* :func:`critical_path`, :func:`longest_path`;
* :func:`paper_makespan` -- the paper's closed forms;
* :func:`plot_gantt`; :func:`main` -- the CLI (``python -m dash_fa3.schedule``).
"""

from .contract import BWD_BLOCK_SIZES
from .geometry import MASKS, Geometry, bwd_block_sizes
from .metadata import ScheduleMeta, decode_all, decode_step
from .schedules import SCHEDULE_NAMES, SCHEDULES, Schedule, clear_cache, schedules_for
from . import groups as _groups  # noqa: F401  (registers the groups schedule)
from . import grouped as _grouped  # noqa: F401  (registers the grouped_* schedules)
from . import runs as _runs  # noqa: F401  (registers the runs schedule)
from . import split as _split  # noqa: F401  (registers the split schedule)
from .validate import ScheduleError, ValidationReport, validate
from .model import (CostModel, CriticalPath, SimResult, critical_path, longest_path, paper_makespan,
                    simulate, unit_model)
from .policy import (build_metadata, build_schedule, get_auto_policy, get_metadata, get_schedule,
                     resolve_call, resolve_schedule_name, set_auto_policy)


def plot_gantt(*args, **kwargs):
    """See :func:`dash_fa3.schedule.model.plot.plot_gantt` (imports matplotlib lazily)."""
    from .model.plot import plot_gantt as _plot
    return _plot(*args, **kwargs)


def main(argv=None):
    from .model.cli import main as _main
    return _main(argv)


def __getattr__(name):
    # ``from dash_fa3.schedule import cli`` (the CLI moved to .model.cli), loaded lazily.
    if name == "cli":
        from .model import cli
        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BWD_BLOCK_SIZES", "MASKS", "Geometry", "bwd_block_sizes",
    "ScheduleMeta", "decode_all", "decode_step",
    "SCHEDULE_NAMES", "SCHEDULES", "Schedule", "schedules_for", "build_schedule", "build_metadata", "clear_cache",
    "get_metadata",
    "get_schedule", "resolve_call", "resolve_schedule_name", "set_auto_policy", "get_auto_policy",
    "ScheduleError", "ValidationReport", "validate",
    "CostModel", "SimResult", "simulate", "unit_model",
    "CriticalPath", "critical_path", "longest_path",
    "paper_makespan", "plot_gantt", "main",
]
