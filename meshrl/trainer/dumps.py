"""What a run writes about its generations besides metrics (verl's trainer keys, verl's formats).

- ``trainer.rollout_data_dir``: each training step's responses as ``<dir>/<step>.jsonl``, one line per
  response: ``input`` (the prompt, decoded without special tokens), ``output`` (the response, likewise),
  ``gts`` (the ground truth), ``score`` (the outcome score, before any KL penalty), ``step``, then each
  per-response extra output of the reward function (the other keys of a dict-valued score).
- ``trainer.validation_data_dir``: each validation's responses as ``<dir>/<step>.jsonl``, the same fields
  with ``reward`` (the score again, as verl writes it) before the extra outputs.
- ``trainer.log_val_generations=N``: N validation responses per validation, picked as verl picks them
  (sorted by input, shuffled with the fixed seed 42, the first N: the same prompts every time, so their
  outputs can be followed through training), appended as ``{"step", "input", "output", "score"}`` lines
  to ``<run dir>/val_generations.jsonl``. verl shows them as a W&B / TensorBoard table; meshrl writes
  them to a file whatever ``trainer.logger`` says, so a console-only run has them too. A resumed run
  drops the lines after the step it resumes from, as it does the metrics'.

A dump file of an existing step is replaced (a resumed run writes its steps again).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from meshrl.atomic_io import write_text_atomically
from meshrl.protocol import Batch
from meshrl.trainer.tracking import read_metrics
from meshrl.workers.sequences import attended

VAL_GENERATIONS_FILE = "val_generations.jsonl"
# Batch.meta key naming the non-tensor fields that hold the reward function's extra outputs (verl's name).
REWARD_EXTRA_KEYS = "reward_extra_keys"
_VAL_SAMPLE_SEED = 42  # verl's


def decode_responses(batch: Batch, tokenizer: Any) -> list[str]:
    """Each row's response text, decoded without special tokens: all its tokens, a multi-turn response's tool
    outputs included (what verl's reward managers decode)."""
    return tokenizer.batch_decode(
        [r[m.bool()].tolist() for r, m in zip(batch["responses"], attended(batch))], skip_special_tokens=True)


def set_reward_extras(batch: Batch, extras: dict[str, list[Any]]) -> None:
    """Keep the reward function's per-response extra outputs in ``batch`` under their names, as verl does.

    Raises:
        ValueError: an extra output is named like a field the batch already has (it would replace it).
    """
    taken = sorted(set(extras) & set(batch.keys()) - set(batch.meta.get(REWARD_EXTRA_KEYS, ())))
    if taken:
        raise ValueError(f"the reward function returns extra output(s) {taken}, named like fields of the RL batch; "
                         f"rename them in its returned dict")
    for key, values in extras.items():
        batch.set(key, values)
    batch.meta[REWARD_EXTRA_KEYS] = list(extras)


class GenerationDumps:
    """The dumps and the validation-sample log of one run (module docstring); each call does nothing
    when its key is unset.

    Args:
        trainer: the ``trainer`` config section (``rollout_data_dir``, ``validation_data_dir``,
            ``log_val_generations``).
        run_dir: the run folder (``trainer.default_local_dir``), where ``val_generations.jsonl`` goes.
        tokenizer: decodes prompts and responses.
    """

    def __init__(self, trainer: Any, run_dir: Path, tokenizer: Any) -> None:
        self.rollout_dir = Path(trainer.rollout_data_dir).expanduser() if trainer.rollout_data_dir else None
        self.validation_dir = Path(trainer.validation_data_dir).expanduser() if trainer.validation_data_dir else None
        self.log_val_generations = int(trainer.log_val_generations)
        if self.log_val_generations < 0:
            raise ValueError(f"trainer.log_val_generations must be >= 0, got {self.log_val_generations}")
        self.val_log = Path(run_dir).expanduser() / VAL_GENERATIONS_FILE
        self.tokenizer = tokenizer

    def rollouts(self, step: int, batch: Batch) -> None:
        """Dump a scored training batch (``trainer.rollout_data_dir``)."""
        if self.rollout_dir is not None:
            _write_jsonl(self.rollout_dir / f"{step}.jsonl", _rows(self.columns(batch), step))

    def validation_columns(self, batch: Batch) -> dict[str, list[Any]]:
        """What :meth:`validation` needs of one scored validation batch; empty when nothing is dumped or logged."""
        if self.validation_dir is None and not self.log_val_generations:
            return {}
        return self.columns(batch, with_reward=True)

    def validation(self, step: int, parts: list[dict[str, list[Any]]]) -> None:
        """Dump one validation (``trainer.validation_data_dir``) and log its samples (``log_val_generations``),
        from the :meth:`validation_columns` of its batches in order."""
        if not parts or not parts[0]:
            return
        # A reward output that only some batches have cannot fill its column: left out, as verl does.
        columns = {key: [v for part in parts for v in part[key]] for key in parts[0] if all(key in p for p in parts)}
        if self.validation_dir is not None:
            _write_jsonl(self.validation_dir / f"{step}.jsonl", _rows(columns, step))
        if self.log_val_generations:
            samples = sorted(zip(columns["input"], columns["output"], columns["score"]), key=lambda s: s[0])
            np.random.RandomState(_VAL_SAMPLE_SEED).shuffle(samples)
            lines = [json.dumps({"step": step, "input": i, "output": o, "score": s}, ensure_ascii=False) + "\n"
                     for i, o, s in samples[: self.log_val_generations]]
            self.val_log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.val_log, "a", encoding="utf-8") as f:
                f.writelines(lines)

    def truncate_after(self, step: int) -> None:
        """Continue a run after ``step``: drop the validation samples logged after it; 0 is a fresh start,
        which drops an older run's step-0 samples too."""
        if not self.val_log.is_file():
            return
        kept = [r for r in read_metrics(self.val_log) if r["step"] <= step] if step > 0 else []
        write_text_atomically(self.val_log, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))

    def columns(self, batch: Batch, with_reward: bool = False) -> dict[str, list[Any]]:
        """verl's dump columns of a scored batch: input, output, gts, score, [reward,] the reward's extras."""
        scores = batch["token_level_scores"].sum(-1).tolist()
        columns = {"input": self.tokenizer.batch_decode(list(batch["prompt_ids"]), skip_special_tokens=True),
                   "output": decode_responses(batch, self.tokenizer), "gts": batch["ground_truth"].tolist(),
                   "score": scores}
        if with_reward:
            columns["reward"] = scores
        for key in batch.meta.get(REWARD_EXTRA_KEYS, ()):
            columns[key] = batch[key].tolist()
        return columns


def _rows(columns: dict[str, list[Any]], step: int) -> list[dict[str, Any]]:
    # verl's key order: input, output, gts, score, step, then the rest.
    head = ("input", "output", "gts", "score")
    return [{**{k: columns[k][i] for k in head}, "step": step,
             **{k: v[i] for k, v in columns.items() if k not in head}} for i in range(len(columns["input"]))]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows))
