"""The driver's signal handling (``meshrl.trainer.interrupts``), in-process; tests/e2e/test_interrupts.py sends
the signals to a real run."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from meshrl.trainer.interrupts import Interrupted, Interrupts, stop_line


def test_sigint_and_sigterm_stop_at_once_and_name_their_exit_code():
    before = signal.getsignal(signal.SIGTERM)
    for signum, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        with Interrupts(save_on_preempt=False) as interrupts:
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signum)
            assert interrupts.stop_requested()
            stopped = interrupts.interrupted(3, Path("/runs/x/global_step_2"), "auto")
        assert isinstance(stopped, Interrupted) and stopped.exit_code == code
        assert str(stopped) == (f"meshrl: interrupted by {signal.Signals(signum).name} at step 3; last checkpoint: "
                                "/runs/x/global_step_2; resume with the same command")
    assert signal.getsignal(signal.SIGTERM) is before


def test_save_on_preempt_lets_the_step_finish_and_a_second_signal_stops_at_once(capsys):
    with Interrupts(save_on_preempt=True) as interrupts:
        assert not interrupts.stop_requested()
        signal.raise_signal(signal.SIGTERM)  # no exception: the trainer polls stop_requested() after the step
        assert interrupts.stop_requested()
        assert "SIGTERM: finishing and saving the step in progress" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert interrupts.interrupted(2, None, "auto").exit_code == 130


def test_signals_while_the_workers_stop_do_not_cut_the_shutdown_short(capsys):
    with Interrupts(save_on_preempt=False) as interrupts:
        interrupts.stopping = True
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
    assert capsys.readouterr().err.count("still stopping the workers") == 2


def test_the_line_says_what_the_same_command_would_do():
    assert stop_line(signal.SIGINT, 0, None, "auto") == \
        "meshrl: interrupted by SIGINT before the first step; no checkpoint yet: the same command starts over"
    assert stop_line(signal.SIGTERM, 5, Path("/r/global_step_4"), "disable") == (
        "meshrl: interrupted by SIGTERM at step 5; last checkpoint: /r/global_step_4; resume with "
        "trainer.resume_mode=auto (this command's resume_mode=disable does not start from it)")
