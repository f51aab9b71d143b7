"""Actor/critic objectives: micro-batch losses and metrics add up to the mini-batch's, for any split."""

import pytest
import torch

from meshrl.algorithms import POLICY_LOSSES, GlobalNorm, aggregate_loss
from meshrl.config import load_config
from meshrl.config.run_plan import build_run_plan
from meshrl.workers.objectives import ActorObjective, CriticObjective, sum_metrics


def mini_batch(b=7, r=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    mask = (torch.arange(r) < lengths[:, None]).float()
    return {
        "response_mask": mask,
        "old_log_probs": -torch.rand(b, r, generator=g),
        "ref_log_probs": -torch.rand(b, r, generator=g),
        "advantages": torch.randn(b, r, generator=g),
        "values": torch.randn(b, r, generator=g),
        "returns": torch.randn(b, r, generator=g),
    }, -torch.rand(b, r, generator=g), torch.rand(b, r, generator=g)


def take(mb, idx):
    return {k: v[idx] for k, v in mb.items()}


@pytest.mark.parametrize("overrides", [
    ["actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.entropy_coeff=0.01",
     "actor_rollout_ref.actor.use_kl_loss=True"],
    ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
    ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
     "actor_rollout_ref.actor.policy_loss.loss_mode=gpg"],
    ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
    ["actor_rollout_ref.actor.loss_agg_mode=token-sum", "actor_rollout_ref.actor.entropy_coeff=0.01",
     "actor_rollout_ref.actor.use_kl_loss=True"],
    ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo"],
    ["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"],
    ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv",
     "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum"],
])
def test_actor_objective_is_split_invariant(overrides):
    cfg = load_config(overrides)
    objective = ActorObjective.from_config(cfg.actor_rollout_ref.actor, build_run_plan(cfg))
    mb, log_probs, entropy = mini_batch()
    norm = GlobalNorm.from_mask(mb["response_mask"])

    def total(splits):
        lp = log_probs.clone().requires_grad_(True)
        losses, metrics = [], []
        for idx in splits:
            loss, m = objective(lp[idx], entropy[idx] if objective.needs_entropy else None, take(mb, idx), norm)
            losses.append(loss)
            metrics.append(m)
        loss = torch.stack(losses).sum()
        loss.backward()
        return loss.detach(), lp.grad, sum_metrics(metrics)

    whole = total([torch.arange(7)])
    split = total([torch.tensor([3]), torch.tensor([0, 6, 1]), torch.tensor([2, 4, 5])])
    assert torch.allclose(whole[0], split[0], atol=1e-6)
    assert torch.allclose(whole[1], split[1], atol=1e-7)
    for key in whole[2]:
        assert whole[2][key] == pytest.approx(split[2][key], abs=1e-6), key


@pytest.mark.parametrize("overrides, options", [
    (["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_pos=2.0",
      "actor_rollout_ref.actor.tau_neg=3.0"], {"tau_pos": 2.0, "tau_neg": 3.0}),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.1",
      "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.5"], {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5}),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
      "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.2", "actor_rollout_ref.actor.policy_loss.clip_cov_lb=0.01",
      "actor_rollout_ref.actor.policy_loss.clip_cov_ub=9.0"],
     {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.01, "clip_cov_ub": 9.0}),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0.3"],
     {"dro_beta": 0.3}),
])
def test_actor_objective_hands_each_loss_its_options(overrides, options):
    """verl's keys reach the loss that reads them: sapo's actor.tau_*, the others' actor.policy_loss.*."""
    cfg = load_config(overrides)
    objective = ActorObjective.from_config(cfg.actor_rollout_ref.actor, build_run_plan(cfg))
    mb, log_probs, _ = mini_batch()
    mask, norm = mb["response_mask"], GlobalNorm.from_mask(mb["response_mask"])
    torch.manual_seed(0)  # clip_cov's draw
    loss, _ = objective(log_probs, None, mb, norm)
    torch.manual_seed(0)
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    direct = POLICY_LOSSES.get(loss_mode)(log_probs, mb["old_log_probs"], mb["advantages"], mask, **options)
    expected = aggregate_loss(direct.loss, mask, direct.agg_mode or "token-mean", norm)
    assert float(loss) == pytest.approx(float(expected))
    if loss_mode == "clip_cov":
        assert bool(direct.metrics["clipfrac"].any())  # the draw picked tokens: the options changed the loss


def test_kl_loss_zero_for_identical_policies():
    cfg = load_config(["actor_rollout_ref.actor.use_kl_loss=True"])
    objective = ActorObjective.from_config(cfg.actor_rollout_ref.actor, build_run_plan(cfg))
    mb, log_probs, _ = mini_batch()
    mb["ref_log_probs"] = log_probs.clone()
    _, metrics = objective(log_probs, None, mb, GlobalNorm.from_mask(mb["response_mask"]))
    assert float(metrics["actor/kl_loss"]) == 0.0


def test_critic_objective_is_split_invariant():
    cfg = load_config(["algorithm.adv_estimator=gae"])
    objective = CriticObjective.from_config(cfg.critic, build_run_plan(cfg))
    mb, values, _ = mini_batch(seed=1)
    norm = GlobalNorm.from_mask(mb["response_mask"])
    whole, _ = objective(values, mb, norm)
    parts = [objective(values[i], take(mb, i), norm)[0] for i in (torch.tensor([0, 1]), torch.arange(2, 7))]
    assert torch.allclose(whole, sum(parts), atol=1e-6)


def test_actor_objective_applies_rollout_correction():
    """algorithm.rollout_correction: decoupled mode's IS weights multiply the policy loss token by token (verl);
    bypass mode trains with the bypass_mode loss (its rejection narrows the loss mask, its rollout_corr/* metrics keep
    their names), split-invariant like every other loss."""
    from meshrl.algorithms import get_policy_loss

    mb, log_probs, _ = mini_batch()
    norm = GlobalNorm.from_mask(mb["response_mask"])
    weights = torch.rand(log_probs.shape, generator=torch.Generator().manual_seed(5)) * 2
    cfg = load_config([])
    objective = ActorObjective.from_config(cfg.actor_rollout_ref.actor, build_run_plan(cfg))
    loss, _ = objective(log_probs, None, {**mb, "rollout_is_weights": weights}, norm)
    vanilla = get_policy_loss("vanilla")(log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"])
    assert torch.allclose(loss, aggregate_loss(vanilla.loss * weights, mb["response_mask"], "token-mean", norm))

    cfg = load_config([f"algorithm.rollout_correction.{key}" for key in (
        "bypass_mode=True", "loss_type=reinforce", "rollout_is=token", "rollout_rs=token_k2",
        "rollout_rs_threshold=0.02")])
    objective = ActorObjective.from_config(cfg.actor_rollout_ref.actor, build_run_plan(cfg))
    assert objective.loss_mode == "bypass_mode"

    def total(splits):
        lp = log_probs.clone().requires_grad_(True)
        parts = [objective(lp[idx], None, take(mb, idx), norm) for idx in splits]
        loss = torch.stack([part[0] for part in parts]).sum()
        loss.backward()
        return loss.detach(), lp.grad, sum_metrics([part[1] for part in parts])

    whole = total([torch.arange(7)])
    split = total([torch.tensor([3]), torch.tensor([0, 6, 1]), torch.tensor([2, 4, 5])])
    assert torch.allclose(whole[0], split[0], atol=1e-6) and torch.allclose(whole[1], split[1], atol=1e-7)
    assert {"rollout_corr/kl", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"} \
        <= set(whole[2])
    for key in whole[2]:
        assert whole[2][key] == pytest.approx(split[2][key], abs=1e-6), key
    mask = mb["response_mask"].bool()
    kl = float((mb["old_log_probs"] - log_probs)[mask].mean())
    assert whole[2]["rollout_corr/kl"] == pytest.approx(kl, abs=1e-6)
    rejected = whole[2]["rollout_corr/rollout_rs_masked_fraction"]
    assert 0 < rejected < 1
    # the rejected tokens carry no gradient; the kept ones −A·w / N
    delta = (log_probs - mb["old_log_probs"]).clamp(-20, 20)
    kept = mask & (0.5 * delta.square() <= 0.02)
    expected = torch.where(kept, -mb["advantages"] * delta.exp().clamp(max=2.0), 0.0) / norm.num_tokens
    assert torch.allclose(whole[1], expected, atol=1e-6)
