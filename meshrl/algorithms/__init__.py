"""RL algorithms as pure tensor functions: advantage estimators, policy losses, KL, loss aggregation.

Methods are looked up by the names verl users already type (`get_advantage_estimator("grpo")`,
`get_policy_loss("vanilla")`, `kl_penalty(..., "k3")`) or as "package.module:function" strings.
"""

from meshrl.algorithms.advantages import (
    AdvantageOutput,
    gae,
    gpg,
    gpg_alpha,
    grpo,
    grpo_passk,
    opo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from meshrl.algorithms.aggregation import LOSS_AGG_MODES, GlobalNorm, aggregate_loss
from meshrl.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)
from meshrl.algorithms.policy_loss import (
    TokenLoss,
    cispo,
    entropy_from_logits,
    gspo,
    policy_gradient,
    value_loss,
    vanilla,
)
from meshrl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_PENALTIES,
    POLICY_LOSSES,
    Registry,
    call_with_available,
    register_advantage,
    register_kl_penalty,
    register_policy_loss,
)

get_advantage_estimator = ADVANTAGE_ESTIMATORS.get
get_policy_loss = POLICY_LOSSES.get

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageOutput",
    "FixedKLController",
    "GlobalNorm",
    "KLController",
    "Registry",
    "TokenLoss",
    "aggregate_loss",
    "apply_kl_penalty",
    "call_with_available",
    "cispo",
    "entropy_from_logits",
    "gae",
    "get_advantage_estimator",
    "get_policy_loss",
    "gpg",
    "gpg_alpha",
    "grpo",
    "grpo_passk",
    "gspo",
    "kl_penalty",
    "make_kl_controller",
    "opo",
    "policy_gradient",
    "register_advantage",
    "register_kl_penalty",
    "register_policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "value_loss",
    "vanilla",
]
