"""The fold algorithm (``algorithm="folds"``, deterministic, CPU only: its fold kernels do not exist
on the GPU): every block's reduction in one fixed order on one rank, bitwise the same for every
number of ranks and any heads_kv (MQA included). docs/design/distributed.md explains why summing per-rank
partials cannot be P-invariant and what the folds cost instead.

* ``plan.py``: the schedule as data (:class:`DistSchedule` of :class:`Work` and :class:`Transfer`
  records) and its builder, with DistFlashAttn's helper-worker balancing at fold granularity;
* ``validate.py``: the checks every schedule passes before it runs, and each rank's program;
* ``model.py``: the alpha-beta cost model (``python -m dash_fa3.distributed plan --algorithm folds``);
* ``runtime.py`` and ``backend.py``: one rank's execution, and the block arithmetic it runs on.
"""

from .backend import BlockBackend, TorchBlockBackend, get_backend
from .model import DEFAULT_COST, PassSim, Shape, simulate, simulate_pass
from .plan import (ASSIGNMENTS, DATA_KINDS, DEFAULT_ASSIGNMENT, DEFAULT_FANOUT, FOLD_KINDS, GEMMS, OWN, PARTNER,
                   PASS_FOLDS, PASS_INPUTS, PASS_RESULTS, PASSES, PRESETS, RESULT, DistSchedule, DistScheduleError,
                   Transfer, Work, build, fold_range)
from .runtime import backward, forward
from .validate import DistReport, Message, StepProgram, get_schedule, rank_program, validate

__all__ = ["BlockBackend", "TorchBlockBackend", "get_backend", "DEFAULT_COST", "PassSim", "Shape", "simulate",
           "simulate_pass", "ASSIGNMENTS", "DATA_KINDS", "DEFAULT_ASSIGNMENT", "DEFAULT_FANOUT", "FOLD_KINDS",
           "GEMMS", "OWN", "PARTNER", "PASS_FOLDS", "PASS_INPUTS", "PASS_RESULTS", "PASSES", "PRESETS", "RESULT",
           "DistSchedule", "DistScheduleError", "Transfer", "Work", "build", "fold_range", "backward", "forward",
           "DistReport", "Message", "StepProgram", "get_schedule", "rank_program", "validate"]
