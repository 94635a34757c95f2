"""The DASH schedule model (pure Python + numpy; matplotlib only for plots).

See docs/schedule.md.  Public API:

* :class:`Geometry`, :func:`bwd_block_sizes` -- tile geometry of one backward call;
* :func:`get_schedule` / :func:`get_metadata` (cached), :func:`build_schedule`, :class:`Schedule`,
  ``SCHEDULES`` / ``SCHEDULE_NAMES``, :func:`resolve_schedule_name`;
* :func:`validate`, :class:`ScheduleError`, :class:`ValidationReport`;
* :func:`simulate`, :class:`CostModel`, :class:`SimResult`;
* :func:`critical_path`, :func:`longest_path`;
* :class:`ScheduleMeta`, :func:`decode_step`, :func:`decode_all` -- the kernel's input;
* :func:`paper_makespan` -- the paper's closed forms;
* :func:`plot_gantt`; :func:`main` -- the CLI (``python -m dash_fa3.schedule``).
"""

from .geometry import BWD_BLOCK_SIZES, MASKS, Geometry, bwd_block_sizes
from .metadata import ScheduleMeta, decode_all, decode_step
from .schedules import (SCHEDULE_NAMES, SCHEDULES, Schedule, build_schedule, clear_cache,
                        get_metadata, get_schedule, resolve_schedule_name)
from .validate import ScheduleError, ValidationReport, validate
from .simulate import CostModel, SimResult, simulate
from .dag import CriticalPath, critical_path, longest_path
from .paper import paper_makespan


def plot_gantt(*args, **kwargs):
    """See :func:`dash_fa3.schedule.plot.plot_gantt` (imports matplotlib lazily)."""
    from .plot import plot_gantt as _plot
    return _plot(*args, **kwargs)


def main(argv=None):
    from .cli import main as _main
    return _main(argv)


__all__ = [
    "BWD_BLOCK_SIZES", "MASKS", "Geometry", "bwd_block_sizes",
    "ScheduleMeta", "decode_all", "decode_step",
    "SCHEDULE_NAMES", "SCHEDULES", "Schedule", "build_schedule", "clear_cache", "get_metadata", "get_schedule",
    "resolve_schedule_name",
    "ScheduleError", "ValidationReport", "validate",
    "CostModel", "SimResult", "simulate",
    "CriticalPath", "critical_path", "longest_path",
    "paper_makespan", "plot_gantt", "main",
]
