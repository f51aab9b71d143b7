"""A recognised failure ends a run with a report: what failed and where, the checkpoint to resume from; the
driver's traceback goes to the run's log."""

from pathlib import Path

from meshrl.trainer.failures import RunFailed, run_failed
from meshrl.workers.group import WorkerError


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_the_report_names_the_step_the_cause_and_the_checkpoint(tmp_path):
    cause = _raised(WorkerError("actor_rollout_ref rank 1 died"))
    log = tmp_path / "logs" / "driver.log"
    failed = run_failed(cause, 3, tmp_path / "global_step_2", "auto", log)
    assert isinstance(failed, RunFailed) and failed.exit_code == 1
    assert str(failed).splitlines() == [
        "meshrl: the run failed at step 3: actor_rollout_ref rank 1 died",
        f"meshrl: last checkpoint: {tmp_path / 'global_step_2'}; resume with the same command"]
    logged = log.read_text()
    assert "Traceback" in logged and "WorkerError: actor_rollout_ref rank 1 died" in logged


def test_before_the_first_step_without_a_checkpoint_and_verbose(capsys):
    failed = run_failed(_raised(WorkerError("critic rank 0 failed in setup")), 0, None, "auto", None)
    assert str(failed).splitlines() == ["meshrl: the run failed before the first step: critic rank 0 failed in setup",
                                        "meshrl: no checkpoint yet: the same command starts over"]
    assert "Traceback" in capsys.readouterr().err  # trainer.verbose: the traceback on the console


def test_a_resume_mode_that_would_not_resume_says_so(tmp_path: Path):
    failed = run_failed(_raised(WorkerError("x")), 2, tmp_path / "global_step_1", "disable", tmp_path / "d.log")
    assert "resume with trainer.resume_mode=auto (this command's resume_mode=disable" in str(failed)
