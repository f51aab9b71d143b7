"""tests/README.md's capability map points at tests that exist and that `make test` runs.

Each row of the capability table names tests as `` `node id or file` (unit) `` / `` (heavy) ``. The named test
files are collected in process (``pytest.main --collect-only`` with a plugin that records each item's markers;
``addopts`` cleared so nothing is deselected), and every named test must match at least one collected item that
the stage written beside it selects. The stages' marker expressions are read where `make test` takes them from:
the unit stage is plain ``pytest``, whose ``-m`` is in pyproject.toml's ``addopts``; the heavy stage is the
Makefile's ``HEAVY``; ``make test-extended`` is the Makefile's ``test-extended`` target. The "Extended tests"
table must list every test marked ``extended`` (files that mention ``extended`` are collected for that), each
with a `make test` test of the same claim.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "tests" / "README.md"
# `tests/...` in backticks, optionally followed by its stage in parentheses: "(unit)", "(heavy: why)"
REF = re.compile(r"`(tests/[^`]+)`(?:\s*\((unit|heavy)\b[^)]*\))?")


@dataclass
class Row:
    table: str  # "capability" or "extended"
    label: str  # what a failure names: "row 12 (...)"
    cells: list[str]


@dataclass
class Collected:
    markers: dict[str, set[str]] = field(default_factory=dict)  # node id -> marker names
    errors: list[str] = field(default_factory=list)


def stage_expressions() -> dict[str, str]:
    """The marker expression of each stage, from the files `make test` / `make test-extended` read."""
    addopts = shlex.split(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
                          ["addopts"])
    makefile = (ROOT / "Makefile").read_text()
    heavy = re.search(r"^HEAVY\s*:?=\s*(.+?)\s*$", makefile, re.M).group(1)
    test_recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    extended = re.search(r"^test-extended:.*\n(?:\t.*\n)*?\t.*-m\s+(\"[^\"]+\"|'[^']+'|\S+)", makefile, re.M).group(1)
    # `make test` = plain pytest (addopts' -m) then -m "$(HEAVY)"; if the Makefile changes that, so must this test
    first, second = (line.split(" pytest", 1)[1] for line in test_recipe.splitlines()[:2])
    assert " -m " not in first and '-m "$(HEAVY)"' in second, test_recipe
    return {"unit": addopts[addopts.index("-m") + 1], "heavy": heavy, "extended": extended.strip("\"'")}


def stage_markers(stages: dict[str, str]) -> set[str]:
    """The marker names the stages' expressions test (what a failure shows of a test's markers)."""
    return {w for e in stages.values() for w in re.findall(r"[A-Za-z_]\w*", e)} - {"and", "or", "not"}


def selects(expression: str, markers: set[str]) -> bool:
    return Expression.compile(expression).evaluate(lambda name, **_: name in markers)


def read_tables() -> list[Row]:
    rows, table = [], None
    for line in README.read_text().splitlines():
        if not line.startswith("|"):
            table = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if table is None:  # a header row
            header = cells[0].lower() + " " + cells[1].lower()
            table = "capability" if "capability" in header else "extended" if "extended" in header else "other"
            continue
        if set("".join(cells)) <= set("-: ") or table == "other":
            continue
        if table == "capability":
            rows.append(Row(table, f"row {cells[0]} ({cells[1][:70]})", cells[1:]))
        else:
            rows.append(Row(table, f"extended row ({cells[0][:90]})", cells))
    return rows


def named_files(rows: list[Row]) -> set[str]:
    files = {ref.split("::")[0] for row in rows for cell in row.cells for ref, _ in REF.findall(cell)}
    # where extended tests may be: files that mention the marker (by decorator, pytestmark or a helper)
    files |= {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if "extended" in p.read_text() and p != Path(__file__).resolve()}
    return {f for f in files if f.endswith(".py") and (ROOT / f).is_file()}


def collect(files: set[str]) -> Collected:
    found = Collected()

    class Recorder:
        def pytest_collectreport(self, report):
            if report.failed:
                found.errors.append(f"{report.nodeid}: {str(report.longrepr)[-1500:]}")

        def pytest_collection_modifyitems(self, items):
            found.markers.update({item.nodeid: {m.name for m in item.iter_markers()} for item in items})

    args = [*(str(ROOT / f) for f in sorted(files)), "--collect-only", "-qq", "-o", "addopts=",
            "-p", "no:cacheprovider",
            "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml")]
    pytest.main(args, plugins=[Recorder()])
    return found


def matching(ref: str, markers: dict[str, set[str]]) -> list[str]:
    """Collected node ids ``ref`` names: itself, its parametrized cases, or everything under a file / class."""
    return [n for n in markers if n == ref or n.startswith(ref + "[") or n.startswith(ref + "::")]


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    found = read_tables()
    assert any(r.table == "capability" for r in found), f"no capability table in {README}"
    return found


@pytest.fixture(scope="module")
def collected(rows) -> Collected:
    found = collect(named_files(rows))
    assert not found.errors, "collection errors:\n" + "\n".join(found.errors)
    return found


def check_make_test_refs(row: Row, cell: str, collected: Collected, stages: dict[str, str]) -> list[str]:
    problems = []
    refs = REF.findall(cell)
    if not refs:
        problems.append(f"{row.label}: names no test")
    for ref, stage in refs:
        if not stage:
            problems.append(f"{row.label}: `{ref}` has no stage; write (unit) or (heavy) after it")
            continue
        items = matching(ref, collected.markers)
        if not items:
            problems.append(f"{row.label}: `{ref}` matches no collected test (missing, renamed or skipped at import)")
        elif not any(selects(stages[stage], collected.markers[item]) for item in items):
            runs = sorted({s for item in items for s in ("unit", "heavy", "extended")
                           if selects(stages[s], collected.markers[item])})
            marks = set().union(*(collected.markers[i] for i in items)) & stage_markers(stages)
            problems.append(f"{row.label}: `{ref}` is not run by make test's {stage} stage "
                            f"(markers {sorted(marks)}; run by: {', '.join(runs) or 'no stage'}"
                            f"{'; only make test-extended runs it' if runs == ['extended'] else ''})")
    return problems


def test_every_capability_row_names_tests_that_make_test_runs(rows, collected):
    stages = stage_expressions()
    problems = [p for row in rows if row.table == "capability"
                for p in check_make_test_refs(row, row.cells[-1], collected, stages)]
    assert not problems, "tests/README.md capability map:\n" + "\n".join(problems)


def test_the_extended_section_lists_every_extended_test_with_its_make_test_counterpart(rows, collected):
    stages = stage_expressions()
    problems, listed = [], set()
    for row in (r for r in rows if r.table == "extended"):
        named = REF.findall(row.cells[0])
        for ref, _ in named:
            items = matching(ref, collected.markers)
            listed.update(items)
            if not items:
                problems.append(f"{row.label}: `{ref}` matches no collected test")
            elif not all(selects(stages["extended"], collected.markers[item]) for item in items):
                problems.append(f"{row.label}: `{ref}` is not (only) extended tests")
        problems += check_make_test_refs(row, row.cells[-1], collected, stages) if named else [f"{row.label}: no test"]
    unlisted = sorted(n for n, m in collected.markers.items() if selects(stages["extended"], m) and n not in listed)
    problems += [f"`{n}` is marked extended but not in the Extended tests table" for n in unlisted]
    assert not problems, "tests/README.md Extended tests:\n" + "\n".join(problems)
