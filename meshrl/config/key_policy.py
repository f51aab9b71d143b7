"""What meshrl does with the config keys it does not simply read: nothing is accepted and silently ignored.

Every key of the schema (``meshrl.config.schema``) is one of:

- **read** by the code that it configures (most keys; ``tests/foundation/test_key_policy.py`` walks the schema
  and finds each key's reader);
- **FSDP-only** (``FSDP_ONLY``): verl's keys for its FSDP backend, which verl scripts set for both backends.
  They load; a value other than the default is named in one start-up warning, because it cannot change a run
  of meshrl's Megatron backend;
- **inert** (``INERT``): keys whose value cannot change a meshrl run, for the reason given; named in the same
  warning when set to something other than the default;
- **refused** (``REFUSED``): keys of features meshrl does not have. Any value other than the default stops the
  run at config time with one message naming the missing feature and what to do instead.

Patterns are ``fnmatch`` patterns over dotted keys. Keys whose behaviour depends on other keys (the reference's
layout must be the actor's, ``strategy`` names) are checked in ``meshrl.config.validate``.
"""

from __future__ import annotations

import fnmatch

from omegaconf import DictConfig, OmegaConf

from meshrl.config.loader import default_config

FSDP_CONFIG = ("actor_rollout_ref.actor.fsdp_config.*", "actor_rollout_ref.ref.fsdp_config.*", "critic.fsdp_config.*")
# fsdp_config's offload flags mean for the Megatron backend what they mean for FSDP: they are read.
FSDP_READ = ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
             "actor_rollout_ref.ref.fsdp_config.param_offload", "critic.fsdp_config.param_offload",
             "critic.fsdp_config.optimizer_offload")

FSDP_ONLY = FSDP_CONFIG + (
    "actor_rollout_ref.actor.grad_clip",  # Megatron clips at optim.clip_grad
    "critic.grad_clip",
    "actor_rollout_ref.actor.use_torch_compile",  # verl compiles its FSDP entropy with it
    "actor_rollout_ref.ref.use_torch_compile",
)

INERT = {
    "data.filter_overlong_prompts_workers": "meshrl filters prompts in one process; the result is the same",
    "data.dataloader_num_workers": "meshrl's sampler reads prompts from memory, with no DataLoader workers",
    "actor_rollout_ref.model.use_shm": "meshrl reads the model folder where it is",
    "*.megatron.use_mbridge": "meshrl converts HF <-> Megatron weights with its own mapping",
    "*.megatron.vanilla_mbridge": "meshrl converts HF <-> Megatron weights with its own mapping",
    "actor_rollout_ref.ref.megatron.grad_offload": "the reference is forward-only: it has no gradients",
    "actor_rollout_ref.ref.megatron.optimizer_offload": "the reference is forward-only: it has no optimizer",
    "actor_rollout_ref.ref.megatron.use_distributed_optimizer": "the reference is forward-only: it has no optimizer",
    "actor_rollout_ref.rollout.calculate_log_probs": "meshrl's engines always return the sampled tokens' log-probs "
                                                    "(the step-1 rollout/log_prob_max_abs_diff check reads them)",
    "reward_model.strategy": "it names a learned reward model's backend; meshrl has none (reward_model.enable)",
    "trainer.ray_wait_register_center_timeout": "meshrl's worker start and calls time out at trainer.worker_timeout_s",
}

REFUSED = {
    "reward_model.enable": "learned reward models are not built yet; score with rule rewards or "
                           "custom_reward_function.path, and set reward_model.enable=False",
    "reward_model.reward_manager": "meshrl's reward pool is verl's 'naive' manager (one score per response, "
                                   "dispatched by data source); other managers are not built yet",
    "reward_model.launch_reward_fn_async": "rewards are scored in a process pool after generation; overlapping them "
                                           "with the next phase is not built yet: set False",
    "algorithm.use_pf_ppo": "PF-PPO's reweighting of the batch is not built yet; set False",
    "actor_rollout_ref.actor.policy_loss.clip_cov_*": "these configure verl's clip_cov / kl_cov policy losses, which "
                                                      "meshrl does not register; leave them at their defaults",
    "actor_rollout_ref.actor.policy_loss.kl_cov_ratio": "it configures verl's kl_cov policy loss, which meshrl does "
                                                        "not register; leave it at its default",
    "actor_rollout_ref.actor.policy_loss.ppo_kl_coef": "it configures verl's kl_cov policy loss, which meshrl does "
                                                       "not register; leave it at its default",
    "actor_rollout_ref.hybrid_engine": "meshrl always colocates the rollout engine with the trainer (verl's hybrid "
                                       "engine); set True",
    "data.return_raw_input_ids": "it feeds a learned reward model with another tokenizer, which meshrl does not build",
    "actor_rollout_ref.model.external_lib": "meshrl builds its own model families and imports no model code",
    "actor_rollout_ref.rollout.multi_turn.*": "multi-turn tool-calling rollout is not built yet (meshrl's rollout is "
                                              "single-turn); leave rollout.multi_turn at its defaults",
    "actor_rollout_ref.rollout.agent.*": "agent-loop rollout is not built yet (meshrl's rollout is one batched "
                                         "generate per engine replica); leave rollout.agent at its defaults",
    "*.model.override_config": "HF config overrides would change the model meshrl builds but not the vLLM "
                                 "engine's copy; edit the model folder's config.json instead",
}


def _match(key: str, patterns) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(key, p)), None)


def leaf_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Every key that holds a value: the schema's leaves, free-form dict fields (e.g. ``override_config``) whole."""
    out = []
    for key in cfg.keys():
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and node._metadata.object_type is not dict and not node._is_none():
            out.extend(leaf_keys(node, f"{prefix}{key}."))  # a schema section
        else:
            out.append(f"{prefix}{key}")
    return out


def classify(key: str) -> str:
    """'refused', 'fsdp_only', 'inert' or 'read' for a schema key (the rules above)."""
    if _match(key, REFUSED):
        return "refused"
    if _match(key, FSDP_READ):
        return "read"
    if _match(key, FSDP_ONLY):
        return "fsdp_only"
    if _match(key, INERT):
        return "inert"
    return "read"


def key_policy(cfg: DictConfig) -> tuple[list[str], list[str]]:
    """(problems, warnings) of ``cfg``'s keys set away from their defaults under the rules above."""
    defaults = default_config()
    refused: dict[str, list[str]] = {}  # rule -> the keys set under it: one message per missing feature
    fsdp, inert = [], []
    for key in leaf_keys(cfg):
        kind = classify(key)
        if kind == "read":
            continue
        value, default = OmegaConf.select(cfg, key), OmegaConf.select(defaults, key, default=None)
        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value)
            default = OmegaConf.to_container(default) if isinstance(default, DictConfig) else default
        if value == default:
            continue
        if kind == "refused":
            refused.setdefault(_match(key, REFUSED), []).append(f"{key}={value}")
        elif kind == "fsdp_only":
            fsdp.append(f"{key}={value}")
        else:
            inert.append(f"{key}={value} ({INERT[_match(key, INERT)]})")
    problems = [f"{', '.join(keys)}: {REFUSED[rule]}" for rule, keys in refused.items()]
    warnings = []
    if fsdp:
        warnings.append("verl's FSDP-only keys have no effect on meshrl's Megatron backend: " + ", ".join(fsdp))
    if inert:
        warnings.append("keys with no effect on this run: " + "; ".join(inert))
    return problems, warnings
