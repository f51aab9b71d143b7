"""The train/rollout log-prob alarm sees a corrupted weight sync: one tensor of the start-up sync
(``rollout.load_format=dummy``, the default, so the engine has no other source of weights) is perturbed on its
way into the engine, and the run stops at step 1 with the alarm's message.

The fault is injected by the test alone: a ``sitecustomize`` module on the policy workers' ``PYTHONPATH``
(``ray_kwargs.ray_init.runtime_env.env_vars``, a key meshrl honours) wraps the weight sync the rollout
engines call (``meshrl.rollout.base.sync_weights``) when the worker process starts. Nothing in meshrl knows
about it. The run uses a Ray the test started (``ray_session``), so the key reaches the workers through their
actor options, not through a ``ray.init`` of meshrl's."""

import os
import re

import pytest

from meshrl.config import load_config
from meshrl.config.validate import validate_config
from meshrl.trainer.alarms import LogProbMismatchError
from meshrl.trainer.failures import RunFailed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_session")]

CORRUPTED = "model.layers.0.mlp.down_proj.weight"
SITECUSTOMIZE = """
import meshrl.rollout.base as engines

_sync = engines.sync_weights  # weight_sync.sync_weights as the engines call it


def _corrupting(engine, weights, **kwargs):
    # a conversion bug's worth: one tensor arrives with its rows in reverse order
    stream = ((name, tensor.flip(0) if name == CORRUPTED else tensor) for name, tensor in weights)
    return _sync(engine, stream, **kwargs)


engines.sync_weights = _corrupting
""".replace("CORRUPTED", repr(CORRUPTED))
ONE_STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=False", "trainer.test_freq=-1",
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.name=hf",  # the HF engine starts fastest; it copies the synced tensors too
            "data.train_max_samples=64"]  # of GSM8K's 7,473 prompts: only these are tokenized at load


def test_a_corrupted_sync_stops_the_run_at_step_1(tmp_path):
    """Measured: the corrupted engine's log-probs are 1.06 off on average (3.18 at most); the same run uncorrupted
    is 5e-7 off (2e-6 at most; healthy runs pass the alarm in every other e2e test, where it is on by default)."""
    from meshrl.trainer.main import run

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])
    cfg = load_config([f"trainer.default_local_dir={tmp_path / 'run'}", *ONE_STEP,
                       f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={path}"], recipe="cpu_tiny_grpo")
    with pytest.raises(RunFailed) as stopped:  # the run's report (meshrl.trainer.failures) names the cause
        run(cfg, validate_config(cfg))
    assert isinstance(stopped.value.__cause__, LogProbMismatchError)
    message = str(stopped.value)
    assert message.startswith("meshrl: the run failed at step 1: ")
    assert "at step 1" in message and "exceeds the tolerance 0.001" in message  # fp32 trainer and engine
    mean = float(re.search(r"rollout_log_probs\| over the response tokens is ([0-9.e+-]+)", message).group(1))
    assert mean > 0.2  # far beyond even the 16-bit tolerance
    assert "stale or partial weight sync" in message and "trainer.on_mismatch=stop" in message
