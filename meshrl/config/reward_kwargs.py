"""The arguments of verl's reward managers (``reward.reward_kwargs``, the older ``reward_model.reward_kwargs``): read by
the ``dapo`` manager alone (DAPO's overlong buffer, ``meshrl.rewards.overlong``), refused under the others."""

from __future__ import annotations

from typing import Any, Mapping

MANAGER = "dapo"
BUFFER_KEYS = ("enable", "len", "penalty_factor", "log")


def reward_kwargs(cfg) -> tuple[str, Mapping[str, Any]]:
    """The reward manager's arguments and the key they were set under: ``reward.reward_kwargs``, else the older
    ``reward_model.reward_kwargs``."""
    if cfg.reward.reward_kwargs:
        return "reward.reward_kwargs", cfg.reward.reward_kwargs
    return "reward_model.reward_kwargs", cfg.reward_model.reward_kwargs


def reward_kwargs_problems(cfg) -> list[str]:
    """What is wrong with the reward manager's arguments (verl's asserts, and keys it would not read)."""
    new, old = cfg.reward.reward_kwargs, cfg.reward_model.reward_kwargs
    if new and old and dict(new) != dict(old):
        return ["reward.reward_kwargs, reward_model.reward_kwargs: both set, to different values; set one "
                "(reward.reward_kwargs is verl's newer name)"]
    key, kwargs = reward_kwargs(cfg)
    if not kwargs:
        return []
    if cfg.reward_model.reward_manager != MANAGER:
        return [f"{key}: the arguments of a reward manager, read by the dapo manager only "
                f"(reward.reward_manager.name=dapo); this run's is {cfg.reward_model.reward_manager}, which reads "
                "none: drop them, or pass the function's own arguments in custom_reward_function.reward_kwargs"]
    problems = [f"{key}.{name}: not an argument of the dapo reward manager (it reads overlong_buffer_cfg and "
                "max_resp_len)" for name in kwargs if name not in ("overlong_buffer_cfg", "max_resp_len")]
    buffer = kwargs.get("overlong_buffer_cfg") or {}
    problems += [f"{key}.overlong_buffer_cfg.{name}: not a key of DAPO's overlong buffer ({', '.join(BUFFER_KEYS)})"
                 for name in buffer if name not in BUFFER_KEYS]
    if buffer.get("enable", False):
        length, max_len = buffer.get("len"), kwargs.get("max_resp_len")
        if max_len is None:
            problems.append(f"{key}.max_resp_len: required with overlong_buffer_cfg.enable=True (verl's DAPO "
                            "scripts set it to data.max_response_length)")
        if length is None or length <= 0:
            problems.append(f"{key}.overlong_buffer_cfg.len: must be > 0 with the overlong penalty on, got {length}; "
                            "set overlong_buffer_cfg.enable=False to turn it off")
        elif max_len is not None and max_len < length:
            problems.append(f"{key}.max_resp_len: must be >= overlong_buffer_cfg.len ({length}), got {max_len}")
        if buffer.get("penalty_factor") is None:
            problems.append(f"{key}.overlong_buffer_cfg.penalty_factor: required with overlong_buffer_cfg.enable=True "
                            "(DAPO's is 1.0)")
    return problems
