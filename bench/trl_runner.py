"""TRL's side of bench/vs_trl.py: one GRPO run with ``trl.GRPOTrainer``, timed per optimizer step.

Runs inside the separate TRL environment (``bench/setup_trl.sh``), never in meshrl's: it imports no
meshrl module. The GSM8K rule is meshrl's own file (``meshrl/rewards/gsm8k.py``, standard library
only), loaded by path, so both frameworks score with the same code.

    <trl-venv>/bin/python bench/trl_runner.py SPEC.json

SPEC (written by vs_trl.py) holds the model folder, the prompts file (verl layout JSONL: ``prompt``
messages, ``reward_model.ground_truth``), the reward file, the output paths and the run settings
(see ``trl_config``). Per optimizer step one JSON line is appended to ``spec["steps_file"]``:

    step, t_begin, t_end (unix seconds), wall_s (on_step_begin -> on_step_end: generation, scoring,
    every micro-batch's forward + backward, clipping and the optimizer step), gen_s (the
    ``_generate`` call: tokenise, ``model.generate``, decode), gen_and_score_s (``_generate_and_score_completions``:
    generation + rewards + advantages + any log-prob passes), forward_s (``compute_loss`` calls: the
    training forward), prompt_tokens, response_tokens, response_length_max, mean_reward, cpu_s
    (this process's CPU seconds over the step)

and progress goes to stdout, one line per step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def load_rule(path: str):
    """``compute_score`` from a reward file loaded by path (no package import: its package pulls meshrl)."""
    spec = importlib.util.spec_from_file_location("bench_reward_rule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def trl_config(spec: dict):
    """The ``GRPOConfig`` of the run: every setting that matters for speed or for the update is explicit,
    so a TRL default changing between versions cannot change the comparison silently."""
    from trl import GRPOConfig

    bf16 = spec["dtype"] == "bf16"
    per_step = spec["prompts_per_step"] * spec["n"]
    if per_step % spec["micro_batch"]:
        raise ValueError(f"micro_batch {spec['micro_batch']} must divide prompts x n = {per_step}")
    return GRPOConfig(
        output_dir=spec["output_dir"],
        max_steps=spec["steps"],
        # One optimizer step per RL step: every completion of the step in one generation batch, split into
        # micro-batches whose gradients accumulate.
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=per_step // spec["micro_batch"],
        num_generations=spec["n"],
        num_iterations=1,
        max_completion_length=spec["max_response_length"],
        temperature=spec["temperature"], top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        beta=0.0,  # no KL term, so no reference model is loaded
        epsilon=spec["clip_ratio"],
        loss_type=spec["loss_type"],
        scale_rewards="group",
        mask_truncated_completions=False,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=spec["weight_decay"], adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        optim="adamw_torch", max_grad_norm=spec["grad_clip"],
        # TRL's own defaults are gradient checkpointing on and bf16 on; both are set explicitly here.
        gradient_checkpointing=spec["gradient_checkpointing"],
        bf16=bf16,
        model_init_kwargs={"dtype": "bfloat16" if bf16 and spec["bf16_mode"] == "weights" else "float32"},
        shuffle_dataset=False,  # the prompts file is already in the order both frameworks visit
        seed=spec["seed"],
        use_cpu=True,
        dataloader_num_workers=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        log_completions=False,
        disable_tqdm=True,
    )


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    rule = load_rule(spec["reward_file"])
    rows = read_jsonl(spec["prompts_file"])
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": str(r["reward_model"]["ground_truth"]),
                                  "data_source": r["data_source"]} for r in rows])
    steps_file = open(spec["steps_file"], "a", encoding="utf-8")

    class StepRecorder(TrainerCallback):
        """Per-step phase clock; phases are added to by the trainer subclass below."""

        def __init__(self) -> None:
            self.phases: dict[str, float] = {}
            self.scores: list[float] = []
            self.tokens = {"prompt_tokens": 0, "response_tokens": 0, "response_length_max": 0}

        @contextmanager
        def phase(self, name: str):
            start = time.perf_counter()
            try:
                yield
            finally:
                self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

        def on_step_begin(self, args, state, control, **kwargs):
            self.phases, self.scores = {}, []
            self.tokens = {"prompt_tokens": 0, "response_tokens": 0, "response_length_max": 0}
            self.t_begin, self.clock, self.cpu = time.time(), time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            wall = time.perf_counter() - self.clock
            record = {"step": state.global_step, "t_begin": self.t_begin, "t_end": time.time(), "wall_s": wall,
                      "gen_s": self.phases.get("gen", 0.0), "gen_and_score_s": self.phases.get("gen_and_score", 0.0),
                      "forward_s": self.phases.get("forward", 0.0), **self.tokens,
                      "mean_reward": statistics.fmean(self.scores) if self.scores else None,
                      "cpu_s": time.process_time() - self.cpu}
            steps_file.write(json.dumps(record) + "\n")
            steps_file.flush()
            gen_rate = record["response_tokens"] / max(record["gen_s"], 1e-9)
            print(f"trl step {record['step']}/{spec['steps']}: {wall:.1f} s (gen {record['gen_s']:.1f} s, "
                  f"{gen_rate:.0f} tok/s; train {wall - record['gen_and_score_s']:.1f} s) "
                  f"reward {record['mean_reward']}", flush=True)

    recorder = StepRecorder()

    def gsm8k_reward(completions, ground_truth, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [float(rule(text, truth)) for text, truth in zip(texts, ground_truth)]
        recorder.scores.extend(scores)
        return scores

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with phase clocks around generation, scoring and the loss forward; no behaviour change."""

        def _generate(self, prompts):
            with recorder.phase("gen"):
                return super()._generate(prompts)

        def _generate_and_score_completions(self, inputs):
            with recorder.phase("gen_and_score"):
                out = super()._generate_and_score_completions(inputs)
            recorder.tokens["prompt_tokens"] += int(out["prompt_mask"].sum())
            lengths = out["completion_mask"].sum(-1)
            recorder.tokens["response_tokens"] += int(lengths.sum())
            recorder.tokens["response_length_max"] = max(recorder.tokens["response_length_max"], int(lengths.max()))
            return out

        def compute_loss(self, *args, **kwargs):
            with recorder.phase("forward"):
                return super().compute_loss(*args, **kwargs)

    print(f"trl: loading {spec['model_dir']} ({spec['dtype']})", flush=True)
    config = trl_config(spec)
    Path(spec["config_file"]).write_text(json.dumps(config.to_dict(), indent=1, default=str))
    trainer = TimedGRPOTrainer(model=spec["model_dir"], reward_funcs=gsm8k_reward, args=config,
                               train_dataset=dataset, callbacks=[recorder])
    model = trainer.model
    info = {"event": "ready", "param_dtype": str(next(model.parameters()).dtype),
            "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
            "torch_threads": torch.get_num_threads(), "t": time.time()}
    print(json.dumps(info), flush=True)
    trainer.train()
    steps_file.close()
    log = [entry for entry in trainer.state.log_history if "loss" in entry or "reward" in entry]
    Path(spec["log_history_file"]).write_text(json.dumps(log, indent=1))
    print("trl: done", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1])
