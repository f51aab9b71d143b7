"""verl V1's ``colocate_async`` trainer: the training ranks' engines keep more prompt groups generating than a step
trains on, and a trajectory cut by a step goes on after it on the new weights.

``trainer.use_v1=True`` with ``trainer.v1.trainer_mode=colocate_async`` (verl's ``PPOTrainerColocateAsync``)::

    at a fresh start:  submit num_warmup_batches batches of prompts                   (verl's on_train_begin)
    for step s in 1..T:
        submit one batch, B = data.train_batch_size prompts, tagged s                  (prepare_step)
        generate until B groups are finished (each inference replica its share), then abort what is still
            generating, keeping its tokens                                             (sample; on_sample_end)
            age of a group = s - its tag + 1; max_off_policy_strategy=drop: a finished group older than
            max_off_policy_threshold is dropped and a new prompt takes its place; wait: generation goes on
            until every unfinished group that old is finished
        batch ← the B finished groups tagged earliest                                  (+ training/off_policy/*)
        learn(batch)                                          (the old-log-prob pass, or bypass mode, as configured)
        engine ← policy; the aborted trajectories resume on it at the next step's generation  (on_step_end)

Each group lives on one replica's ``meshrl.rollout.rollout_stream.RolloutStream`` (the engine generating request by
request; each token tagged with the version of the weights that sampled it: the number of syncs so far). verl's
gain comes from the groups that finish first training while the long ones go on later; the cost is trajectories
that span versions (``training/off_policy/trajectory_spans``). Generation and training take turns (colocated: the
engine sleeps during the update), as in verl.

**Limits** (refused at config time, ``meshrl.config.async_keys``): inference TP 1, the vLLM engine, single-turn,
no ReMax greedy pass. **Checkpoints** keep the prompts of the groups not trained yet; a resumed run generates them
again from the start on the checkpoint's weights (verl keeps its finished groups and reissues the others) and
submits no warm-up batches again (verl does).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from meshrl.protocol import Batch
from meshrl.trainer.rl_trainer import RLTrainer, prompts_batch
from meshrl.trainer.sample_queue import trajectory_span, trajectory_version_metrics
from meshrl.trainer.stream_groups import StreamGroups
from meshrl.trainer.tracking import Timer
from meshrl.workers.sequences import POLICY_VERSION

class ColocateAsyncTrainer(RLTrainer):
    """``RLTrainer``'s step on the groups that finished first, across steps (module docstring)."""

    STATE_KEY = "colocate_async"

    def __init__(self, cfg, plan, **kwargs) -> None:
        super().__init__(cfg, plan, **kwargs)
        v1 = cfg.trainer.v1
        self.warmup_batches = v1.colocate_async.num_warmup_batches
        self.threshold, self.strategy = v1.sampler.max_off_policy_threshold, v1.sampler.max_off_policy_strategy
        self.batch_size = cfg.data.train_batch_size
        self.replicas = self.policy.num_replicas
        self.streams = StreamGroups(self.replicas)  # the groups on the workers' streams, tagged with their step
        self.version = 0  # syncs of the engines' weights since the run's first weights
        self.pending: deque[int] = deque()  # dataset rows given by the sampler, not submitted yet
        self.started = False
        self.fresh = True  # every token of the step's batch from the weights the trainer evaluates

    # ------------------------------------------------------------------------------- the step
    def train_step(self) -> dict[str, float]:
        timer, metrics = Timer(), {}
        with timer("step"):
            with timer("gen"):
                if not self.started:  # a resume resubmits its saved prompts; a fresh start its warm-up batches
                    self.started = True
                    resumed, self.pending = list(self.pending), deque()
                    for rows in [resumed] if resumed else [self.sampler.next_batch()
                                                           for _ in range(self.warmup_batches)]:
                        self.submit(rows)
                self.submit(self.sampler.next_batch())
                keys, evicted = self.finished_groups()
                batch, prompts = self.take(keys)
            spans = [trajectory_span(row) for row in batch[POLICY_VERSION]]
            metrics.update(trajectory_version_metrics(self.version, spans))
            metrics["training/off_policy/evicted_samples"] = float(evicted)
            metrics["colocate_async/groups_in_flight"] = float(len(self.streams))
            self.fresh = all(first == self.version for first, _ in spans)
            batch = self.learn(batch, prompts, timer, metrics)
            if self.step > self.cfg.trainer.critic_warmup:  # the policy was updated
                with timer("sync"):
                    metrics.update(self.policy.sync_weights())
                self.version += 1
        return self.step_metrics(batch, timer, metrics)

    def submit(self, rows: list[int], replicas: list[int] | None = None) -> None:
        """One group per dataset row on the streams, tagged with this step: ``replicas[i]`` holds row i's group
        (default: consecutive equal shares, as the batch's rows are split)."""
        keys, chosen = self.streams.add(rows, self.step, replicas)
        self.policy.stream_submit([self.prompts_of(r) for r in chosen], keys)

    def finished_groups(self) -> tuple[list[list[int]], int]:
        """Each replica's share of the groups to train, tagged earliest first; and how many stale groups were
        dropped (and replaced) meanwhile."""
        share, evicted = self.batch_size // self.replicas, 0
        while True:
            wait_for = [[key for key, group in self.streams.groups.items()
                         if group.replica == r and self.age(group.tag) >= self.threshold]
                        if self.strategy == "wait" else [] for r in range(self.replicas)]
            finished = self.policy.stream_run([share] * self.replicas, self.version, wait_for)
            stale = [[key for key in keys if self.age(self.streams[key].tag) > self.threshold] for keys in finished]
            if self.strategy != "drop" or not any(stale):
                break
            self.policy.stream_drop(stale)
            self.streams.pop(stale)
            refill = [key for keys in stale for key in keys]
            evicted += len(refill)
            while len(self.pending) < len(refill):
                self.pending.extend(self.sampler.next_batch())
            rows = [self.pending.popleft() for _ in refill]
            self.submit(rows, [replica for replica, keys in enumerate(stale) for _ in keys])
        for replica, keys in enumerate(finished):
            if len(keys) < share:
                raise RuntimeError(f"replica {replica}'s stream stopped with {len(keys)} finished groups of the "
                                   f"{share} it owes the step")
        return [sorted(keys, key=lambda k: (self.streams[k].tag, k))[:share] for keys in finished], evicted

    def take(self, keys: list[list[int]]) -> tuple[Batch, Batch]:
        """The groups ``keys`` (per replica) as one batch, replica after replica, and their prompts."""
        rows = self.streams.pop(keys)
        parts = self.policy.stream_take([self.prompts_of(r) for r in rows], keys)
        prompts = prompts_batch(self.train_data, [row for replica_rows in rows for row in replica_rows],
                                raw_chat=self.raw_chat)
        batch = Batch.concat(parts)
        n = len(batch) // len(prompts)
        batch.set("uid", torch.arange(len(prompts)).repeat_interleave(n))
        if "raw_prompt" in prompts:
            batch.set("raw_prompt", prompts["raw_prompt"][batch["uid"].numpy()])
        return batch, prompts

    def age(self, tag: int) -> int:
        """verl's span of a group tagged at step ``tag``, at this step."""
        return self.step - tag + 1

    def sync_after_update(self) -> bool:
        return False  # train_step syncs after the step, as verl's on_step_end

    def alarm_applies(self) -> bool:
        return self.fresh

    # ------------------------------------------------------------------------------- checkpoints
    def driver_state(self) -> dict[str, Any]:
        state = super().driver_state()
        state[self.STATE_KEY] = {"prompts": [group.row for group in self.streams.groups.values()] + list(self.pending),
                            "version": self.version}
        return state

    def restore_trainer_state(self, state: dict[str, Any], path) -> None:
        saved = state[self.STATE_KEY]  # a checkpoint of this trainer (early_checks.resume_checkpoint)
        self.pending = deque(saved["prompts"])
        self.version = int(saved["version"])
