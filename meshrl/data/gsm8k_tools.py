r"""GSM8K with a calculator: the multi-turn tool-calling task (verl's ``gsm8k_multiturn_w_tool`` layout).

    python -m meshrl.data.gsm8k_tools --local_dir ~/data/gsm8k_calculator

writes ``train.parquet`` / ``test.parquet`` (GSM8K's 7,473 / 1,319 questions from the packaged data) and
``tool_config.yaml`` (the calculator in verl's tool-config format), for::

    data.train_files=~/data/gsm8k_calculator/train.parquet data.val_files=~/data/gsm8k_calculator/test.parquet
    actor_rollout_ref.rollout.multi_turn.enable=True
    actor_rollout_ref.rollout.multi_turn.tool_config_path=~/data/gsm8k_calculator/tool_config.yaml

Each row is GSM8K's (``meshrl.data.preprocess``) with a system message that tells the model how to call the
calculator in the Hermes format (chat templates that render ``tools=`` get its schema too, from the tool
config) and asks for the answer after ``####``, and verl's ``extra_info.agent_name: tool_agent`` (the
calculator needs no per-sample ``tools_kwargs``; parquet cannot store their empty mapping). ``data_source`` stays
``openai/gsm8k``: the reward is GSM8K's strict ``####`` rule (``meshrl.rewards.gsm8k``) on the whole
decoded response (tool outputs included, as verl's reward managers decode it), so using the tool is
rewarded only through the right final answer.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from meshrl.data.preprocess import build_rows

TOOL_NAME = "calculator"
CALCULATOR_TOOL = {
    "class_name": "meshrl.rollout.tools.calculator.CalculatorTool",
    "config": {"type": "native"},
    "tool_schema": {"type": "function", "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression (numbers, parentheses, + - * / // % **) and return its "
                       "value.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "The expression, e.g. \"(48 / 2) * 3\""}}, "required": ["expression"]},
    }},
}
SYSTEM_PROMPT = (
    "You are a math expert. Solve the problem step by step. For arithmetic, call the calculator by writing "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "<arithmetic expression>"}}</tool_call> '
    "and stop; its result comes back in the next message. Put your final answer in the format of `#### <answer>`."
)


def calculator_row(row: dict[str, Any]) -> dict[str, Any]:
    """A GSM8K row (``meshrl.data.preprocess`` layout) as a multi-turn calculator row (module docstring)."""
    return {**row,
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, *row["prompt"]],
            "extra_info": {**row["extra_info"], "agent_name": "tool_agent"}}


def write_task(local_dir: str | Path) -> dict[str, Path]:
    """Write the task's parquet splits and its tool config into ``local_dir``; returns name -> path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(local_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in ("train", "test"):
        written[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist([calculator_row(row) for row in build_rows("gsm8k", split)]),
                       written[split])
    written["tool_config"] = out / "tool_config.yaml"
    written["tool_config"].write_text(yaml.safe_dump({"tools": [CALCULATOR_TOOL]}, sort_keys=False))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshrl.data.gsm8k_tools",
                                     description="Write GSM8K-with-calculator (multi-turn) parquet and its tool "
                                                 "config.")
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default="~/data/gsm8k_calculator")
    for name, path in write_task(parser.parse_args(argv).local_dir).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
