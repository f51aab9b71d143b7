r"""GSM8K with a user who checks the answer: verl's ``gsm8k_multiturn_w_interaction`` task (the layout of verl's
``examples/data_preprocess/gsm8k_multiturn_w_interaction.py``).

    python -m meshrl.data.gsm8k_interaction --local_dir ~/data/gsm8k_interaction

writes ``train.parquet`` / ``test.parquet`` (GSM8K's 7,473 / 1,319 questions from the packaged data) and
``interaction_config.yaml`` (verl's ``gsm8k_interaction_config.yaml``: verl's GSM8K interaction by its verl class
name, which meshrl maps onto its own, ``meshrl.rollout.interactions``), for verl's example's::

    data.train_files=~/data/gsm8k_interaction/train.parquet data.val_files=~/data/gsm8k_interaction/test.parquet
    actor_rollout_ref.rollout.multi_turn.enable=True data.return_raw_chat=True
    actor_rollout_ref.rollout.multi_turn.interaction_config_path=~/data/gsm8k_interaction/interaction_config.yaml

Each row is GSM8K's (``meshrl.data.preprocess``) with verl's system message (solve step by step, reconsider
when the user says the answer is wrong, answer after ``####``) and verl's ``extra_info.interaction_kwargs``:
``name: gsm8k`` (the interaction that answers the row), ``query`` (the question as asked) and
``ground_truth``. The reward stays GSM8K's strict ``####`` rule on the whole decoded response; the
interaction's turn scores reach a custom reward function in ``extra_info["turn_scores"]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from meshrl.data.preprocess import build_rows

INTERACTION_NAME = "gsm8k"
INTERACTION_CONFIG = {"interaction": [{"name": INTERACTION_NAME,
                                       "class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction",
                                       "config": {}}]}
SYSTEM_PROMPT = ("You are a math expert. You are given a question and you need to solve it step by step. You should "
                 "rethinking carefully if user point out your answer is wrong. Put your final answer in the format of "
                 "`#### <answer>`.")


def interaction_row(row: dict[str, Any]) -> dict[str, Any]:
    """A GSM8K row (``meshrl.data.preprocess`` layout) as verl's interaction row (module docstring)."""
    (question,) = row["prompt"]
    kwargs = {"name": INTERACTION_NAME, "query": question["content"],
              "ground_truth": row["reward_model"]["ground_truth"]}
    return {**row, "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, question],
            "extra_info": {**row["extra_info"], "interaction_kwargs": kwargs}}


def write_task(local_dir: str | Path) -> dict[str, Path]:
    """Write the task's parquet splits and its interaction config into ``local_dir``; returns name -> path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(local_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    written = {split: out / f"{split}.parquet" for split in ("train", "test")}
    for split, path in written.items():
        pq.write_table(pa.Table.from_pylist([interaction_row(row) for row in build_rows("gsm8k", split)]), path)
    written["interaction_config"] = out / "interaction_config.yaml"
    written["interaction_config"].write_text(yaml.safe_dump(INTERACTION_CONFIG, sort_keys=False))
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m meshrl.data.gsm8k_interaction",
                                     description="Write GSM8K-with-interaction (multi-turn) parquet and its "
                                                 "interaction config.")
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default="~/data/gsm8k_interaction")
    for name, path in write_task(parser.parse_args().local_dir).items():
        print(f"{name}: {path}")
