"""verl's DAPO reward manager (``reward.reward_manager.name=dapo``): the rule or function score plus DAPO's overlong
penalty, a soft punishment of responses that run into the last ``len`` tokens before ``max_resp_len``.

Configured as verl's scripts do, in ``reward.reward_kwargs`` (the older verl: ``reward_model.reward_kwargs``)::

    overlong_buffer_cfg: {enable: True, len: L, penalty_factor: f, log: False}
    max_resp_len: M

For a response of ``ℓ`` valid tokens (verl's ``DAPORewardManager.run_single``)::

    reward = score + min(-(ℓ - (M - L)) / L · f, 0)

so nothing changes up to ``M - L`` tokens, and the penalty grows linearly to ``-f`` at ``M``. With ``log`` the
per-response ``overlong_reward`` and ``overlong`` (penalised or not) join the reward's extra outputs. These
``reward_kwargs`` are the manager's, not the function's (verl passes them to no function; a function's own arguments
are ``custom_reward_function.reward_kwargs``). The penalty applies to validation scores too (verl's validation uses
the same manager).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.config.reward_kwargs import MANAGER, reward_kwargs


@dataclass(frozen=True)
class OverlongBuffer:
    max_resp_len: int
    length: int
    penalty_factor: float
    log: bool

    def penalty(self, response_lengths: torch.Tensor) -> torch.Tensor:
        """Per response (``response_lengths``: valid tokens), ``min(-(ℓ - (M - L)) / L · f, 0)``."""
        exceed = response_lengths.to(torch.float32) - (self.max_resp_len - self.length)
        return torch.clamp(-exceed / self.length * self.penalty_factor, max=0.0)


def overlong_buffer(cfg) -> OverlongBuffer | None:
    """The run's overlong penalty: the dapo manager with ``overlong_buffer_cfg.enable``; None otherwise."""
    if cfg.reward_model.reward_manager != MANAGER:
        return None
    _, kwargs = reward_kwargs(cfg)
    buffer = kwargs.get("overlong_buffer_cfg") or {}
    if not buffer.get("enable", False):
        return None
    return OverlongBuffer(int(kwargs["max_resp_len"]), int(buffer["len"]), float(buffer["penalty_factor"]),
                          bool(buffer.get("log", False)))
