"""Package layout of dash_fa3.schedule: contract.py stands alone (the build loads it by path), and
every public name stays importable from the package and its old paths."""

import ast
import importlib
import os

import pytest

import dash_fa3.schedule as pkg

PKG_DIR = os.path.dirname(pkg.__file__)
# The contract's independence from the model and the absence of import cycles (function-local
# imports included) are tests/test_imports.py's.


def test_contract_module_is_standalone():
    """The build loads contract.py by path, before numpy or torch may be importable."""
    imports = {n.names[0].name.split(".")[0] if isinstance(n, ast.Import) else n.module
               for n in ast.parse(open(os.path.join(PKG_DIR, "contract.py")).read()).body
               if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert imports <= {"__future__"}, imports


@pytest.mark.parametrize("name", pkg.__all__ + ["cli"])
def test_public_names(name):
    assert getattr(pkg, name) is not None


def test_old_import_paths():
    from dash_fa3.schedule import (Geometry, bwd_block_sizes, get_schedule, resolve_schedule_name,  # noqa: F401
                                   cli)
    from dash_fa3.schedule.lowering import get_kernel_metadata  # noqa: F401
    assert callable(cli.main)
    for mod in ("geometry", "metadata", "schedules", "lowering", "validate", "policy", "model.dag", "model.simulate",
                "model.cli", "model.plot", "model.paper"):
        importlib.import_module(f"dash_fa3.schedule.{mod}")
