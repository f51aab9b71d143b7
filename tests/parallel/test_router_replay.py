"""Router replay's pieces that need no model (``meshrl.parallel.router_replay``, ``meshrl.workers.routes``) and its
config keys. The replay against HF's router forced to the same experts (outputs, loss, gradients, with and without
activation recompute, at EP / TP / PP layouts) is ``moe_worker.check_replay`` (``test_moe_parallel``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_against_model, validate_config
from meshrl.parallel.forward import trim_rows
from meshrl.parallel.router_replay import (NATIVE, ROUTES, LayerRouting, _MicroRouting, from_router_order,
                                          to_router_order)


def _padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[1, 5:] = 0  # right padding
    mask[2, 3] = 0  # a hole (a tool turn's padding)
    return ids, mask


def test_routes_follow_the_tokens_into_megatrons_order_and_back() -> None:
    """megatron's MoE layer flattens its ``[n, r, h]`` input to tokens sequence-major; a token's route must sit where
    its id sits when the model input is flattened so (the ids themselves are the routes here)."""
    ids, mask = _padded_batch()
    inputs = trim_rows(ids, mask)
    routes = ids[:, :, None, None].expand(-1, -1, 2, 3).clone()
    ordered = to_router_order(routes, inputs)
    as_megatron = inputs.input_ids.transpose(0, 1).reshape(-1)  # the model's [r, n] input as the router sees it
    valid = torch.zeros(inputs.input_ids.numel(), dtype=torch.bool)
    valid[inputs.packed_index] = True
    valid = valid.view(inputs.input_ids.shape).transpose(0, 1).reshape(-1)
    assert torch.equal(ordered[valid, 1, 2], as_megatron[valid])
    assert (ordered[~valid] == NATIVE).all()
    back = from_router_order(ordered[:, 1], inputs)
    assert torch.equal(back[mask.bool()], routes[:, :, 1][mask.bool()])
    assert (back[~mask.bool()] == NATIVE).all()


def _layer(training: bool = False) -> LayerRouting:
    router = SimpleNamespace(layer_number=2, training=training, tp_cp_group=None)
    return LayerRouting(router)


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_replay_forces_the_recorded_experts_and_gathers_this_passs_scores() -> None:
    layer = _layer()
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.2, 0.3], [0.25, 0.25, 0.3, 0.2]])
    targets = torch.full((3, 2, 2), NATIVE)
    targets[0, 1] = torch.tensor([3, 0])  # layer index 1 (megatron's layer_number 2)
    targets[2, 1] = torch.tensor([2, 1])  # the native choice: replayed, not changed
    layer.micro = _MicroRouting(tokens=3, targets=targets, recorded=None)
    probs, indices = layer.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert indices.tolist() == [[3, 0], [0, 3], [2, 1]]
    assert torch.equal(probs, scores.gather(1, indices))
    assert (layer.replayed, layer.changed) == (2, 1)


def test_a_recomputed_forward_replays_what_its_checkpointed_forward_replayed() -> None:
    """Inside an activation checkpoint the training forward runs without autograd; the backward's recompute runs
    outside the schedule's forward step, and must get the same experts, in order."""
    layer = _layer(training=True)
    scores = torch.rand(4, 6, generator=torch.Generator().manual_seed(0))
    first, second = (torch.randint(0, 6, (4, 2, 2), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    for targets in (first, second):
        targets[..., 1] = (targets[..., 0] + 1) % 6  # distinct experts
        layer.micro = _MicroRouting(tokens=4, targets=targets, recorded=None)
        with torch.no_grad():
            layer.get_replay_topk(scores, 2, default_compute_topk=_topk)
    layer.micro = None
    for targets in (first, second):
        _, indices = layer.get_replay_topk(scores, 2, default_compute_topk=_topk)
        assert torch.equal(indices, targets[:, 1])
    _, indices = layer.get_replay_topk(scores, 2, default_compute_topk=_topk)  # nothing queued: native
    assert torch.equal(indices, scores.topk(2, dim=1).indices)


def test_routes_reach_each_micro_batch_token_and_come_back_in_row_order() -> None:
    """The batch's routes (here each token's own id, so a misplaced one shows) land on the micro-batches' tokens,
    whatever their prompt padding and order, and routes recorded per micro-batch return to the batch's rows."""
    from meshrl.config.micro_batching import MicroBatching
    from meshrl.protocol import Batch
    from meshrl.workers.engine import MiniBatchSplit
    from meshrl.workers.routes import attach_routes, routes_in_row_order
    from meshrl.workers.sequences import split_micro_batches

    g = torch.Generator().manual_seed(0)
    prompt_width, width, pad = 6, 5, 0
    prompts = [torch.randint(1, 30000, (n,), generator=g).tolist() for n in (3, 6, 1, 4, 2)]
    lengths = [5, 2, 4, 1, 3]
    responses = torch.full((5, width), pad)
    mask = torch.zeros(5, width)
    routes = torch.full((5, prompt_width + width, 2, 3), NATIVE, dtype=torch.int16)
    for row, (prompt, n) in enumerate(zip(prompts, lengths)):
        responses[row, :n] = torch.randint(1, 30000, (n,), generator=g)
        mask[row, :n] = 1
        routes[row, prompt_width - len(prompt):prompt_width] = torch.tensor(prompt)[:, None, None]
        routes[row, prompt_width:prompt_width + n] = responses[row, :n, None, None]
    batch = Batch(tensors={"responses": responses, "response_mask": mask, ROUTES: routes},
                  non_tensors={"prompt_ids": prompts})
    plan_, rows, micros = split_micro_batches(batch, MicroBatching(max_token_len=12), None, pad)
    assert len(micros) > 1
    attach_routes(batch, micros, rows)
    for micro in micros:
        tokens = micro["attention_mask"].bool()
        assert torch.equal(micro[ROUTES][..., 1, 2][tokens], micro["input_ids"][tokens])
        assert (micro[ROUTES][~tokens] == NATIVE).all()
    back = routes_in_row_order([micro[ROUTES] for micro in micros], MiniBatchSplit(plan_, rows, micros),
                               prompt_width, width)
    assert torch.equal(back, routes)


MOE = ["actor_rollout_ref.model.path=tiny:qwen2_moe"]


def test_r2_is_honoured_on_an_moe_model_and_refused_on_a_dense_one() -> None:
    from meshrl.models.tiny import tiny_config, tiny_spec

    cfg = load_config([*MOE, "actor_rollout_ref.actor.megatron.router_replay.mode=R2"], recipe="cpu_tiny_grpo")
    plan = validate_config(cfg)
    validate_against_model(cfg, plan, tiny_config(tiny_spec("qwen2_moe")))
    with pytest.raises(ConfigError, match="router_replay.mode: R2 replays expert routing, but qwen2 is dense"):
        validate_against_model(cfg, plan, tiny_config(tiny_spec("qwen2")))


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.actor.megatron.router_replay.mode=R3"], "Model Runner V2 only, which requires Triton"),
    (["actor_rollout_ref.rollout.enable_rollout_routing_replay=True"], "Model Runner V2 only, which requires Triton"),
    (["actor_rollout_ref.actor.megatron.router_replay.mode=R2",
      "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"], "verl refuses both at once"),
    (["actor_rollout_ref.actor.megatron.router_replay.mode=R1"], "'R1' is not one of disabled, R2, R3"),
    (["actor_rollout_ref.ref.megatron.router_replay.mode=R2"], "the reference routes natively in verl too"),
    (["actor_rollout_ref.actor.megatron.router_replay.record_file=/tmp/routes.pt"], "verl reads neither"),
])
def test_router_replay_settings_meshrl_cannot_honour_are_refused(overrides: list[str], message: str) -> None:
    cfg = load_config([*MOE, *overrides], recipe="cpu_tiny_grpo")
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)
