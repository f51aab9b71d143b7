"""Entry point of verl's fully async trainer's scripts: ``python -m meshrl.trainer.fully_async_main key=value ...``.

It stands for ``python -m verl.experimental.fully_async_policy.fully_async_main``, whose config is
``fully_async_ppo_trainer`` unless the script names another with ``--config-name`` (``_megatron`` for its
Megatron form): the same here (``meshrl/config/verl_async/``; the trainer: ``meshrl.trainer.async_trainer``).
Everything else is ``meshrl.trainer.main``'s.
"""

import sys

from meshrl.trainer.main import main

if __name__ == "__main__":
    sys.exit(main(default_config_name="fully_async_ppo_trainer", prog="python -m meshrl.trainer.fully_async_main"))
