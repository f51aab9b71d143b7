"""Fill a launch template's ``{{NAME}}`` / ``{{NAME:-default}}`` placeholders.

    python launch/render.py launch/slurm_ray.sbatch NNODES=4 GPUS_PER_NODE=8 CPUS_PER_NODE=96 \
        RECIPE=remax_qwen2.5-7b_seq_balance > job.sbatch && sbatch job.sbatch

Contract: every placeholder without a default must be given; giving a name the template does not
use is an error (a typo would otherwise be silently ignored); values are inserted verbatim, so
``OVERRIDES`` is pasted into the script as shell words. Prints the rendered text.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PLACEHOLDER = re.compile(r"\{\{([A-Z][A-Z0-9_]*)(?::-(.*?))?\}\}")


class RenderError(ValueError):
    """A placeholder is missing or a given name is unknown."""


def placeholders(template: str) -> dict[str, str | None]:
    """Name -> default (None when required) of every placeholder in ``template``."""
    found: dict[str, str | None] = {}
    for match in PLACEHOLDER.finditer(template):
        name, default = match.group(1), match.group(2)
        if found.get(name) is None:
            found[name] = default
    return found


def render(template: str, values: dict[str, str]) -> str:
    """``template`` with every placeholder replaced by ``values[name]`` or its default."""
    known = placeholders(template)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise RenderError(f"unknown placeholder(s) {', '.join(unknown)}; the template has {', '.join(sorted(known))}")
    missing = sorted(name for name, default in known.items() if default is None and name not in values)
    if missing:
        raise RenderError(f"missing value(s) for {', '.join(missing)} (give NAME=VALUE)")
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(2) or ""), template)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    template = Path(argv[0]).read_text()
    values = {}
    for item in argv[1:]:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"render: '{item}' is not NAME=VALUE", file=sys.stderr)
            return 2
        values[name] = value
    try:
        sys.stdout.write(render(template, values))
    except RenderError as exc:
        print(f"render: {argv[0]}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
