"""The training engine every trained role shares (policy, critic; a reward model or LoRA adapters next).

One RL step's update of a role, given its mini-batches (each a DP shard with the mini-batch's global
normaliser ``GlobalNorm``, from ``meshrl.trainer.rl_trainer.mini_batches``)::

    for (shard, norm) in mini-batches:                 one optimizer step each
        micro-batches ← split(shard)                   token budget or count; the same count on every DP rank
        loss ← Σ_k loss_fn(outputs_k, micro_k, norm)   each share already divided by the mini-batch's normaliser
        clip, step                                     unless the loss or the gradient norm is NaN / inf
        metrics ← Σ over micro-batches, all-reduced over DP ranks (exact mini-batch values)
    schedule.advance()                                 once per RL step, as verl: every mini-batch uses lr(step)

and the forward-only passes (log-probs, values): split → forward → the response columns, in row order.

Non-finite numbers (``NonFinitePolicy``, from ``trainer.on_nonfinite_loss`` / ``on_nonfinite_grad_norm``):

    source            skip                                            stop
    loss              update not applied; <role>/nonfinite_losses     raise before backward (the default)
                      and <role>/skipped_updates count it
    gradient norm     update not applied (the default); counted in    raise, weights and optimizer state
                      <role>/skipped_updates                          as they were

Either way the message names the role, the number and what to check (``hint``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from meshrl.collectives import collective_device
from meshrl.config.micro_batching import MicroBatching
from meshrl.config.schema import NONFINITE_ACTIONS
from meshrl.parallel.router_replay import ROUTES
from meshrl.protocol import Batch
from meshrl.workers.objectives import sum_metrics
from meshrl.workers.routes import attach_routes
from meshrl.workers.sequences import gather_response_outputs, response_part, split_micro_batches

# Key of a micro-batch's position in its mini-batch, for loss functions that hand outputs back.
MICRO_INDEX = "micro_index"

RoleLoss = Callable[[dict[str, torch.Tensor], dict[str, Any], Any], tuple[torch.Tensor, dict[str, Any]]]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NonFinitePolicy:
    """What an update with a NaN / inf loss or gradient norm does: ``skip`` or ``stop`` (module docstring)."""

    loss: str
    grad_norm: str

    def __post_init__(self) -> None:
        for source, action in (("trainer.on_nonfinite_loss", self.loss),
                               ("trainer.on_nonfinite_grad_norm", self.grad_norm)):
            if action not in NONFINITE_ACTIONS:
                raise ValueError(f"{source}={action!r} is not one of {', '.join(NONFINITE_ACTIONS)}")

    @classmethod
    def from_settings(cls, workers) -> NonFinitePolicy:
        """From the run plan's ``WorkerSettings`` (``trainer.on_nonfinite_loss`` / ``on_nonfinite_grad_norm``)."""
        return cls(loss=workers.nonfinite_loss, grad_norm=workers.nonfinite_grad_norm)


@dataclass
class MiniBatchSplit:
    """How one DP shard of a mini-batch was cut: the plan, each micro-batch's rows, the micro-batch dicts."""

    plan: Any
    rows: list[Batch]
    micros: list[dict[str, Any]]

    def gather(self, parts: list[torch.Tensor], width: int) -> torch.Tensor:
        """Per-micro-batch response outputs → (B, width) in the shard's row order."""
        return gather_response_outputs(parts, self.plan, self.rows, width)


@dataclass
class TrainingEngine:
    """A model's chunks with their optimizer and LR schedule, trained and evaluated on RL batches."""

    role: str  # "actor" | "critic": metric prefix and error messages
    chunks: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    pad_id: int
    min_micro: int  # micro-batches per step at least (a pipeline needs one per stage)
    nonfinite: NonFinitePolicy
    hint: str = ""  # what to check when the loss or the gradient norm is not finite

    def split(self, shard: Batch, batching: MicroBatching, response_fields: tuple[str, ...] = (),
              shared_prompts: bool = False) -> MiniBatchSplit:
        from meshrl.parallel import state

        plan, rows, micros = split_micro_batches(shard, batching, state.dp_group(), self.pad_id,
                                                 response_fields=response_fields, min_micro=self.min_micro,
                                                 shared_prompts=shared_prompts)
        for index, micro in enumerate(micros):
            micro[MICRO_INDEX] = index
        if ROUTES in shard:  # router replay: the recorded experts go with their tokens
            attach_routes(shard, micros, rows)
        return MiniBatchSplit(plan, rows, micros)

    def forward(self, shard: Batch, batching: MicroBatching, request, output: str, width: int,
                chunks: list[torch.nn.Module] | None = None,
                on_split: Callable[[MiniBatchSplit], None] | None = None) -> torch.Tensor:
        """Forward-only ``output`` (``log_probs`` / ``values``) of the shard's responses, (B, ``width``: the
        run's response width), row order; ``chunks`` runs another model on the same split (the reference);
        ``on_split`` is given the split after the pass (what was recorded during it is per micro-batch)."""
        return self.forward_outputs(shard, batching, request, (output,), width, chunks, on_split)[output]

    def forward_outputs(self, shard: Batch, batching: MicroBatching, request, outputs: tuple[str, ...], width: int,
                        chunks: list[torch.nn.Module] | None = None,
                        on_split: Callable[[MiniBatchSplit], None] | None = None) -> dict[str, torch.Tensor]:
        """:meth:`forward` of several outputs of one pass (``log_probs`` and ``sum_pi_squared``), by name."""
        from meshrl.parallel.schedule import forward_only

        split = self.split(shard, batching, shared_prompts=request.shared_prompts)
        results = forward_only(chunks if chunks is not None else self.chunks, split.micros, request)
        if on_split is not None:
            on_split(split)
        return {name: split.gather([response_part(r[name], m) for r, m in zip(results, split.micros)], width)
                for name in outputs}

    def train(self, updates: list[tuple[Batch, Any]], batching: MicroBatching, request, loss_fn: RoleLoss,
              response_fields: tuple[str, ...]) -> tuple[dict[str, float], list[MiniBatchSplit]]:
        """One optimizer step per (shard, norm) in ``updates``, then one schedule step; (metrics averaged
        over the optimizer steps, plus ``<role>/optimizer_steps``, ``<role>/skipped_updates`` and
        ``<role>/nonfinite_losses`` (counts over them); each shard's split).

        Raises:
            FloatingPointError: a non-finite loss or gradient norm whose policy is ``stop``.
        """
        import torch.distributed as dist

        from meshrl.parallel import state
        from meshrl.parallel.optimizer import advance_schedule, train_step

        per_step, splits = [], []
        skipped = nonfinite_losses = 0
        for shard, norm in updates:
            split = self.split(shard, batching, response_fields, shared_prompts=request.shared_prompts)

            def checked_loss(outputs, micro, norm=norm):
                loss, metrics = loss_fn(outputs, micro, norm)
                if self.nonfinite.loss == "stop" and not torch.isfinite(loss):
                    # Raised before backward: the optimizer never sees the NaN and the weights stay intact.
                    raise FloatingPointError(
                        f"{self.role} loss is {loss.item()} (metrics: { {k: float(v) for k, v in metrics.items()} }); "
                        f"nothing was applied (trainer.on_nonfinite_loss=stop). {self.hint}")
                return loss, metrics

            result = train_step(self.chunks, self.optimizer, None, split.micros, checked_loss, request)
            if not result["update_successful"]:
                bad_loss = not math.isfinite(result["loss"])
                self._skip_or_stop(result, bad_loss)
                skipped += 1
                nonfinite_losses += bad_loss
            shares = sum_metrics(result["metrics"])
            # Metric shares of this DP rank's micro-batches add up to the mini-batch value over ranks.
            values = torch.tensor(list(shares.values()), dtype=torch.float64,
                                  device=collective_device(state.dp_group()))
            dist.all_reduce(values, group=state.dp_group())
            metrics = dict(zip(shares, values.tolist()))
            grad_norm = result["grad_norm"] if result["grad_norm"] is not None else float("nan")
            metrics.update({f"{self.role}/loss": result["loss"], f"{self.role}/lr": result["lr"],
                            f"{self.role}/grad_norm": grad_norm})
            # The actor's micro-batching keeps verl's metric names; other roles' carry their role.
            metrics.update(split.plan.metrics("dynamic_batch/" if self.role == "actor"
                                              else f"{self.role}/dynamic_batch/"))
            per_step.append(metrics)
            splits.append(split)
        advance_schedule(self.scheduler)
        mean = {key: float(np.mean([m[key] for m in per_step])) for key in per_step[0]}
        # epochs × mini-batches: shows that the role's own ppo_epochs / ppo_mini_batch_size took effect
        mean[f"{self.role}/optimizer_steps"] = float(len(per_step))
        mean[f"{self.role}/skipped_updates"] = float(skipped)
        mean[f"{self.role}/nonfinite_losses"] = float(nonfinite_losses)
        return mean, splits

    def _skip_or_stop(self, result: dict[str, Any], bad_loss: bool) -> None:
        """An update that was not applied: raise if its policy says stop, else warn once, from rank 0 (every
        rank agrees: the global loss and the gradient norm are the same numbers on all of them)."""
        if bad_loss:
            what = f"loss is {result['loss']} (trainer.on_nonfinite_loss=skip)"
        else:
            what = f"gradient norm is {result['grad_norm']} (loss {result['loss']:.6g})"
            if self.nonfinite.grad_norm == "stop":
                raise FloatingPointError(
                    f"{self.role} {what}; the update was not applied, the weights are as before the step "
                    f"(trainer.on_nonfinite_grad_norm=stop). {self.hint}")
            what += " (trainer.on_nonfinite_grad_norm=skip)"
        if torch.distributed.get_rank() == 0:
            logger.warning("%s update skipped: %s; counted in %s/skipped_updates. %s", self.role, what, self.role,
                           self.hint)
