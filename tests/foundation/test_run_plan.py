"""The run plan: roles, method names, widths and update schedules decided once, at config time."""

import numpy as np
import pytest
import torch

from meshrl.config import ConfigError, load_config
from meshrl.config.run_plan import build_run_plan
from meshrl.config.validate import validate_config
from meshrl.protocol import Batch
from meshrl.rollout.base import Completion
from meshrl.trainer.rl_trainer import mini_batches
from meshrl.workers.sequences import responses_batch


def plan_of(*overrides, recipe="cpu_tiny_grpo"):
    return validate_config(load_config(list(overrides), recipe=recipe))


@pytest.mark.parametrize("overrides, roles", [
    ((), ("policy", "rollout")),
    (("algorithm.adv_estimator=gae",), ("policy", "rollout", "critic")),
    (("algorithm.adv_estimator=remax",), ("policy", "rollout", "greedy_baseline")),
    (("actor_rollout_ref.actor.use_kl_loss=True",), ("policy", "rollout", "reference")),
    (("algorithm.use_kl_in_reward=True", "algorithm.adv_estimator=gae"), ("policy", "rollout", "reference", "critic")),
])
def test_roles_follow_the_estimator_and_kl(overrides, roles):
    assert plan_of(*overrides).roles == roles


def test_a_users_estimator_gets_the_roles_its_signature_asks_for():
    # meshrl's own GAE, named as a user's module:function: the critic comes with it
    plan = plan_of("algorithm.adv_estimator=meshrl.algorithms.advantages:gae")
    assert plan.use_critic and not plan.greedy_baseline


@pytest.mark.parametrize("override, key, suggestion", [
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator", "'grpo'"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=vanila", "policy_loss.loss_mode", "'vanilla'"),
    ("algorithm.kl_penalty=low_var_kll", "algorithm.kl_penalty", "'low_var_kl'"),
    ("actor_rollout_ref.actor.kl_loss_type=k33", "actor_rollout_ref.actor.kl_loss_type", "'k3'"),
    ("actor_rollout_ref.actor.loss_agg_mode=token_mean", "actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
])
def test_method_name_typos_fail_at_config_time(override, key, suggestion):
    with pytest.raises(ConfigError) as info:
        plan_of(override)
    assert key in str(info.value) and suggestion in str(info.value)


def test_an_estimator_needing_inputs_meshrl_cannot_give_is_refused(tmp_path, monkeypatch):
    (tmp_path / "my_estimators.py").write_text(
        "def needs_oracle(token_rewards, response_mask, *, oracle):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="needs oracle"):
        plan_of("algorithm.adv_estimator=my_estimators:needs_oracle")


@pytest.mark.parametrize("overrides, key", [
    # context parallelism splits packed sequences (it runs: tests/parallel/test_parallel_multiproc.py, cp2 phases)
    (("actor_rollout_ref.actor.megatron.context_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=False"),
     "actor_rollout_ref.model.use_remove_padding"),
    (("algorithm.adv_estimator=gae", "critic.megatron.context_parallel_size=2",
      "critic.model.use_remove_padding=False"), "critic.model.use_remove_padding"),
    # 3 x 1 does not divide the 2 training processes
    (("actor_rollout_ref.actor.megatron.context_parallel_size=3",), "TP×PP×CP = 3 must divide"),
    # experts over 3 of the 2 training processes (expert parallelism itself runs: tests/e2e/test_moe_e2e.py)
    (("actor_rollout_ref.actor.megatron.expert_model_parallel_size=3",), "expert_model_parallel_size"),
])
def test_unsupported_parallel_sizes_fail_at_config_time(overrides, key):
    with pytest.raises(ConfigError, match=key):
        plan_of(*overrides, "trainer.n_gpus_per_node=2")


def test_context_parallelism_is_planned_with_packed_sequences():
    plan = plan_of("actor_rollout_ref.actor.megatron.context_parallel_size=2", "trainer.n_gpus_per_node=4")
    assert plan.actor_layout.context == 2


def test_training_temperature_zero_is_refused():
    with pytest.raises(ConfigError, match="rollout.temperature"):
        plan_of("actor_rollout_ref.rollout.temperature=0")


def test_one_response_width_for_every_role():
    """rollout.response_length (verl's rollout width) is every role's width; set apart from
    data.max_response_length it wins, with a start-up note naming both keys."""
    assert plan_of("data.max_response_length=24").response_length == 24
    plan = plan_of("algorithm.adv_estimator=gae", "data.max_response_length=32",
                   "actor_rollout_ref.rollout.response_length=16")
    assert plan.response_length == 16 and plan.prompt_length > 0
    assert any("rollout.response_length=16" in w and "data.max_response_length=32" in w for w in plan.warnings)


def _batch(rows: int, width: int = 6) -> Batch:
    lengths = torch.arange(rows) % width + 1
    mask = (torch.arange(width) < lengths[:, None]).float()
    return Batch(tensors={"response_mask": mask, "row": torch.arange(rows)},
                 non_tensors={"prompt_ids": [[1]] * rows})


def test_the_critic_has_its_own_mini_batches_epochs_and_shuffle():
    """critic.ppo_mini_batch_size / ppo_epochs / shuffle are the critic's (verl's keys, default: the actor's)."""
    plan = plan_of("algorithm.adv_estimator=gae", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=1",
                   "critic.ppo_mini_batch_size=1", "critic.ppo_epochs=3", "critic.shuffle=True")
    assert (plan.actor_update.mini_batch_responses, plan.actor_update.epochs,
            plan.actor_update.shuffle) == (8, 1, False)
    assert (plan.critic_update.mini_batch_responses, plan.critic_update.epochs,
            plan.critic_update.shuffle) == (2, 3, True)
    batch = _batch(8)
    actor = mini_batches(batch, plan.actor_update, seed=[1, 1])
    critic = mini_batches(batch, plan.critic_update, seed=[1, 1], stream=1)
    assert [len(m) for m, _ in actor] == [8]
    assert [len(m) for m, _ in critic] == [2] * 12
    epochs = [np.concatenate([m["row"].numpy() for m, _ in critic[e * 4:(e + 1) * 4]]) for e in range(3)]
    assert all(sorted(e) == list(range(8)) for e in epochs)  # every epoch sees every response once
    assert any(list(e) != list(range(8)) for e in epochs)  # shuffled
    assert all(norm.max_len == plan.response_length for _, norm in critic)
    inherited = plan_of("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_epochs=2",
                        "actor_rollout_ref.actor.shuffle=True")
    assert inherited.critic_update == inherited.actor_update


def test_loss_scale_factor_is_seq_mean_token_sum_norms_divisor_for_each_role():
    """verl's loss_scale_factor: L_max of seq-mean-token-sum-norm (None: the response width); the critic's follows
    the actor's unless set."""
    width = plan_of().response_length
    assert plan_of().actor_update.loss_scale == width
    plan = plan_of("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.loss_scale_factor=4096")
    assert plan.actor_update.loss_scale == plan.critic_update.loss_scale == 4096
    plan = plan_of("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.loss_scale_factor=4096",
                   "critic.loss_scale_factor=100")
    assert (plan.actor_update.loss_scale, plan.critic_update.loss_scale) == (4096, 100)
    assert all(norm.max_len == 100 for _, norm in mini_batches(_batch(8), plan.critic_update, seed=[1, 1]))


def test_completions_land_in_their_rows_whatever_the_engine_order():
    prompts = Batch(tensors={"uid": torch.arange(2)}, non_tensors={"prompt_ids": [[5], [6, 7]]})
    completions = [Completion(p, s, [10 + 2 * p + s] * (1 + p + s), [-0.5] * (1 + p + s), reason)
                   for p, s, reason in ((1, 1, "length"), (0, 0, "stop"), (1, 0, "stop"), (0, 1, "length"))]
    out = responses_batch(prompts, completions, n=2, width=4, pad_id=0)
    assert list(out["finish_reason"]) == ["stop", "length", "stop", "length"]
    assert out["responses"][:, 0].tolist() == [10, 11, 12, 13]
    assert out["response_mask"].sum(-1).tolist() == [1, 2, 2, 3]
    assert out["uid"].tolist() == [0, 0, 1, 1]


def test_build_run_plan_raises_what_validate_lists():
    with pytest.raises(ConfigError, match="grpoo"):
        build_run_plan(load_config(["algorithm.adv_estimator=grpoo"], recipe="cpu_tiny_grpo"))


def test_every_field_of_the_run_plan_is_read_by_the_code_it_decides_for():
    """A decision the run plan names is taken once and read from it: each field of ``RunPlan`` (and of its
    ``WorkerSettings``) is read as ``plan.<field>`` / ``run.<field>`` (``workers.<field>``) somewhere in ``meshrl/``
    outside the module that builds it; a field nobody reads is a decision taken again elsewhere, or dead."""
    import dataclasses
    import re
    from pathlib import Path

    from meshrl.config.run_plan import RunPlan, WorkerSettings

    package = Path(__file__).resolve().parents[2] / "meshrl"
    sources = "\n".join(p.read_text() for p in package.rglob("*.py") if p.name != "run_plan.py")
    read = {cls: set(re.findall(rf"\b{owner}\.(\w+)", sources))
            for cls, owner in ((RunPlan, "(?:plan|run)"), (WorkerSettings, "(?:workers|settings)"))}
    unread = [f"{cls.__name__}.{f.name}" for cls, names in read.items() for f in dataclasses.fields(cls)
              if f.name not in names]
    assert not unread, f"run plan fields no code reads: {unread}"
