"""TrainingEngine's policy for non-finite numbers (``trainer.on_nonfinite_loss`` / ``on_nonfinite_grad_norm``),
in process at TP1 on the tiny Llama: NaN advantages give a NaN loss, advantages of 1e30 a finite loss whose
gradient norm overflows. ``skip`` leaves the weights as they were and counts the update; ``stop`` raises a
message naming the role and the number, with the weights as they were."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algorithms import GlobalNorm
from meshrl.config.micro_batching import MicroBatching
from meshrl.parallel import state
from meshrl.parallel.forward import OutputRequest
from meshrl.protocol import Batch
from meshrl.workers.engine import NonFinitePolicy, TrainingEngine
from meshrl.workers.sequences import response_part

WIDTH = 8
HINT = "check the rewards and advantages"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from transformers import AutoConfig

    from meshrl.parallel.hf_conversion import load_hf_weights
    from meshrl.parallel.model_builder import build_model
    from meshrl.parallel.optimizer import OptimizerConfig, build_optimizer

    state.initialize(state.ParallelConfig())
    chunks = build_model(AutoConfig.from_pretrained(tiny_llama_dir))
    load_hf_weights(chunks, tiny_llama_dir)
    optimizer, scheduler = build_optimizer(chunks, OptimizerConfig(lr=1e-3))
    yield TrainingEngine("actor", chunks, optimizer, scheduler, pad_id=0, min_micro=1,
                         nonfinite=NonFinitePolicy(loss="stop", grad_norm="skip"), hint=HINT)
    state.destroy()


def shard(advantage: float, rows: int = 4) -> tuple[Batch, GlobalNorm]:
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(WIDTH) < torch.randint(2, WIDTH + 1, (rows, 1), generator=g)).float()
    batch = Batch(tensors={"responses": torch.randint(10, 5000, (rows, WIDTH), generator=g), "response_mask": mask,
                           "advantages": torch.full((rows, WIDTH), advantage) * mask},
                  non_tensors={"prompt_ids": [list(range(10, 15))] * rows})
    return batch, GlobalNorm.from_mask(mask, max_len=WIDTH)


def loss_fn(outputs, micro, norm):
    log_probs = response_part(outputs["log_probs"], micro)
    # 0·NaN is NaN: NaN advantages make the loss NaN even where the mask is 0
    loss = -(log_probs * micro["advantages"]).sum() / norm.num_tokens
    return loss, {"actor/pg_loss": loss.detach()}


def train(engine: TrainingEngine, *advantages: float, loss: str = "stop", grad_norm: str = "skip") -> dict:
    engine.nonfinite = NonFinitePolicy(loss=loss, grad_norm=grad_norm)
    metrics, _ = engine.train([shard(a) for a in advantages], MicroBatching(max_token_len=64),
                              OutputRequest(log_probs=True), loss_fn, ("advantages",))
    return metrics


def weights(engine: TrainingEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in engine.chunks for p in chunk.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_nonfinite_loss_stops_with_nothing_applied(engine) -> None:
    before = weights(engine)
    with pytest.raises(FloatingPointError, match=r"actor loss is nan .*trainer.on_nonfinite_loss=stop.*" + HINT):
        train(engine, float("nan"))
    assert same(before, weights(engine))


def test_a_nonfinite_loss_is_skipped_and_counted_when_asked(engine) -> None:
    before = weights(engine)
    metrics = train(engine, float("nan"), loss="skip")
    assert metrics["actor/skipped_updates"] == 1 and metrics["actor/nonfinite_losses"] == 1
    assert same(before, weights(engine))


def test_a_nonfinite_gradient_norm_is_skipped_and_counted(engine) -> None:
    before = weights(engine)
    metrics = train(engine, 1e30, 1.0)  # the first update's norm overflows, the second applies
    assert metrics["actor/optimizer_steps"] == 2 and metrics["actor/skipped_updates"] == 1
    assert metrics["actor/nonfinite_losses"] == 0 and math.isfinite(metrics["actor/loss"])
    after = weights(engine)
    assert not same(before, after) and all(torch.isfinite(w).all() for w in after)


def test_a_nonfinite_gradient_norm_stops_when_asked(engine) -> None:
    before = weights(engine)
    with pytest.raises(FloatingPointError, match=r"actor gradient norm is (inf|nan) .*the update was not applied.*"
                                                 r"trainer.on_nonfinite_grad_norm=stop.*" + HINT):
        train(engine, 1e30, grad_norm="stop")
    assert same(before, weights(engine))


def test_an_unknown_action_is_refused() -> None:
    with pytest.raises(ValueError, match="trainer.on_nonfinite_loss='ignore' is not one of skip, stop"):
        NonFinitePolicy(loss="ignore", grad_norm="skip")
