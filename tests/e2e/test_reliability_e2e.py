"""The reliability suite: every way a run ends leaves nothing behind, and a run killed at the worst moment
resumes as if nothing had happened.

Each test runs ``python -m meshrl.trainer.main`` as a user does, in its own ``RunSandbox`` (a ``TMPDIR`` of its
own: ``tests/e2e/run_sandbox.py``), and then compares the machine before and after: no process, no file in the
run's temporary folder, no new shared-memory segment. Exit paths covered here: a normal finish (and the same
command again: the resume test's uninterrupted run), a config error, an exception raised in a worker, ``kill -9`` of a
worker (of the one-step-off trainer, generating on a thread while it trains), ``kill -9`` of the driver
while it writes a checkpoint. Ctrl-C and SIGTERM: ``tests/e2e/test_interrupts_e2e.py``, with the same check.
"""

from __future__ import annotations

import json
import re

import psutil
import pytest
from e2e_checks import steps_of
from run_sandbox import TINY, RunSandbox, run_main

from meshrl.trainer.checkpoint import CheckpointManager

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture
def sandbox():
    box = RunSandbox()
    yield box
    box.cleanup()


def test_a_config_error_stops_before_any_process_and_leaves_nothing(sandbox, tmp_path):
    code = run_main(sandbox, *TINY, f"trainer.default_local_dir={tmp_path / 'run'}", "data.train_batch_size=lots",
                    log=tmp_path / "output.txt")
    output = (tmp_path / "output.txt").read_text()
    assert code == 2 and "data.train_batch_size" in output and "Traceback" not in output, output[-3000:]
    assert not (tmp_path / "run").exists()
    sandbox.assert_clean()


def test_an_exception_in_a_worker_stops_the_run_and_leaves_nothing(sandbox, tmp_path):
    # lr=1e30 throws the weights to ~1e30 in the first update; the next mini-batch's loss is NaN, and with the
    # "stop" policy (the default) the actor worker raises inside its training step.
    run_dir = tmp_path / "run"
    code = run_main(sandbox, *TINY, f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=2",
                    "actor_rollout_ref.actor.optim.lr=1e30", "trainer.on_nonfinite_loss=stop",
                    log=tmp_path / "output.txt")
    output = (tmp_path / "output.txt").read_text()
    assert code == 1 and re.search(r"^meshrl: the run failed at step [12]: actor_rollout_ref rank 0 failed in "
                                   r"update: FloatingPointError: actor loss is nan", output, re.M), output[-3000:]
    # A report, not the driver's traceback (meshrl.trainer.failures): that one is in the run's driver log.
    assert "Traceback" not in output and f"is in {run_dir / 'logs'}/" in output, output[-3000:]
    assert "no checkpoint yet: the same command starts over" in output
    assert "Traceback" in (run_dir / "logs" / "driver.log").read_text()
    sandbox.assert_clean()


def _policy_workers(sandbox: RunSandbox) -> list[psutil.Process]:
    return [p for p in sandbox.processes() if " ".join(p.cmdline()).startswith("ray::ActorRolloutRefWorker")]


def test_a_killed_worker_stops_the_run_keeps_the_checkpoint_and_leaves_nothing(sandbox, tmp_path):
    """The one-step-off trainer's workers generate the next batch on a thread of their own while they train: the
    kill lands in that overlap (or the step), and the run fails fast naming the worker, as the synchronous one's."""
    run_dir = tmp_path / "run"
    code = run_main(sandbox, *TINY, f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=6",
                    "trainer.save_freq=1", "trainer.async_mode=one_step_off",
                    "algorithm.rollout_correction.bypass_mode=True", log=tmp_path / "output.txt",
                    until=lambda: (run_dir / "global_step_1" / "COMPLETE").is_file(),
                    kill=lambda: _policy_workers(sandbox))
    output = (tmp_path / "output.txt").read_text()
    assert code == 1 and "actor_rollout_ref rank 0 died" in output and "Traceback" not in output, output[-3000:]
    assert "on a thread of each worker while it trains" in output  # the overlapped rollouter
    assert re.search(rf"meshrl: last checkpoint: {run_dir}/global_step_\d; resume with the same command", output)
    latest = CheckpointManager(run_dir).resolve("auto")
    assert latest is not None and CheckpointManager(run_dir).load_driver_state(latest)["step"] >= 1
    sandbox.assert_clean()


# Everything a resumed run must reproduce (timings are the only metrics allowed to differ).
COMPARED = ("score/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr", "response_length/mean",
            "critic/advantages/mean", "training/epoch", "actor/kl_loss", "actor/ref_kl_k1", "actor/reward_kl_coef",
            "val/score")


def test_the_driver_killed_while_saving_resumes_like_an_uninterrupted_run_at_tp2(sandbox, tmp_path):
    """``kill -9`` of the driver while it writes step 2's checkpoint, the last (the workers' parts are in the
    temporary folder): Ray's processes die with it, step 1 stays the latest checkpoint, and the same command resumes
    from it to the end with the metrics of a run never interrupted. At TP2: two training processes per role. The
    uninterrupted run is the normal finish: it leaves nothing behind, and the same command then trains again."""
    layout = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
              "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", "trainer.save_freq=1",
              "trainer.total_training_steps=2", "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,"
              "extra,hf_model]",  # the HF export keeps the save open long enough to be caught in it
              # state a resume must restore beyond the weights: the adaptive KL controller, the reference, validation
              "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive",
              "actor_rollout_ref.actor.use_kl_loss=True", "trainer.test_freq=2"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run_main(sandbox, *TINY, *layout, f"trainer.default_local_dir={straight}", log=tmp_path / "a.txt") == 0
    sandbox.assert_clean()

    def saving_step_2() -> bool:
        return any(killed.glob("global_step_2.tmp-*"))

    def driver() -> list[psutil.Process]:
        return [p for p in sandbox.processes() if "meshrl.trainer.main" in " ".join(p.cmdline())]

    code = run_main(sandbox, *TINY, *layout, f"trainer.default_local_dir={killed}", log=tmp_path / "b.txt",
                    until=saving_step_2, kill=driver)
    assert code == -9
    manager = CheckpointManager(killed)
    assert manager.resolve("auto").name == "global_step_1"
    # Ray's agents outlive the driver: one that sees its raylet killed first reports it to the GCS, which died too,
    # with a 60 s timeout (ray._private.utils.publish_error_to_driver), and only then exits; a worker still saving
    # forks megatron's writers, which wait forever once orphaned. The resume's start stops what holds the dead run's
    # TMPDIR (meshrl.runtime.stop_leftovers), children forked meanwhile too. Checked at the end, with the resume's.

    assert run_main(sandbox, *TINY, *layout, f"trainer.default_local_dir={killed}", log=tmp_path / "c.txt") == 0
    output = (tmp_path / "c.txt").read_text()
    assert f"resumed from step 1, {killed / 'global_step_1'}" in output, output[-3000:]
    assert not list(killed.glob("*.tmp-*"))  # the interrupted save's temporary folder is gone, and the killed
    # driver's temporary folder (the resume's start removed it: sandbox.assert_clean below)
    expected, resumed = steps_of(straight), steps_of(killed)
    assert {"actor/reward_kl_coef", "actor/kl_loss", "val/score"} <= set(expected[2])
    for key in COMPARED:
        if key in expected[2]:
            assert resumed[2][key] == expected[2][key], key
    assert json.loads((killed / "global_step_2" / "COMPLETE").read_text())["step"] == 2
    # the killed run's daemons and checkpoint writers too, and its temporary folder
    sandbox.assert_clean()
