"""The documents hold together: a short README, short README table cells, relative links
that resolve (file and heading), and generated results that match their data and the
journal they came from."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 220
CELL_MAX_CHARS = 200

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def markdown_files() -> list[Path]:
    files = [README, ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
             ROOT / "benchmarks" / "RESULTS.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def _render():
    spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "results" / "render.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def table_cells(text: str) -> list[list[str]]:
    """Rows of every markdown table outside code fences, as lists of stripped cells."""
    rows = []
    for line in FENCE.sub("", text).splitlines():
        s = line.strip()
        if s.startswith("|") and s.endswith("|") and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", s):
            rows.append([c.strip() for c in s[1:-1].split("|")])
    return rows


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (markup and punctuation dropped, spaces to hyphens)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        base = slug(m.group(1).strip())
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    links = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto: ...
            links.append(target)
    return links


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"


def test_readme_table_cells_are_short():
    long = [(row[0][:40], len(c)) for row in table_cells(README.read_text()) for c in row if len(c) > CELL_MAX_CHARS]
    assert not long, f"README table cells over {CELL_MAX_CHARS} characters: {long}"


def test_readme_keeps_the_ci_test_command():
    # .ci/run runs this exact command as "the README's test command".
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M)
    assert any(line.split("#")[0].strip() == "python -m pytest tests -q -rs"
               for block in blocks for line in block.splitlines())


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def test_generated_results_are_current():
    render = _render()
    assert render.main(["--check"]) == 0, "run python benchmarks/results/render.py"


def test_results_data_match_the_journal():
    """Every row kept as data appears, cell for cell, in the journal whose section printed it."""
    render = _render()
    journal_cache: dict[str, list[list[str]]] = {}
    tables = [t for t in render.load_all() if t["journal"].get("holds_table")]
    assert tables
    for table in tables:
        jfile = table["journal"]["file"]
        if jfile not in journal_cache:
            journal_cache[jfile] = table_cells((ROOT / jfile).read_text())
        journal_rows = journal_cache[jfile]
        header = [c["name"] for c in table["columns"]]
        assert header in journal_rows, f"{table['id']}: header not in {jfile}"
        for row in table["rows"]:
            cells = [render.fmt(c, v) for c, v in zip(table["columns"], row)]
            assert cells in journal_rows, f"{table['id']}: row {cells[:3]} not in {jfile}"
        section = table["journal"]["section"]
        assert f"## {section}" in (ROOT / jfile).read_text(), f"{table['id']}: no section {section!r}"


def test_render_rejects_a_malformed_table(tmp_path):
    render = _render()
    good = json.loads(next((ROOT / "benchmarks" / "results").glob("*.json")).read_text())
    bad = dict(good, rows=[good["rows"][0][:-1]])
    path = tmp_path / f"{good['id']}.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(render.DataError, match="cells"):
        render.load(path)
    path.write_text(json.dumps(dict(good, commit="latest")))
    with pytest.raises(render.DataError, match="commit"):
        render.load(path)


def test_summary_rows_are_computed_from_the_cells():
    render = _render()
    table = {"columns": [{"name": "x"}, {"name": "r", "decimals": 2}], "rows": [["a", 1.0], ["b", 0.5], ["c", 2.0]],
             "summary_columns": ["r"]}
    lines = render.table_lines(table)
    assert lines[-3:] == ["| min | 0.50 |", "| median | 1.00 |", "| max | 2.00 |"]


DESIGN_PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
                *sorted((ROOT / "docs" / "design").glob("*.md"))]
REPO_PATH = re.compile(r"`((?:docs|benchmarks|tools|dash_fa3|csrc|tests|examples|third_party)/[^`\s*{}<>]*)`")


@pytest.mark.parametrize("path", DESIGN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_named_by_the_design_pages_exist(path):
    """A page that says what is names files that are there (build outputs aside); the
    journal is history and may name files that have since moved."""
    missing = []
    for m in REPO_PATH.finditer(path.read_text()):
        rel = m.group(1).split("::")[0].rstrip("/")
        if rel.endswith(".so"):
            continue
        if not (ROOT / rel).exists():
            missing.append(rel)
    assert not missing, f"{path.relative_to(ROOT)} names missing files: {missing}"


DOTTED = re.compile(r"`(dash_fa3(?:\.\w+)+)")


@pytest.mark.parametrize("path", DESIGN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dotted_names_named_by_the_design_pages_exist(path):
    """`dash_fa3.x.y` on a design page is an importable module or one of its attributes
    (modules that need an absent framework are skipped)."""
    import importlib

    missing = []
    for name in sorted(set(DOTTED.findall(path.read_text()))):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError as e:
                if not (e.name or "").startswith("dash_fa3"):
                    obj = None
                    break
                continue
            rest = parts[i:]
            break
        if obj is None:
            continue
        for attr in rest:
            if not hasattr(obj, attr):
                missing.append(name)
                break
            obj = getattr(obj, attr)
    assert not missing, f"{path.relative_to(ROOT)} names missing objects: {missing}"
