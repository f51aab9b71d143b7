"""The RL loop. ``RLTrainer.train_step`` is the algorithm; everything else is bookkeeping.

    for step in 1..T:
        prompts       ← sampler                                   (data.train_batch_size prompts)
        responses     ← policy.generate(prompts × n)             (+ one greedy response per prompt: ReMax)
        scores        ← reward(responses)                        (rule-based, process pool; or the reward model)
        ref_log_probs ← reference(responses)                     (only when a KL term is used)
        old_log_probs ← policy(responses)                        (unless on-policy: then the update's own forward;
                                                                  bypass mode: the engine's rollout_log_probs)
        values        ← critic(responses)                        (PPO)
        rewards       ← scores − β·KL                            (algorithm.use_kl_in_reward)
        is_weights    ← π_old/π_rollout; drop rejected tokens    (algorithm.rollout_correction, verl's)
        advantages    ← estimator(rewards, ...)                  (algorithm.adv_estimator)
        critic.update(returns)                                   (PPO; its own epochs × mini-batches)
        policy.update(advantages)   if step > critic_warmup      (ppo_epochs × mini-batches, each in micro-batches;
                                                                  one LR-schedule step per RL step)
        engine ← sync(policy weights)
        alarm if old_log_probs ≠ rollout_log_probs               (trainer.on_mismatch: a stale sync,
                                                                  a broken conversion)
        dump generations                                         (trainer.rollout_data_dir)
        validate every test_freq; checkpoint every save_freq
        stop when asked (SIGTERM with trainer.save_on_preempt): checkpoint this step first
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from meshrl.algorithms import GlobalNorm, make_kl_controller
from meshrl.algorithms.rollout_correction import off_policy_metrics
from meshrl.algorithms.variance_proxy import variance_proxy_metrics
from meshrl.config.run_plan import RunPlan, UpdateSchedule
from meshrl.data.dataset import RLDataset
from meshrl.data.sampler import PromptSampler, validation_batches
from meshrl.parallel.vision_language import MULTI_MODAL_INPUTS
from meshrl.protocol import Batch
from meshrl.rewards.overlong import overlong_buffer
from meshrl.rewards.pool import RewardPool
from meshrl.rollout.agent_loop import AGENT_STATS, agent_metrics, agent_reward_info
from meshrl.trainer.advantage import compute_advantages, compute_token_rewards, outcome_to_token_scores
from meshrl.trainer.alarms import MismatchAlarm
from meshrl.config.checkpoint_contents import HF_EXPORT_DIR, hf_export_roles
from meshrl.trainer.checkpoint import CheckpointManager
from meshrl.trainer.dumps import GenerationDumps, decode_responses, set_reward_extras
from meshrl.trainer.rollout_correction import apply_rollout_correction, use_rollout_log_probs
from meshrl.trainer.sample_queue import async_training_steps
from meshrl.trainer.startup import StartupClock
from meshrl.trainer.tracking import Timer, Tracker
from meshrl.workers.sequences import attended, sampled


@dataclass
class Scores:
    """One batch's scores before they join it (``RLTrainer.apply_scores``): per response, the reward model's when
    it has one, and the reward function's extra outputs and metrics."""

    scores: torch.Tensor
    rm_scores: torch.Tensor | None = None
    extras: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class RLTrainer:
    # The driver-state key under which a trainer saves what it keeps beyond the loop's state (an asynchronous
    # trainer's queue); None: nothing. A checkpoint resumes only in the trainer with its key
    # (``early_checks.resume_checkpoint``).
    STATE_KEY: str | None = None

    def __init__(self, cfg: DictConfig, plan: RunPlan, *, policy, critic, tokenizer, train_data: RLDataset,
                 val_data: RLDataset | None, reward: RewardPool, tracker: Tracker,
                 checkpoints: CheckpointManager, stop_requested: Callable[[], bool] = lambda: False,
                 reward_model=None, startup: StartupClock | None = None) -> None:
        self.cfg = cfg
        self.plan = plan  # roles, methods, widths, schedules: decided once (meshrl.config.run_plan)
        self.policy = policy  # ActorRolloutRefGroup: generate / log-probs / update / sync / save
        self.critic = critic  # CriticGroup or None
        self.reward_model = reward_model  # RewardModelGroup or None
        # reward_model.launch_reward_fn_async: the reward function scores on this thread (start_scoring)
        self.background = ThreadPoolExecutor(1, thread_name_prefix="meshrl-reward") \
            if cfg.reward_model.launch_reward_fn_async else None
        # The prompts' chat messages travel with the batch for data.return_raw_chat and for the reward model,
        # which renders them with its own chat template.
        self.raw_chat = bool(cfg.data.return_raw_chat) or plan.use_reward_model
        # Interactions read the conversation as chat messages: the workers get them too (validate requires raw chat).
        multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
        self.workers_read_chat = bool(multi_turn.enable and multi_turn.interaction_config_path)
        self.tokenizer = tokenizer
        self.train_data = train_data
        self.val_data = val_data
        self.reward = reward
        self.tracker = tracker
        self.checkpoints = checkpoints
        self.stop_requested = stop_requested  # a SIGTERM under trainer.save_on_preempt (meshrl.trainer.interrupts)
        self.startup = startup  # logged with this process's first training step (meshrl.trainer.startup)
        algo = cfg.algorithm
        self.sampler = PromptSampler(len(train_data), cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                     seed=cfg.data.seed)
        self.kl_ctrl = make_kl_controller(algo.kl_ctrl.type, kl_coef=algo.kl_ctrl.kl_coef,
                                          target_kl=algo.kl_ctrl.target_kl, horizon=algo.kl_ctrl.horizon)
        self.total_steps = total_training_steps(cfg, len(train_data))
        self.mismatch = MismatchAlarm(plan.mismatch_tolerance, cfg.trainer.on_mismatch)
        self.overlong = overlong_buffer(cfg)  # reward.reward_manager.name=dapo's penalty (None: no penalty)
        self.step = 0
        self.hf_exports = hf_export_roles(cfg, with_critic=critic is not None)
        self.dumps = GenerationDumps(cfg.trainer, Path(cfg.trainer.default_local_dir), tokenizer)

    # ------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, float]:
        """Train for ``total_steps`` (resuming if a checkpoint exists); returns the last step's metrics.

        ``trainer.val_only``: validate the policy (the resumed checkpoint's, if any), log, and stop, as
        verl does; unlike verl's, it also validates when ``val_before_train`` is False. When
        ``stop_requested()`` turns true, the step in progress finishes, is saved, and ``fit`` returns.
        """
        self.resume()
        trainer = self.cfg.trainer
        last: dict[str, float] = {}
        if self.val_data is not None and (trainer.val_only or trainer.val_before_train and self.step == 0):
            last = self.validate()
            self.tracker.log(last, step=self.step)
        if trainer.val_only:
            return last
        while self.step < self.total_steps:
            self.step += 1
            last = self.train_step()
            last.update(self.startup_metrics())
            if self.val_data is not None and self.validate_due():
                last.update(self.validate())
            self.tracker.log(last, step=self.step)
            stop = self.stop_requested()
            if self.save_due(stop):
                self.save()
            if stop:
                break
        return last

    def save_due(self, stop: bool) -> bool:
        """A checkpoint after this step: on a stop request, at the last step, and every ``trainer.save_freq`` steps
        (0 or less: only on a stop request)."""
        freq = self.cfg.trainer.save_freq
        return stop or freq > 0 and (self.step % freq == 0 or self.step == self.total_steps)

    def startup_metrics(self) -> dict[str, float]:
        """At this process's first training step, where the time before its end went (``startup/*``); then {}."""
        if self.startup is None:
            return {}
        clock, self.startup = self.startup, None
        return {**clock.metrics(), "startup/first_step_s": clock.elapsed_s()}

    def train_step(self) -> dict[str, float]:
        timer, metrics = Timer(), {}
        with timer("step"):
            with timer("gen"):
                prompts = self.next_prompts()
                batch = self.generate(prompts, mode="train")  # rollout.n rows per prompt
            batch = self.learn(batch, prompts, timer, metrics)
        return self.step_metrics(batch, timer, metrics)

    def learn(self, batch: Batch, prompts: Batch, timer: Timer, metrics: dict[str, float]) -> Batch:
        """The step after generation: score, the log-prob and value passes, advantages, the updates, and the weight
        sync (``sync_after_update``). ``prompts``: the batch's prompts, ``uid`` = their position (the greedy
        baseline's). Adds to ``metrics``; returns the batch with what the passes added."""
        cfg, plan = self.cfg, self.plan
        with timer("reward"):
            scoring = self.start_scoring(batch)  # launch_reward_fn_async: the passes below run meanwhile
        if plan.greedy_baseline:
            with timer("gen_greedy"):
                greedy = self.generate(prompts, mode="greedy")
                metrics.update(self.score(greedy, prefix="greedy_score"))
                baseline = greedy["token_level_scores"].sum(-1)
            batch.set("greedy_scores", baseline[batch["uid"]])
        if plan.use_reference:
            with timer("ref"):
                batch = self.policy.compute_log_probs(batch, model="ref")
        if plan.old_log_prob_pass:
            with timer("old_log_prob"):
                batch = self.policy.compute_log_probs(batch, model=self.old_log_prob_weights())
        elif plan.rollout_correction.bypass:  # verl's bypass mode: logπ_old ← logπ_rollout
            use_rollout_log_probs(batch)
        if plan.use_critic:
            with timer("values"):
                batch = self.critic.compute_values(batch)
        with timer("reward"):
            metrics.update(self.apply_scores(batch, scoring.result(), prefix="score"))
        with timer("adv"):
            metrics.update(compute_token_rewards(batch, cfg.algorithm, self.kl_ctrl, plan.kl_in_reward))
            metrics.update(apply_rollout_correction(batch, plan.rollout_correction))  # IS weights, rejection
            metrics.update(compute_advantages(batch, cfg.algorithm, plan.adv_estimator))
        if plan.use_critic:
            with timer("update_critic"):
                metrics.update(self.critic.update(self.mini_batches(batch, plan.critic_update, stream=1)))
        if self.step > cfg.trainer.critic_warmup:
            with timer("update_actor"):
                actor_metrics, log_probs = self.policy.update(self.mini_batches(batch, plan.actor_update),
                                                              on_policy=plan.on_policy)
            metrics.update(actor_metrics)
            if log_probs is not None:  # on-policy: logπ_θ before the step, what the recompute gives
                batch = batch.union(log_probs)
            if self.sync_after_update():
                with timer("sync"):
                    metrics.update(self.policy.sync_weights())
        return batch

    def sync_after_update(self) -> bool:
        """Whether the engines take the policy's weights after this step's update: after every one here; the
        asynchronous trainers sync every ``trigger_parameter_sync_step`` (``meshrl.trainer.async_trainer``)."""
        return True

    def alarm_applies(self) -> bool:
        """Whether the engine-versus-trainer alarm judges this step: always here (the engine serves the policy the
        trainer evaluates); the asynchronous trainers' stale samples come from older weights by design."""
        return True

    def step_metrics(self, batch: Batch, timer: Timer, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` with the trained batch's diagnostics, the engine-versus-trainer alarm's, timings, throughput
        and the epoch; dumps the batch (``trainer.rollout_data_dir``)."""
        self.dumps.rollouts(self.step, batch)
        metrics.update(batch_metrics(batch, self.plan))
        if "sum_pi_squared" in batch and "advantages" in batch:  # verl logs them whenever the actor computed Σπ²
            metrics.update(variance_proxy_metrics(
                batch["old_log_probs"], batch["sum_pi_squared"], batch["advantages"], batch["response_mask"],
                batch["rollout_is_weights"] if "rollout_is_weights" in batch else None, metrics.get("actor/grad_norm")))
        if self.alarm_applies():
            metrics.update(self.mismatch.check(self.step, metrics))
        metrics.update(timer.metrics())
        metrics["perf/tokens_per_s"] = float(sampled(batch).sum() + sum(map(len, batch["prompt_ids"]))) \
            / max(timer.total("step"), 1e-9)
        metrics["training/epoch"] = float(self.sampler.epoch)
        return metrics

    # ------------------------------------------------------------------------------- pieces
    def next_prompts(self) -> Batch:
        return prompts_batch(self.train_data, self.sampler.next_batch(), raw_chat=self.raw_chat)

    def generate(self, prompts: Batch, mode: str) -> Batch:
        """``policy.generate``. The prompts' chat messages (``raw_prompt``), which the engines never read, stay
        on the driver unless interactions read them, and join the responses by ``uid``."""
        return self.start_generate(prompts, mode)()

    def start_generate(self, prompts: Batch, mode: str, background: bool = False) -> Callable[[], Batch]:
        """``generate``, returning the function that gives its batch: generated at once, or with ``background`` on
        the policy workers' generation threads while the driver goes on calling them (``policy.start_generate``)."""
        raw = prompts["raw_prompt"] if "raw_prompt" in prompts else None
        sent = self.worker_prompts(prompts)
        wait = self.policy.start_generate(sent, mode) if background else None
        done = None if background else self.policy.generate(sent, mode=mode)

        def batch() -> Batch:
            out = wait() if background else done
            if raw is not None:
                out.set("raw_prompt", raw[out["uid"].numpy()])
            return out
        return batch

    def worker_prompts(self, prompts: Batch) -> Batch:
        """``prompts`` as the policy workers take them: the chat messages (``raw_prompt``) stay on the driver unless
        interactions read them."""
        return prompts if self.workers_read_chat else prompts.select([k for k in prompts.keys() if k != "raw_prompt"])

    def prompts_of(self, rows: list[int]) -> Batch:
        """The dataset rows' prompts as the policy workers take them (``worker_prompts``)."""
        return self.worker_prompts(prompts_batch(self.train_data, rows, raw_chat=self.raw_chat))

    def score(self, batch: Batch, prefix: str) -> dict[str, float]:
        """Score the responses and set ``token_level_scores`` (and a function's extra outputs); returns reward
        metrics. The score: the learned reward model's (``reward_model.enable``), or the reward function's that
        the row's ``data.reward_fn_key`` column picks, on the decoded responses; with both (``custom_reward_function
        .path`` set) the function's, which reads the model's as ``extra_info["rm_score"]``."""
        return self.apply_scores(batch, self.start_scoring(batch).result(), prefix)

    def start_scoring(self, batch: Batch) -> Future:
        """``score``'s computation, as a future of its ``Scores``. The learned reward model scores here; the reward
        function too, unless ``reward_model.launch_reward_fn_async``: then it runs on one background thread (its
        process pool does the work) while the caller goes on, as verl overlaps it with the log-prob passes. That
        thread scores one batch at a time, so the pool is never used by two calls at once."""
        rm_scores = self.reward_model.compute_scores(batch, self.tokenizer) if self.reward_model is not None else None
        if rm_scores is not None and not self.cfg.custom_reward_function.path:
            done: Future = Future()
            done.set_result(Scores(rm_scores, rm_scores))
            return done
        # a copy of the field dicts: the caller may add fields to ``batch`` while the function scores
        job = functools.partial(self.function_scores, batch.select(list(batch.keys())), rm_scores)
        if self.background is not None:
            return self.background.submit(job)
        done = Future()
        done.set_result(job())
        return done

    def function_scores(self, batch: Batch, rm_scores: torch.Tensor | None) -> Scores:
        """The reward function's scores of the decoded responses (with the reward model's in ``extra_info``, and a
        multi-turn rollout's ``agent_reward_info``, as verl's agent loop passes them)."""
        extra_info = list(batch["extra_info"])
        if AGENT_STATS in batch:
            extra_info = [{**(info or {}), **agent_reward_info(s)} for info, s in zip(extra_info, batch[AGENT_STATS])]
        if rm_scores is not None:
            extra_info = [{**(info or {}), "rm_score": float(s)} for info, s in zip(extra_info, rm_scores)]
        result = self.reward.score(list(batch["reward_source"]), decode_responses(batch, self.tokenizer),
                                   list(batch["ground_truth"]), extra_info)
        scores, extras = torch.tensor(result.scores, dtype=torch.float32), result.extras
        if self.overlong is not None:  # verl's dapo reward manager: + DAPO's overlong penalty
            penalty = self.overlong.penalty(attended(batch).sum(-1))
            scores = scores + penalty
            if self.overlong.log:
                extras = {**extras, "overlong_reward": penalty.tolist(), "overlong": (penalty < 0).tolist()}
        return Scores(scores, rm_scores, extras, {k: float(v) for k, v in result.metrics.items()})  # reward/...

    def apply_scores(self, batch: Batch, result: Scores, prefix: str) -> dict[str, float]:
        """Set ``token_level_scores`` (and the function's extra outputs) from ``result``; its metrics."""
        scores = result.scores
        set_reward_extras(batch, result.extras)
        batch.set("token_level_scores", outcome_to_token_scores(scores, batch["response_mask"]))
        out = {f"{prefix}/mean": float(scores.mean()), f"{prefix}/std": float(scores.std()) if len(scores) > 1 else 0.0,
               f"{prefix}/accuracy": float((scores >= 1.0).float().mean())}
        if result.rm_scores is not None:
            out[f"{prefix}/reward_model_mean"] = float(result.rm_scores.mean())
        out.update(result.metrics)
        return out

    def mini_batches(self, batch: Batch, schedule: UpdateSchedule, stream: int = 0) -> list[tuple[Batch, GlobalNorm]]:
        return mini_batches(batch, schedule, seed=[self.cfg.trainer.seed, self.step], stream=stream)

    def old_log_prob_weights(self) -> str:
        """The policy weights the old-log-prob pass runs on (``compute_log_probs``' model): the step's own."""
        return "actor"

    def validate_due(self) -> bool:
        """Validation after this step: every ``trainer.test_freq`` steps and after the last (verl's trainer)."""
        freq = self.cfg.trainer.test_freq
        return freq > 0 and (self.step % freq == 0 or self.step == self.total_steps)

    def validate(self) -> dict[str, float]:
        """Greedy (``rollout.val_kwargs``) generation on the validation set (``data.val_max_samples`` rows);
        mean score per data source. Dumps and logs the generations (``meshrl.trainer.dumps``)."""
        scores, sources, columns = [], [], []
        for indices in validation_batches(len(self.val_data), self.cfg.data.val_batch_size):
            batch = self.generate(prompts_batch(self.val_data, indices, raw_chat=self.raw_chat),
                                  mode="val")
            self.score(batch, prefix="val_tmp")
            scores.append(batch["token_level_scores"].sum(-1))
            sources.extend(batch["data_source"])
            columns.append(self.dumps.validation_columns(batch))
        self.dumps.validation(self.step, columns)
        all_scores = torch.cat(scores)
        out = {"val/score": float(all_scores.mean()), "val/accuracy": float((all_scores >= 1).float().mean())}
        for source in sorted(set(sources)):
            picked = all_scores[torch.tensor([s == source for s in sources])]
            out[f"val/{source}/score"] = float(picked.mean())
        return out

    # ------------------------------------------------------------------------------- checkpoints
    def restore_trainer_state(self, state: dict[str, Any], path: Path) -> None:
        """What a trainer keeps beyond the loop's state (``driver_state``), restored before the weights load: none
        here (a checkpoint of another trainer is refused before Ray starts: ``early_checks.resume_checkpoint``)."""

    def driver_state(self) -> dict[str, Any]:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "mismatch_alarm": self.mismatch.state_dict(),
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
                "config": OmegaConf.to_container(self.cfg)}

    def save(self) -> Path:
        parts = {"actor": self.policy} | ({"critic": self.critic} if self.critic is not None else {})

        def write_parts(folder: Path) -> None:
            for role, part in parts.items():
                part.save_checkpoint(folder, self.step)
                if role in self.hf_exports:  # hf_model in its checkpoint.save_contents
                    part.export_hf(folder / role / HF_EXPORT_DIR)

        return self.checkpoints.save(self.step, self.driver_state(), write_parts)

    def resume(self) -> None:
        trainer = self.cfg.trainer
        path = self.checkpoints.resolve(trainer.resume_mode, trainer.resume_from_path)
        if path is None:
            # A fresh run in a folder holding an older run's metrics must not append to them.
            self.tracker.truncate_after(0)
            self.dumps.truncate_after(0)
            return
        state = self.checkpoints.load_driver_state(path)
        self.restore_trainer_state(state, path)
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if "mismatch_alarm" in state:  # checkpoints from before the alarm hold no history: it starts afresh
            self.mismatch.load_state_dict(state["mismatch_alarm"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        self.policy.load_checkpoint(path)
        if self.critic is not None:
            self.critic.load_checkpoint(path)
        self.tracker.truncate_after(self.step)
        self.dumps.truncate_after(self.step)
        print(f"meshrl: resumed from step {self.step}, {path}", flush=True)


def prompts_batch(dataset: RLDataset, indices, raw_chat: bool = False) -> Batch:
    """Prompts → a ``Batch``: ragged ``prompt_ids`` + reward metadata (``reward_source``: the reward function's
    ``data_source`` argument), ``uid`` = position in the batch, with ``raw_chat`` (``data.return_raw_chat``)
    the chat messages as verl's ``raw_prompt``, and for a vision-language model verl's ``multi_modal_inputs``."""
    prompts = dataset.get_batch(list(indices))
    non_tensors = {"prompt_ids": prompts.prompt_ids, "data_source": prompts.data_sources,
                   "reward_source": prompts.reward_sources, "ground_truth": prompts.ground_truths,
                   "extra_info": prompts.extra_infos}
    if raw_chat:
        non_tensors["raw_prompt"] = prompts.messages
    if dataset.processor is not None:  # a vision-language model: each prompt's images and 3-D positions
        non_tensors[MULTI_MODAL_INPUTS] = [dataset.multi_modal_inputs(i) or None for i in prompts.indices]
    return Batch(tensors={"uid": torch.arange(len(prompts.indices))}, non_tensors=non_tensors)


def mini_batches(batch: Batch, schedule: UpdateSchedule, *, seed: list[int], stream: int = 0
                 ) -> list[tuple[Batch, GlobalNorm]]:
    """``schedule.epochs`` × mini-batches of ``schedule.mini_batch_responses`` responses, each with its global
    normaliser (seq-mean-token-sum-norm's divisor: ``schedule.loss_scale``); shuffled per epoch from ``seed`` (the
    run's seed and the step) when ``schedule.shuffle``; ``stream`` keeps a role's shuffling apart from another's (0:
    actor, 1: critic)."""
    size = schedule.mini_batch_responses
    rng = np.random.default_rng(seed + ([stream] if stream else []))
    updates = []
    for _ in range(schedule.epochs):
        # One mini-batch is the whole batch: reordering its rows would change nothing but rounding,
        # and on-policy updates hand back log-probs in the batch's row order.
        shuffle = schedule.shuffle and size < len(batch)
        order = rng.permutation(len(batch)) if shuffle else np.arange(len(batch))
        for start in range(0, len(batch), size):
            mini = batch.take(order[start:start + size])
            updates.append((mini, GlobalNorm.from_mask(mini["response_mask"], max_len=schedule.loss_scale)))
    return updates


def total_training_steps(cfg: DictConfig, num_prompts: int) -> int:
    """``trainer.total_training_steps`` if set, else the fully async trainer's prompt budget in steps
    (``meshrl.trainer.async_trainer``), else ``total_epochs`` × full batches per epoch."""
    if cfg.trainer.total_training_steps is not None:
        return int(cfg.trainer.total_training_steps)
    if (steps := async_training_steps(cfg, num_prompts)) is not None:
        return steps
    return cfg.trainer.total_epochs * (num_prompts // cfg.data.train_batch_size)


def batch_metrics(batch: Batch, plan: RunPlan) -> dict[str, float]:
    """Response-length and log-prob diagnostics of a trained batch (those of ``old_log_probs`` when it has them),
    and a multi-turn rollout's ``agent/*`` and ``tool/*`` metrics. A response's length counts its tool outputs
    (verl's); the log-prob diagnostics cover the sampled tokens (rejected ones too: ``rollout_correction``)."""
    mask = sampled(batch).bool()
    lengths = attended(batch).sum(-1).float()
    width = mask.shape[-1]
    out = {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
           "response_length/clip_ratio": float((lengths >= width).float().mean()),
           "prompt_length/mean": float(np.mean([len(p) for p in batch["prompt_ids"]]))}
    if plan.use_reference and "old_log_probs" in batch:
        diff = (batch["old_log_probs"] - batch["ref_log_probs"])[mask]
        out["actor/ref_kl_k1"] = float(diff.mean())
        out["actor/ref_log_prob_max_abs_diff"] = float(diff.abs().max())
    if "rollout_log_probs" in batch and "old_log_probs" in batch and not plan.rollout_correction.bypass:
        # the engine's vs the trainer's (trainer.alarms; and verl's rollout_corr/* off-policy diagnostics)
        gap = (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs()
        out["rollout/log_prob_max_abs_diff"] = float(gap.max())
        out["rollout/log_prob_mean_abs_diff"] = float(gap.mean())
        out.update(off_policy_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask))
    if plan.use_critic:
        out["critic/values/mean"] = float(batch["values"][mask].mean())
    if AGENT_STATS in batch:
        out.update(agent_metrics(list(batch[AGENT_STATS]), list(batch["finish_reason"])))
    return out
