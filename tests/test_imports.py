"""The package's module graph: no import cycle (function-local imports counted) and no module
over MAX_LINES lines. Pure ``ast``: nothing is imported, so it runs anywhere."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dash_fa3"
MAX_LINES = 700


def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def imported(node, module: str, is_pkg: bool, known) -> set[str]:
    """The package modules one import statement loads. ``from P import name`` depends on the
    submodule ``P.name`` when there is one, else on ``P`` (the name comes from its __init__);
    the parent packages Python runs on the way are not counted (a submodule importing from its
    parent's siblings while the parent re-exports it is the ordinary package pattern)."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")
            if not is_pkg:
                base = base[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
    out = set()
    for t in targets:
        while t and t not in known and "." in t:
            t = t.rsplit(".", 1)[0]
        if t in known and t != module:
            out.add(t)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every import statement of every module, at any depth (function bodies included)."""
    mods = modules(root)
    graph = {}
    for name, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= imported(node, name, is_pkg, mods)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (iterative depth-first search)."""
    state = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_sees_function_local_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import os\nfrom ..a import f\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    (pkg / "sub" / "b.py").write_text("from .. import a as _a\n")   # a module, through its package
    assert find_cycle(import_graph(pkg)) is not None
    (pkg / "sub" / "b.py").write_text("X = 1\n")
    assert find_cycle(import_graph(pkg)) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_schedule_contract_does_not_import_the_model():
    graph = import_graph()
    contract = ["contract", "geometry", "metadata", "schedules", "validate", "waitgraph", "lowering", "varlen",
                "export"]
    for name in contract:
        model = sorted(m for m in graph[f"dash_fa3.schedule.{name}"] if m.startswith("dash_fa3.schedule.model")
                       or m == "dash_fa3.schedule.policy")
        assert not model, f"dash_fa3.schedule.{name} imports {model}"


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_size(name):
    path = modules()[name][0]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES})"
