"""Per-file test durations of a whole ``make test`` as a markdown table (``tests/durations.md``).

    python scripts/durations_table.py --unit unit.xml --heavy heavy.xml --wall-unit 175 --wall-heavy 1100 \\
        --note "2026-11-27, AMD EPYC 2 cores (CI's fast class)" > tests/durations.md

The XML files are pytest's ``--junitxml`` of the two stages. Under ``-n 2`` a file's seconds are its tests' own
durations while another file ran beside it, so the column sums to about twice the stage's wall time.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def per_file(junit: Path) -> dict[str, tuple[float, int, int]]:
    """``{test file: (seconds, tests, skipped)}`` from a junit XML (setup and teardown are in a test's time)."""
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "")
        # classname is the dotted module path (plus a class name for tests in a class)
        parts = module.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        name = "/".join(parts) + ".py" if parts else module
        seconds[name] += float(case.get("time", 0.0))
        counts[name][0] += 1
        counts[name][1] += case.find("skipped") is not None
    return {name: (seconds[name], *counts[name]) for name in seconds}


def table(title: str, rows: dict[str, tuple[float, int, int]], wall_s: float) -> list[str]:
    total = sum(s for s, _, _ in rows.values())
    lines = [f"### {title}: {sum(n for _, n, _ in rows.values())} tests, {wall_s / 60:.1f} min wall "
             f"({total:.0f} test-seconds)", "", "| file | tests | skipped | seconds | share |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, (seconds, tests, skipped) in sorted(rows.items(), key=lambda item: -item[1][0]):
        lines.append(f"| `{name}` | {tests} | {skipped} | {seconds:.1f} | {seconds / total:.1%} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", type=Path, required=True)
    parser.add_argument("--heavy", type=Path, required=True)
    parser.add_argument("--wall-unit", type=float, required=True, help="the unit stage's wall seconds")
    parser.add_argument("--wall-heavy", type=float, required=True, help="the heavy stage's wall seconds")
    parser.add_argument("--note", required=True, help="date, machine, command")
    args = parser.parse_args()
    lines = ["# `make test` durations per test file", "", args.note, "",
             "Written by `scripts/durations_table.py` from the stages' `--junitxml`. Both stages run on two pytest "
             "workers (`-n 2 --dist loadfile`), so a file's seconds are measured while another file runs beside it "
             "and the seconds of a stage add up to about twice its wall time.", ""]
    lines += table("Unit stage", per_file(args.unit), args.wall_unit)
    lines += table("Heavy stage", per_file(args.heavy), args.wall_heavy)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
