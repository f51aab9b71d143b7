"""Actor/critic objectives: micro-batch losses and metrics add up to the mini-batch's, for any split."""

import pytest
import torch

from meshrl.algorithms import GlobalNorm
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
    ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "actor_rollout_ref.actor.policy_loss.loss_mode=gpg"],
    ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
])
def test_actor_objective_is_split_invariant(overrides):
    objective = ActorObjective.from_config(load_config(overrides).actor_rollout_ref.actor)
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


def test_kl_loss_zero_for_identical_policies():
    objective = ActorObjective.from_config(load_config(["actor_rollout_ref.actor.use_kl_loss=True"]).actor_rollout_ref.actor)
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
