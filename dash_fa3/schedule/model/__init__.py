"""The research model of the schedules (DASH, arXiv 2601.21824): the DAG and
its critical path, the event simulator, the paper's closed forms, Gantt
charts and the command line.  It reads schedules; the kernel never depends on
it.  The kernel contract (geometry, schedules, metadata, lowering,
validation) is the parent package; ``dash_fa3.schedule`` re-exports both.
"""

from .dag import CriticalPath, critical_path, longest_path
from .paper import paper_makespan
from .simulate import CostModel, SimResult, simulate, simulate_claims, unit_model

__all__ = ["CostModel", "SimResult", "simulate", "simulate_claims", "unit_model", "CriticalPath", "critical_path", "longest_path",
           "paper_makespan"]
