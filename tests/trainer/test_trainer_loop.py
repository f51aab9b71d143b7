"""The RL loop's verl trainer keys, run in-process with fake worker groups (no Ray, no model): val_only,
log_val_generations, rollout/validation dumps, return_raw_chat, reward_fn_key, checkpoint save_contents;
what a resume says and keeps, and a stop request (a SIGTERM under trainer.save_on_preempt)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from meshrl.config import ConfigError, load_config
from meshrl.config.run_plan import build_run_plan
from meshrl.config.validate import validate_config
from meshrl.data.dataset import load_datasets
from meshrl.protocol import Batch
from meshrl.rewards.dispatch import RewardSpec
from meshrl.rewards.pool import RewardPool
from meshrl.rollout.base import Completion
from meshrl.trainer.checkpoint import CheckpointManager, parts_to_keep
from meshrl.trainer.dumps import VAL_GENERATIONS_FILE
from meshrl.trainer.main import check_inputs
from meshrl.trainer.trainer_modes import trainer_class
from meshrl.trainer.tracking import Tracker, read_metrics
from meshrl.workers.sequences import responses_batch

# Scores 1 for the rows whose reward key is "skill", with an extra output per response (a dict-valued score).
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(data_source == "skill"), "acc": data_source == "skill"}
'''


class FakeRole:
    """A worker group's driver-side calls, recording what it is sent; checkpoints are small files."""

    def __init__(self, role: str, tokenizer, width: int) -> None:
        self.role, self.width = role, width
        self.response = tokenizer("The answer is 2", add_special_tokens=False)["input_ids"]
        self.generated: list[tuple[str, list[str]]] = []  # (mode, fields sent)
        self.prompts: list[list[list[int]]] = []  # each generate call's prompts (token ids)
        self.updates: list[Batch] = []
        self.exports: list[Path] = []
        self.stream: dict[int, dict] = {}  # key -> the group's prompt ids, the version of each run it was in
        self.finish_order: list[dict] = []
        self.submitted: list[int] = []
        self.dropped: list[int] = []
        self.stream_runs: list[tuple[int, int, list[int]]] = []  # (until, version, wait_for) of each run
        self.finished: list[list[int]] = []  # what each run returned
        self.taken: list[list[int]] = []
        self.syncs: list[int] = []  # the number of updates done at each weight sync
        self.validations: list[int] = []  # the number of updates the engine's weights hold at each validation
        self.log_prob_passes: list[str] = []  # compute_log_probs' model, in call order
        self.kept: list[int] = []  # the number of updates done at each keep_version_weights

    def generate(self, prompts: Batch, mode: str) -> Batch:
        self.generated.append((mode, sorted(prompts.keys())))
        if mode == "val":
            self.validations.append(self.syncs[-1] if self.syncs else 0)
        self.prompts.append([list(p) for p in prompts["prompt_ids"]])
        n = 2 if mode == "train" else 1
        completions = [Completion(p, s, self.response, [-0.5] * len(self.response), "stop")
                       for p in range(len(prompts)) for s in range(n)]
        return responses_batch(prompts, completions, n, self.width, pad_id=0)

    def start_generate(self, prompts: Batch, mode: str):
        rows = self.generate(prompts, mode)  # at once: what a generation thread would give, for the driver's order
        return lambda: rows

    # verl V1 colocate_async's partial rollout (one replica), in engine "ticks": a group whose prompt's token ids sum
    # to an odd number takes two, the others one; a run ticks every unfinished group until enough are finished (a
    # long group can be cut there, and finishes in a later run on the weights synced meanwhile)
    num_replicas = 1

    def stream_submit(self, prompts: list[Batch], keys: list[list[int]]) -> None:
        for ids, key in zip(prompts[0]["prompt_ids"] if keys[0] else [], keys[0]):
            self.stream[key] = {"ids": list(ids), "runs": [], "need": 2 if sum(ids) % 2 else 1}
            self.submitted.append(key)

    def stream_run(self, until: list[int], version: int, wait_for: list[list[int]]) -> list[list[int]]:
        self.stream_runs.append((until[0], version, list(wait_for[0])))
        waited = [self.stream[key] for key in wait_for[0]]
        while (live := [g for g in self.stream.values() if len(g["runs"]) < g["need"]]) and (
                len(self.finish_order) < until[0] or any(g in live for g in waited)):
            for group in live:
                group["runs"].append(version)
                if len(group["runs"]) == group["need"]:
                    self.finish_order.append(group)
        self.finished.append([key for group in self.finish_order for key, g in self.stream.items() if g is group])
        return [self.finished[-1]]

    def stream_take(self, prompts: list[Batch], keys: list[list[int]]) -> list[Batch]:
        completions = []
        self.taken.append(list(keys[0]))
        for position, key in enumerate(keys[0]):
            group = self.stream.pop(key)
            self.finish_order.remove(group)
            assert list(prompts[0]["prompt_ids"][position]) == group["ids"]
            cut = len(self.response) // 2
            versions = [group["runs"][0]] * cut + [group["runs"][-1]] * (len(self.response) - cut)
            completions += [Completion(position, s, self.response, [-0.5] * len(self.response), "stop",
                                       policy_versions=versions) for s in range(2)]
        return [responses_batch(prompts[0], completions, 2, self.width, pad_id=0)]

    def stream_drop(self, keys: list[list[int]]) -> None:
        for key in keys[0]:
            group = self.stream.pop(key)
            if group in self.finish_order:
                self.finish_order.remove(group)
            self.dropped.append(key)

    def compute_log_probs(self, batch: Batch, model: str) -> Batch:
        self.log_prob_passes.append(model)
        batch.set(f"{'ref' if model == 'ref' else 'old'}_log_probs", batch["rollout_log_probs"].clone())
        return batch

    def keep_version_weights(self) -> None:
        self.kept.append(len(self.updates))

    def compute_values(self, batch: Batch) -> Batch:
        batch.set("values", torch.zeros(batch["response_mask"].shape))
        return batch

    def update(self, updates, on_policy: bool = False):
        self.updates.extend(mini for mini, _ in updates)
        metrics = {f"{self.role}/grad_norm": 1.0}
        return metrics if self.role == "critic" else (metrics, None)

    def sync_weights(self) -> dict[str, float]:
        self.syncs.append(len(self.updates))
        return {}

    def save_checkpoint(self, folder: Path, step: int) -> None:
        (Path(folder) / self.role).mkdir()
        (Path(folder) / self.role / "weights").write_text(str(step))

    def load_checkpoint(self, folder: Path) -> None:
        assert (Path(folder) / self.role / "weights").is_file()

    def export_hf(self, out_dir: Path) -> None:
        self.exports.append(Path(out_dir))
        Path(out_dir).mkdir()
        (Path(out_dir) / "config.json").write_text("{}")


@pytest.fixture
def run(tmp_path, smollm2_dir):
    """``run(*overrides) -> (trainer, policy)`` after ``fit()``: the tiny recipe on a few GSM8K-style rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    rows = [{"data_source": "openai/gsm8k", "ability": "skill" if i % 2 else "other",
             "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"ground_truth": str(i + 1)}, "extra_info": {"index": i}} for i in range(12)]
    for name, part in (("train", rows[:8]), ("val", rows[8:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    (tmp_path / "reward.py").write_text(REWARD_FILE)

    def fit(*overrides: str, stop_requested=lambda: False, reward_model=None):
        cfg = load_config([f"data.train_files={tmp_path / 'train.jsonl'}", f"data.val_files={tmp_path / 'val.jsonl'}",
                           f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]",
                           f"custom_reward_function.path={tmp_path / 'reward.py'}", *overrides], recipe="cpu_tiny_grpo")
        plan = build_run_plan(cfg)
        policy = FakeRole("actor", tokenizer, plan.response_length)
        critic = FakeRole("critic", tokenizer, plan.response_length) if plan.use_critic else None
        train_data, val_data = load_datasets(cfg.data, tokenizer)
        check_inputs(cfg, train_data, val_data)  # the data stage's rules, as the entry runs them
        run_dir = Path(cfg.trainer.default_local_dir)
        with RewardPool(RewardSpec(str(tmp_path / "reward.py")), num_workers=0) as reward, \
                Tracker(["jsonl"], run_dir, "p", "e", {}, 2) as tracker:
            trainer = trainer_class(cfg)(cfg, plan, policy=policy, critic=critic, tokenizer=tokenizer,
                                         train_data=train_data, val_data=val_data, reward=reward, tracker=tracker,
                                         checkpoints=CheckpointManager(run_dir, parts_to_keep(cfg.trainer)),
                                         stop_requested=stop_requested, reward_model=reward_model)
            trainer.fit()
        return trainer, policy

    return fit


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        steps.setdefault(record["step"], {}).update(record)
    return steps


@pytest.mark.parametrize("before", [True, False])
def test_val_only_validates_logs_and_stops(run, tmp_path, before):
    trainer, policy = run("trainer.val_only=True", f"trainer.val_before_train={before}")
    assert [mode for mode, _ in policy.generated] == ["val"] and trainer.step == 0
    assert list(metrics_by_step(tmp_path / "run")) == [0] and "val/score" in metrics_by_step(tmp_path / "run")[0]
    # without validation data it stops at config time, before any model or worker
    with pytest.raises(ConfigError, match="trainer.val_only: .* set data.val_files"):
        validate_config(load_config(["trainer.val_only=True", "data.val_files=[]"], recipe="cpu_tiny_grpo"))


def test_reward_fn_key_picks_the_reward_column(run, tmp_path):
    run("data.reward_fn_key=ability")
    by_ability = metrics_by_step(tmp_path / "run")
    assert by_ability[1]["score/mean"] == 0.5 and by_ability[0]["val/score"] == 0.5  # every other row is "skill"
    assert by_ability[1]["reward/num_acc"] == 4  # the reward's extra output: 2 "skill" prompts × 2 responses
    run()  # data.reward_fn_key=data_source: no row's data_source is "skill"
    assert metrics_by_step(tmp_path / "run")[1]["score/mean"] == 0.0


@pytest.mark.parametrize("raw_chat", [True, False])
def test_return_raw_chat_keeps_each_rows_messages_on_the_driver(run, smollm2_dir, raw_chat):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    _, policy = run(f"data.return_raw_chat={raw_chat}")
    assert all("raw_prompt" not in fields for _, fields in policy.generated)  # the engines never get them
    rows = Batch.concat([mini.select(["prompt_ids", *(["raw_prompt"] if raw_chat else [])])
                         for mini in policy.updates])
    if not raw_chat:
        assert "raw_prompt" not in policy.updates[0]
        return
    for prompt_ids, messages in zip(rows["prompt_ids"], rows["raw_prompt"]):
        assert messages[0]["role"] == "user"
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False) == list(prompt_ids)


def test_rollout_and_validation_dumps_as_verl(run, tmp_path, smollm2_dir):
    rollouts, validations = tmp_path / "rollouts", tmp_path / "validations"
    run("data.reward_fn_key=ability", f"trainer.rollout_data_dir={rollouts}",
        f"trainer.validation_data_dir={validations}")
    assert sorted(p.name for p in rollouts.iterdir()) == ["1.jsonl", "2.jsonl"]
    assert sorted(p.name for p in validations.iterdir()) == ["0.jsonl", "2.jsonl"]  # before training, test_freq=2
    lines = [json.loads(line) for line in (rollouts / "1.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and list(lines[0]) == ["input", "output", "gts", "score", "step", "acc"]
    assert lines[0]["output"] == "The answer is 2" and lines[0]["step"] == 1
    assert lines[0]["input"].startswith("system\n") and lines[0]["input"].endswith("+ 1?\nassistant\n")
    assert {(line["gts"], line["score"], line["acc"]) for line in lines} <= {
        (str(i + 1), float(i % 2), bool(i % 2)) for i in range(8)}
    val = [json.loads(line) for line in (validations / "2.jsonl").read_text().splitlines()]
    assert len(val) == 4 and list(val[0]) == ["input", "output", "gts", "score", "step", "reward", "acc"]
    assert [v["gts"] for v in val] == ["9", "10", "11", "12"] and all(v["reward"] == v["score"] for v in val)


def test_log_val_generations_picks_samples_as_verl(run, tmp_path):
    trainer, _ = run("trainer.log_val_generations=3")
    lines = [json.loads(line) for line in (tmp_path / "run" / VAL_GENERATIONS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 0, 0, 2, 2, 2]
    inputs = sorted(trainer.tokenizer.batch_decode([trainer.val_data[i].prompt_ids for i in range(4)],
                                                   skip_special_tokens=True))
    picked = list(range(4))
    np.random.RandomState(42).shuffle(picked)  # verl: sorted by input, shuffled with seed 42, the first N
    assert [line["input"] for line in lines[:3]] == [inputs[i] for i in picked[:3]]
    assert lines[:3] == [{**line, "step": 0} for line in lines[3:]]
    assert set(lines[0]) == {"step", "input", "output", "score"}
    trainer.dumps.truncate_after(1)  # a run resumed from step 1 forgets what came after
    assert [json.loads(line)["step"] for line in trainer.dumps.val_log.read_text().splitlines()] == [0, 0, 0]
    trainer.dumps.truncate_after(0)  # a fresh run in the same folder keeps nothing of the old one, step 0 included
    assert trainer.dumps.val_log.read_text() == ""


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_hf_model_in_save_contents_exports_each_role(run, tmp_path, estimator):
    contents = "[model,optimizer,extra,hf_model]"
    trainer, policy = run(f"algorithm.adv_estimator={estimator}", "trainer.save_freq=1",
                          f"actor_rollout_ref.actor.checkpoint.save_contents={contents}",
                          f"critic.checkpoint.save_contents={contents}")
    roles = ["actor", "critic"] if estimator == "gae" else ["actor"]
    assert trainer.hf_exports == roles
    for step in (1, 2):
        for role in roles:
            assert (tmp_path / "run" / f"global_step_{step}" / role / "huggingface" / "config.json").is_file()
    assert [p.parent.name for p in policy.exports] == ["actor", "actor"]
    trainer, policy = run(f"algorithm.adv_estimator={estimator}", "trainer.save_freq=1", "trainer.resume_mode=disable")
    assert trainer.hf_exports == [] and policy.exports == []


@pytest.mark.parametrize("override, refused", [
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model]", r"save_contents=\['model'\] leaves out "
                                                                 r"\['optimizer', 'extra'\]"),
    ("actor_rollout_ref.actor.checkpoint.load_contents=[model,extra]", r"load_contents=.* leaves out \['optimizer'\]"),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_weights]",
     r"\['hf_weights'\] not among verl's"),
    ("critic.checkpoint.save_contents=[model,optimizer]", r"critic.checkpoint.save_contents=.* leaves out \['extra'\]"),
])
def test_checkpoint_contents_meshrl_cannot_honour_are_refused(override, refused):
    with pytest.raises(ConfigError, match=refused):
        validate_config(load_config(["algorithm.adv_estimator=gae", override], recipe="cpu_tiny_grpo"))


def test_critic_contents_are_not_checked_without_a_critic(run):
    trainer, _ = run("critic.checkpoint.save_contents=[model]")
    assert trainer.hf_exports == []


def test_resume_says_where_it_starts_and_a_fresh_start_forgets_the_old_run(run, tmp_path, capsys):
    run("trainer.save_freq=1")
    assert "resumed" not in capsys.readouterr().out
    run("trainer.total_training_steps=3")
    assert f"meshrl: resumed from step 2, {tmp_path / 'run' / 'global_step_2'}\n" in capsys.readouterr().out
    run("trainer.resume_mode=disable")  # a fresh run in the used folder: its own step 0 only
    assert [record["step"] for record in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]


def test_an_asynchronous_checkpoint_resumes_its_queue_and_no_trainer_resumes_the_others(run, tmp_path):
    """Fully async at staleness 1 (4 prompts a step, up to 8 ahead), the rollouter overlapping the trainer: after step
    2 the queue holds the 4 samples that step's rollouter generated; the checkpoint keeps them as generated (rows,
    versions), and a resume trains them at step 3, exactly as the run that saved them would have, while its rollouter
    starts 4 new prompts (the staleness bound counts the 4 queued); it counts on. A synchronous checkpoint does not
    resume asynchronously, nor the other way round. (The rollouter that waits at a sync, one engine call per version:
    with partial rollout a save also waits for every group, so the queue saved is the same.)"""
    fully_async = ("trainer.async_mode=fully_async", "algorithm.rollout_correction.bypass_mode=True",
                   "async_training.partial_rollout=False",
                   "async_training.staleness_threshold=1", "async_training.require_batches=2",
                   "async_training.trigger_parameter_sync_step=1", "trainer.save_freq=1")
    trainer, policy = run(*fully_async, "trainer.total_training_steps=3")  # the uninterrupted run
    steps = metrics_by_step(tmp_path / "run")
    third = policy.updates[-2:]  # step 3's two mini-batches (require_batches=2)
    shutil.rmtree(tmp_path / "run" / "global_step_3")
    assert trainer.overlap
    trained = [p for (mode, _), p in zip(policy.generated, policy.prompts) if mode == "train"]
    assert [len(p) for p in trained] == [8, 4, 4]  # one step ahead of the trainer, then what each step freed
    saved = CheckpointManager(tmp_path / "run").load_driver_state(tmp_path / "run" / "global_step_2")["async"]
    assert [len(sample["rows"]["tensors"]["responses"]) for sample in saved["samples"]] == [2] * 4  # rollout.n rows
    assert saved["version"] == 2 and all(sample["versions"] == [[1, 1]] * 2 for sample in saved["samples"])
    resumed, policy = run(*fully_async, "trainer.total_training_steps=3")
    generated = [p for (mode, _), p in zip(policy.generated, policy.prompts) if mode == "train"]
    assert generated[0] == trained[2]  # the saved samples are not generated again: the next 4 prompts are
    for mine, theirs in zip(policy.updates, third):  # step 3 trains the saved samples as the uninterrupted run did
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) if k in mine.tensors else list(mine[k]) == list(theirs[k])
                   for k in mine.keys())
    assert metrics_by_step(tmp_path / "run")[3]["fully_async/count/total_generated_samples"] == \
        steps[3]["fully_async/count/total_generated_samples"]
    assert resumed.queue.rollout_version == 3 and resumed.queue.counters()["consumed"] == 12
    with pytest.raises(ConfigError, match="saved by an asynchronous trainer"):
        run("trainer.total_training_steps=4")
    run("trainer.resume_mode=disable", "trainer.save_freq=1")  # a synchronous run's checkpoints
    with pytest.raises(ConfigError, match="saved by another trainer"):
        run(*fully_async, "trainer.total_training_steps=3")


def test_an_asynchronous_run_of_two_steps_per_version_saves_at_syncs_and_resumes_its_trigger_count(run, tmp_path):
    """trigger_parameter_sync_step=2: save_freq counts versions (verl's), so checkpoints are taken at syncs, and a
    resume goes on with the uninterrupted run's syncs and updates; a stop request between two syncs syncs first."""
    fully_async = ("trainer.async_mode=fully_async", "algorithm.rollout_correction.bypass_mode=True",
                   "async_training.partial_rollout=False", "async_training.staleness_threshold=1",
                   "async_training.require_batches=1", "async_training.trigger_parameter_sync_step=2",
                   "trainer.save_freq=1")
    _, policy = run(*fully_async, "trainer.total_training_steps=4")  # the uninterrupted run
    updates, syncs = policy.updates, policy.syncs
    assert sorted(p.name for p in (tmp_path / "run").glob("global_step_*")) == ["global_step_2", "global_step_4"]
    assert syncs == [2, 4]  # one mini-batch per step: a sync after every second update
    shutil.rmtree(tmp_path / "run" / "global_step_4")
    resumed, policy = run(*fully_async, "trainer.total_training_steps=4")
    assert [n + 2 for n in policy.syncs] == syncs[1:] and resumed.queue.rollout_version == 2
    for mine, theirs in zip(policy.updates, updates[2:], strict=True):  # steps 3 and 4 as the uninterrupted run's
        assert all(torch.equal(mine[k], theirs[k]) if k in mine.tensors else list(mine[k]) == list(theirs[k])
                   for k in theirs.keys())
    shutil.rmtree(tmp_path / "run" / "global_step_4")
    stopped, policy = run(*fully_async, "trainer.total_training_steps=4", stop_requested=lambda: True)
    assert stopped.step == 3 and policy.syncs == [1]  # step 3 was the version's first: the save synced first
    saved = CheckpointManager(tmp_path / "run").load_driver_state(tmp_path / "run" / "global_step_3")["async"]
    assert saved["version"] == 2 and stopped.queue.rollout_version == 2


@pytest.mark.parametrize("frequency, validated", [("trainer.test_freq=1", [2, 4, 5]),
                                                 ("rollout.test_freq=2", [4, 5])])
def test_the_fully_async_trainer_validates_right_after_every_test_freq_th_sync_and_at_the_end(run, tmp_path,
                                                                                              frequency, validated):
    """verl's cadence: test_freq counts parameter versions (the older verl's rollout.test_freq too); the engine
    scores the weights it just took, and the last step, between two syncs, ends its version and syncs first."""
    _, policy = run("trainer.async_mode=fully_async", "algorithm.rollout_correction.bypass_mode=True",
                    "async_training.partial_rollout=False", "async_training.staleness_threshold=1",
                    "async_training.require_batches=1", "async_training.trigger_parameter_sync_step=2",
                    "trainer.total_training_steps=5", "trainer.val_before_train=False", frequency)
    assert policy.syncs == [2, 4, 5] and policy.validations == validated
    steps = metrics_by_step(tmp_path / "run")
    assert [step for step in sorted(steps) if "val/score" in steps[step]] == validated


def test_decoupled_fully_async_computes_pi_old_with_the_weights_of_the_versions_start(run):
    """bypass_mode=False, two local steps per version (verl's save/restore of the model): the first local step keeps
    the weights the engine was just given and its pass runs on the step's own (the same), the second on the kept."""
    _, policy = run("trainer.async_mode=fully_async", "algorithm.rollout_correction.bypass_mode=False",
                    "async_training.partial_rollout=False", "async_training.staleness_threshold=1",
                    "async_training.require_batches=1", "async_training.trigger_parameter_sync_step=2",
                    "trainer.total_training_steps=4", "trainer.test_freq=-1", "data.train_batch_size=0")
    assert policy.syncs == [2, 4] and policy.kept == [0, 2]  # at each version's start: the synced weights
    assert [m for m in policy.log_prob_passes if m != "ref"] == ["actor", "version", "actor", "version"]


def test_the_older_verls_fully_async_keys_are_one_setting_with_the_newer_ones():
    from meshrl.config.async_keys import fully_async_epochs, fully_async_test_freq

    fully_async = ["trainer.async_mode=fully_async", "algorithm.rollout_correction.bypass_mode=True",
                   "data.train_batch_size=0", "trainer.test_freq=-1"]  # verl's default test_freq (the recipe's is 2)
    cfg = load_config([*fully_async, "rollout.test_freq=5", "trainer.total_epochs=20", "rollout.total_epochs=4"],
                      recipe="cpu_tiny_grpo")
    validate_config(cfg)
    assert fully_async_test_freq(cfg) == 5 and fully_async_epochs(cfg) == 4
    cfg = load_config([*fully_async, "trainer.test_freq=3"], recipe="cpu_tiny_grpo")
    assert fully_async_test_freq(cfg) == 3 and fully_async_epochs(cfg) == cfg.trainer.total_epochs
    with pytest.raises(ConfigError, match="rollout.test_freq=5: the older verl's name .* trainer.test_freq=3 also"):
        validate_config(load_config([*fully_async, "rollout.test_freq=5", "trainer.test_freq=3"],
                                    recipe="cpu_tiny_grpo"))


def test_a_stop_request_saves_the_step_in_progress_and_stops(run, tmp_path):
    trainer, _ = run("trainer.total_training_steps=5", stop_requested=lambda: True)
    assert trainer.step == 1
    manager = CheckpointManager(tmp_path / "run")
    assert manager.latest() == tmp_path / "run" / "global_step_1"
    assert manager.load_driver_state(manager.latest())["step"] == 1


class FakeRewardModel:
    """The reward model's driver-side call: scores from each row's prompt messages (what it renders)."""

    def __init__(self) -> None:
        self.fields: list[list[str]] = []

    def compute_scores(self, batch: Batch, tokenizer) -> torch.Tensor:
        self.fields.append(sorted(batch.keys()))
        return torch.tensor([len(chat[0]["content"]) / 100 for chat in batch["raw_prompt"]])


def test_reward_model_scores_replace_the_rule_function(run, tmp_path):
    rm = FakeRewardModel()
    run("reward_model.enable=True", "custom_reward_function.path=null", "data.return_raw_chat=False",
        reward_model=rm)
    steps = metrics_by_step(tmp_path / "run")
    # the rows' prompts "What is i + 1?" are 14 characters long: 0.14 each; the rule reward would give 0
    assert steps[1]["score/mean"] == pytest.approx(0.14) and steps[1]["score/reward_model_mean"] == pytest.approx(0.14)
    # validation is scored by the reward model too: rows 8..11, two of 14 and two of 15 characters
    assert steps[0]["val/score"] == pytest.approx(0.145)
    assert all("raw_prompt" in fields for fields in rm.fields)  # kept for it without data.return_raw_chat


def test_a_reward_function_reads_the_reward_models_score(run, tmp_path):
    # the fixture's custom_reward_function.path, rewritten before its first load
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):"
                                        "\n    return 10 * extra_info['rm_score']\n")
    run("reward_model.enable=True", reward_model=FakeRewardModel())
    assert metrics_by_step(tmp_path / "run")[1]["score/mean"] == pytest.approx(1.4)


def test_launch_reward_fn_async_scores_while_the_log_prob_passes_run(run, tmp_path, monkeypatch):
    # The reward function scores 1 only once a log-prob pass has started, which it waits for (up to 5 s): scored
    # before the passes, as without the overlap, every response would score 0.
    flag = tmp_path / "log_probs_started"
    (tmp_path / "reward.py").write_text(
        "import pathlib, time\n"
        f"FLAG = pathlib.Path({str(flag)!r})\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    deadline = time.monotonic() + 5\n"
        "    while not FLAG.exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    return float(FLAG.exists())\n")
    passes = FakeRole.compute_log_probs

    def compute_log_probs(self, batch, model):
        flag.touch()
        return passes(self, batch, model)

    monkeypatch.setattr(FakeRole, "compute_log_probs", compute_log_probs)
    run("reward_model.launch_reward_fn_async=True", "trainer.val_before_train=False", "trainer.test_freq=-1")
    steps = metrics_by_step(tmp_path / "run")
    assert steps[1]["score/mean"] == 1.0 and steps[2]["score/mean"] == 1.0


COLOCATE = ("trainer.v1.trainer_mode=colocate_async", "trainer.save_freq=1")


def test_colocate_async_trains_the_groups_finished_first_and_resumes_its_groups(run, tmp_path):
    """verl V1 colocate_async, one warm-up batch: step 1 submits 8 groups (warm-up + its batch) and trains the 4
    tagged earliest of those finished; a long group (cut by one run, finished by the next on the synced weights)
    spans two versions. Every run asks for the batch's 4 groups at the version of the syncs so far. A checkpoint
    keeps the prompts of the groups not trained; a resume resubmits them (no warm-up again); the synchronous
    trainer refuses it."""
    trainer, policy = run(*COLOCATE, "trainer.total_training_steps=3")
    assert [(until, version) for until, version, _ in policy.stream_runs] == [(4, 0), (4, 1), (4, 2)]
    assert len(policy.submitted) == 4 * 4  # warm-up + one batch a step
    assert [len(update) for update in policy.updates[::2]] == [4, 4, 4]  # 2 mini-batches of 2 groups x n=2 rows
    assert policy.taken[0] == sorted(policy.finished[0])[:4]  # all tagged step 1: submit order breaks the tie
    steps = [s for s in read_metrics(tmp_path / "run" / "metrics.jsonl") if "training/off_policy/trajectory_spans/max"
             in s]
    spans = [s["training/off_policy/trajectory_spans/max"] for s in steps]
    assert spans[0] == 1.0 and max(spans) == 2.0  # step 1's groups are whole; a later batch holds a cut group
    assert steps[0]["training/off_policy/trajectory_staleness/max"] == 0
    # step 2 trains warm-up groups begun (or finished) on the first weights, before the first sync
    assert steps[1]["training/off_policy/trajectory_staleness_worst/max"] == 1
    state = CheckpointManager(tmp_path / "run").load_driver_state(tmp_path / "run" / "global_step_3")
    in_flight = len(policy.stream)
    assert len(state["colocate_async"]["prompts"]) == in_flight == 4 and state["colocate_async"]["version"] == 3

    resumed, policy = run(*COLOCATE, "trainer.total_training_steps=4")
    assert len(policy.submitted) == in_flight + 4 and policy.stream_runs[0][:2] == (4, 3)
    with pytest.raises(ConfigError, match="saved by an asynchronous trainer"):
        run("trainer.total_training_steps=5")


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_colocate_async_drops_or_waits_for_groups_past_the_off_policy_threshold(run, strategy):
    """max_off_policy_threshold=1: a long group is two steps old when it finishes. drop evicts it (counted) and
    submits a new prompt in its place; wait asks the next run to finish every group of that age first."""
    _, policy = run(*COLOCATE, "trainer.total_training_steps=3", "trainer.v1.sampler.max_off_policy_threshold=1",
                    f"trainer.v1.sampler.max_off_policy_strategy={strategy}")
    if strategy == "drop":
        assert policy.dropped and len(policy.submitted) == 4 * 4 + len(policy.dropped)
    else:
        assert not policy.dropped and any(wait_for for _, _, wait_for in policy.stream_runs)


def test_colocate_async_keys_are_refused_in_other_trainers_and_its_limits_at_config_time():
    with pytest.raises(ConfigError, match="read by verl V1's colocate_async trainer only"):
        validate_config(load_config(["trainer.v1.colocate_async.num_warmup_batches=2"], recipe="cpu_tiny_grpo"))
    for override, match in (("actor_rollout_ref.rollout.name=hf", "rollout.name=vllm"),
                            ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "inference TP 1"),
                            ("trainer.async_mode=fully_async", "one asynchronous trainer at a time")):
        with pytest.raises(ConfigError, match=match):
            validate_config(load_config([*COLOCATE, override], recipe="cpu_tiny_grpo"))
    validate_config(load_config([*COLOCATE, "trainer.v1.sampler.max_off_policy_strategy=wait"],
                                recipe="cpu_tiny_grpo"))


def test_the_dapo_reward_manager_adds_the_overlong_penalty_to_every_score(run, tmp_path):
    """The fake's responses are 5 tokens; with max_resp_len 6 and a buffer of 4 each is 3 tokens past 6 - 4, so each
    score drops by 3 / 4 x 0.5 against the naive manager's, in training and validation alike, and log=True keeps the
    per-response penalty with the rollout dumps."""
    naive, _ = run("trainer.total_training_steps=1", "trainer.test_freq=1")
    plain = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    length = len(FakeRole("actor", naive.tokenizer, 16).response)
    dapo, _ = run("trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.resume_mode=disable",
                  f"trainer.rollout_data_dir={tmp_path / 'dumps'}", "reward.reward_manager.name=dapo",
                  "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                  "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
                  "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
                  "+reward.reward_kwargs.overlong_buffer_cfg.log=True",
                  f"+reward.reward_kwargs.max_resp_len={length + 1}")
    penalised = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    penalty = -(length - (length + 1 - 4)) / 4 * 0.5
    assert penalty < 0
    for key in ("score/mean", "val/score"):
        assert penalised[key] == pytest.approx(plain[key] + penalty), key
    (dump,) = (tmp_path / "dumps").glob("1.jsonl")
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert rows and all(r["overlong_reward"] == pytest.approx(penalty) and r["overlong"] is True for r in rows)
