"""The ``meshrl`` command.

    meshrl train RECIPE.yaml [key=value ...]     train (same as python -m meshrl.trainer.main, whose
                                                 verl-style arguments it also takes: --config-name ...)
    meshrl plot RUN_DIR [--out FILE]             draw a run's metrics.jsonl to a PNG
    meshrl plan RECIPE.yaml [key=value ...]      per-GPU memory and FLOPs of a recipe; refuses what cannot fit
    meshrl convert hf-to-mcore|mcore-to-hf ...   checkpoint conversion (see --help)
    meshrl preprocess gsm8k|math|geo3k ...       write verl-layout parquet (packaged data, or a local copy)
    meshrl refusals [KEY]                        every rule that refuses a configuration (about KEY), by stage
"""

from __future__ import annotations

import sys
from typing import Sequence

COMMANDS = ("train", "plot", "plan", "convert", "preprocess", "refusals")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "train":
        from meshrl.trainer.main import TRAIN_USAGE, main as train_main

        if not rest:  # verl's defaults alone read data from ~/data and want 8 GPUs: not what a bare command means
            print(f"usage: {TRAIN_USAGE}\nmeshrl train: give a recipe, e.g. meshrl train cpu_tiny_grpo",
                  file=sys.stderr)
            return 2
        # A leading recipe name is meshrl's form; options and overrides (verl's forms) pass through as given.
        if "=" in rest[0] or rest[0].startswith("-"):
            return train_main(rest, prog="meshrl train")
        return train_main(["--config-name", rest[0], *rest[1:]], prog="meshrl train")
    if command == "plot":
        from meshrl.trainer.plot import main as plot_main

        return plot_main(rest) or 0
    if command == "plan":
        from meshrl.memory_plan import main as plan_main

        return plan_main(rest)
    if command == "convert":
        from meshrl.parallel.convert_cli import main as convert_main

        return convert_main(rest) or 0
    if command == "preprocess":
        from meshrl.data.preprocess import main as preprocess_main

        preprocess_main(rest)
        return 0
    if command == "refusals" and len(rest) <= 1:
        from meshrl.config.key_policy import key_rule
        from meshrl.config.refusals import catalogue, render
        from meshrl.trainer.main import load_rules

        load_rules()
        rules = catalogue(rest[0] if rest else None)
        if rest:
            print(f"{rest[0]}: {key_rule(rest[0])}")
        print(render(rules) if rules else f"meshrl refusals: no rule concerns {rest[0]}")
        return 0 if rules else 1
    import difflib

    close = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    print(f"meshrl: unknown command '{command}'.{hint} Commands: {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
