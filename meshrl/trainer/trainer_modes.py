"""Which trainer a config asks for: one table, read by the entry (``meshrl.trainer.main``) and the tests.

- verl V1's ``colocate_async`` (``trainer.use_v1=True``, ``trainer.v1.trainer_mode=colocate_async``):
  ``meshrl.trainer.colocate_async_trainer``;
- verl's one-step-off and fully async trainers (``trainer.async_mode``, which their config names set):
  ``meshrl.trainer.async_trainer``;
- otherwise the synchronous trainer (verl's V0 and V1 ``sync``): ``meshrl.trainer.rl_trainer``.
"""

from __future__ import annotations

from meshrl.config.async_keys import colocate_async
from meshrl.trainer.async_trainer import AsyncRLTrainer
from meshrl.trainer.colocate_async_trainer import ColocateAsyncTrainer
from meshrl.trainer.rl_trainer import RLTrainer


def trainer_class(cfg) -> type[RLTrainer]:
    if colocate_async(cfg):
        return ColocateAsyncTrainer
    return AsyncRLTrainer if cfg.trainer.async_mode else RLTrainer
