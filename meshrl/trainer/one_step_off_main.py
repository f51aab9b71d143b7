"""Entry point of verl's one-step-off trainer's scripts: ``python -m meshrl.trainer.one_step_off_main key=value ...``.

It stands for ``python -m verl.experimental.one_step_off_policy.main_ppo``, whose config is
``one_step_off_ppo_trainer`` unless the script names another with ``--config-name`` (``_megatron`` for its
Megatron form): the same here (``meshrl/config/verl_async/``; the trainer: ``meshrl.trainer.async_trainer``).
Everything else is ``meshrl.trainer.main``'s.
"""

import sys

from meshrl.trainer.main import main

if __name__ == "__main__":
    sys.exit(main(default_config_name="one_step_off_ppo_trainer", prog="python -m meshrl.trainer.one_step_off_main"))
