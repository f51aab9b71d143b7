"""Which trainer a config asks for: one table, read by the entry (``meshrl.trainer.main``) and the tests.

- verl V1's ``colocate_async`` (``trainer.use_v1=True``, ``trainer.v1.trainer_mode=colocate_async``):
  ``meshrl.trainer.colocate_async_trainer``;
- verl's one-step-off and fully async trainers (``trainer.async_mode``, which their config names set):
  ``meshrl.trainer.async_trainer``;
- otherwise the synchronous trainer (verl's V0 and V1 ``sync``): ``meshrl.trainer.rl_trainer``.

And the ``data`` stage's rule on the asynchronous trainers' rollout budget (here, beside the choice it depends on).
"""

from __future__ import annotations

from meshrl.config.async_keys import colocate_async
from meshrl.config.refusals import Checked, refusal
from meshrl.trainer.async_trainer import AsyncRLTrainer
from meshrl.trainer.colocate_async_trainer import ColocateAsyncTrainer
from meshrl.trainer.rl_trainer import RLTrainer, total_training_steps
from meshrl.trainer.sample_queue import staleness_budget


def trainer_class(cfg) -> type[RLTrainer]:
    if colocate_async(cfg):
        return ColocateAsyncTrainer
    return AsyncRLTrainer if cfg.trainer.async_mode else RLTrainer


@refusal("data", "trainer.total_training_steps", "rollout.total_rollout_steps")
def rollout_budget(c: Checked) -> list[str]:
    """The fully async and one-step-off trainers' steps × prompts per step must not exceed the prompts their
    rollouter starts (``rollout.total_rollout_steps``, at most the training set × ``trainer.total_epochs``)."""
    cfg = c.cfg
    if not issubclass(trainer_class(cfg), AsyncRLTrainer):
        return []
    budget, steps = staleness_budget(cfg, len(c.train_data)), total_training_steps(cfg, len(c.train_data))
    total, needed = budget.total_rollout_steps, steps * budget.required_samples
    if total is None or needed <= total:
        return []
    return [f"trainer.total_training_steps: {steps} steps of {budget.required_samples} prompts "
            f"(actor.ppo_mini_batch_size x async_training.require_batches) need {needed} prompts, and the rollouter "
            f"starts {total} (rollout.total_rollout_steps, at most the training set x trainer.total_epochs): raise "
            "those or lower trainer.total_training_steps"]
