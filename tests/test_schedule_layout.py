"""Package layout of dash_fa3.schedule: the kernel contract does not depend on
the research model, the model's modules import without a cycle, and every
public name stays importable from the package."""

import ast
import importlib
import os

import pytest

import dash_fa3.schedule as pkg

PKG_DIR = os.path.dirname(pkg.__file__)
CONTRACT = ["contract", "geometry", "metadata", "schedules", "lowering", "validate", "waitgraph", "export"]
MODEL = ["dag", "simulate", "paper", "plot", "cli"]


def module_level_imports(path: str) -> set[str]:
    """Relative modules imported at module level (function-level imports are lazy by design)."""
    tree = ast.parse(open(path).read())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = node.module or ""
            out.update(f"{base}.{a.name}".strip(".") if not base else base for a in node.names)
    return out


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_does_not_import_the_model(name):
    imports = module_level_imports(os.path.join(PKG_DIR, f"{name}.py"))
    assert not any(m == "model" or m.startswith("model.") for m in imports), imports


def test_contract_module_is_standalone():
    """The build loads contract.py by path, before numpy or torch may be importable."""
    imports = {n.names[0].name.split(".")[0] if isinstance(n, ast.Import) else n.module
               for n in ast.parse(open(os.path.join(PKG_DIR, "contract.py")).read()).body
               if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert imports <= {"__future__"}, imports


def test_model_has_no_import_cycle():
    graph = {m: {i.split(".")[0] for i in module_level_imports(os.path.join(PKG_DIR, "model", f"{m}.py"))}
             & set(MODEL) for m in MODEL}
    seen, stack = set(), []

    def visit(m):
        assert m not in stack, f"import cycle: {' -> '.join(stack + [m])}"
        if m in seen:
            return
        stack.append(m)
        for n in graph[m]:
            visit(n)
        stack.pop()
        seen.add(m)

    for m in MODEL:
        visit(m)
    assert "dag" not in graph["simulate"]


@pytest.mark.parametrize("name", pkg.__all__ + ["cli"])
def test_public_names(name):
    assert getattr(pkg, name) is not None


def test_old_import_paths():
    from dash_fa3.schedule import (Geometry, bwd_block_sizes, get_schedule, resolve_schedule_name,  # noqa: F401
                                   cli)
    from dash_fa3.schedule.lowering import get_kernel_metadata  # noqa: F401
    assert callable(cli.main)
    for mod in ("geometry", "metadata", "schedules", "lowering", "validate", "model.dag", "model.simulate",
                "model.cli", "model.plot", "model.paper"):
        importlib.import_module(f"dash_fa3.schedule.{mod}")
