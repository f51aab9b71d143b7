"""Metrics tracking (console, JSONL, TensorBoard, W&B), the step timer, and the metrics plot."""

import json
import logging
import math
import sys
import time
import types

import numpy as np
import pytest
import torch

from meshrl.trainer import plot, tracking
from meshrl.trainer.tracking import METRICS_FILE, Timer, Tracker, read_metrics


def strict_lines(path):
    """Every line parsed by a JSON reader that rejects NaN/Infinity (as jq and most non-Python tools do)."""

    def reject(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_jsonl_lines_are_valid_json_with_nan_and_inf(tmp_path):
    with Tracker(["jsonl"], tmp_path, "p", "e", {}, 2) as tracker:
        tracker.log({"score/mean": float("nan"), "actor/kl": float("inf"), "a": np.float32(0.5),
                     "b": torch.tensor(2)}, 1)
        tracker.log({"score/mean": 0.25, "actor/grad_norm": None}, 2)
    lines = strict_lines(tmp_path / METRICS_FILE)
    assert lines == [{"step": 1, "score/mean": None, "actor/kl": None, "a": 0.5, "b": 2.0},
                     {"step": 2, "score/mean": 0.25, "actor/grad_norm": None}]


def test_resume_drops_steps_after_checkpoint_and_partial_line(tmp_path):
    path = tmp_path / METRICS_FILE
    with Tracker(["jsonl"], tmp_path, "p", "e", {}, 10) as tracker:
        for step in range(0, 6):
            tracker.log({"x": float(step)}, step)
    with open(path, "a") as f:
        f.write('{"step": 6, "x": ')  # the writer was killed mid-line
    with Tracker(["jsonl"], tmp_path, "p", "e", {}, 10) as tracker:
        tracker.truncate_after(3)  # resumed from the step-3 checkpoint
        tracker.log({"x": 40.0}, 4)
        tracker.log({"x": 50.0}, 5)
    records = strict_lines(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]  # step 0 (validation before training) stays
    assert [r["x"] for r in records] == [0.0, 1.0, 2.0, 3.0, 40.0, 50.0]


def test_partial_last_line_is_cut_before_appending(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    with Tracker(["jsonl"], tmp_path, "p", "e", {}, 3) as tracker:
        tracker.log({"x": 3.0}, 3)
    assert strict_lines(path) == [{"step": 1, "x": 1.0}, {"step": 3, "x": 3.0}]


def test_fresh_start_clears_an_old_run_in_the_same_folder(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(["jsonl", "tensorboard"], tmp_path, "p", "e", {}, 3) as tracker:
        tracker.log({"val/score": 0.5}, 0)  # validation before training
        tracker.log({"x": 1.0}, 1)
        tracker.log({"x": 2.0}, 2)
    with Tracker(["jsonl", "tensorboard"], tmp_path, "p", "e", {}, 3) as tracker:
        tracker.truncate_after(0)
        tracker.log({"val/score": 0.25}, 0)
        tracker.log({"x": 9.0}, 1)
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 0, "val/score": 0.25}, {"step": 1, "x": 9.0}]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val/score")] == [(0, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 9.0)]


def test_bad_metrics_and_logger_names_are_named(tmp_path):
    with pytest.raises(ValueError, match="'jsnol'.*console, jsonl, tensorboard, wandb"):
        Tracker(["console", "jsnol"], tmp_path, "p", "e", {}, 1)
    with Tracker(["jsonl"], tmp_path, "p", "e", {}, 1) as tracker:
        with pytest.raises(TypeError, match="'note'"):
            tracker.log({"note": "1.5"}, 1)
        with pytest.raises(TypeError, match="'per_token'"):
            tracker.log({"per_token": torch.ones(3)}, 1)
        with pytest.raises(ValueError, match="reserved"):
            tracker.log({"step": 1.0}, 1)
    assert not (tmp_path / METRICS_FILE).read_text()


def test_console_without_tty_prints_key_metrics(tmp_path, capsys):
    with Tracker(["console"], tmp_path, "p", "exp", {}, 3) as tracker:
        tracker.log({"score/mean": 0.5, "timing/step_s": 2.0, "my/unknown": 7.0}, 1)
        tracker.log({"score/mean": 0.625, "val/score": 0.75, "actor/ref_kl_k1": 0.001}, 2)
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0] == "step 1/3 | score 0.5 | s/step 2"
    assert lines[1].startswith("step 2/3 | score 0.625 | val 0.75 | kl 0.001 | eta ")
    assert "unknown" not in out.out and "val" not in lines[0]
    assert "exp" not in out.err  # no bar redrawn into a pipe


def test_console_shows_the_metrics_of_the_features_a_run_switched_on(tmp_path, capsys):
    with Tracker(["console"], tmp_path, "p", "exp", {}, 2) as tracker:
        tracker.log({"score/mean": 0.5, "agent/num_turns/mean": 3.5, "agent/tool_calls/mean": 1.25}, 1)
        tracker.log({"score/mean": 0.5, "rollout_corr/rollout_is_mean": 0.98,
                     "rollout_corr/rollout_rs_masked_fraction": 0.125,
                     "training/off_policy/trajectory_staleness/mean": 0.5}, 2)
    first, second = capsys.readouterr().out.splitlines()
    assert first == "step 1/2 | score 0.5 | turns 3.5 | tool_calls 1.25"
    assert second.startswith("step 2/2 | score 0.5 | is_weight 0.98 | rejected 0.125 | stale 0.5")


def test_console_bar_on_a_non_terminal_stream_does_not_crash(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tracking, "_is_terminal", lambda stream: True)  # force the bar on a captured stream
    with Tracker(["console"], tmp_path, "p", "exp", {}, 4) as tracker:
        tracker.truncate_after(1)
        tracker.log({"score/mean": 0.5, "val/score": 0.25}, 2)
        tracker.log({"score/mean": 0.75}, 3)
    err = capsys.readouterr().err
    assert "exp" in err and "3/4" in err
    assert "val=0.25" in err.rsplit("\r", 1)[-1]  # the last validation score stays in the postfix


def test_tensorboard_purges_steps_after_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(["tensorboard"], tmp_path, "p", "e", {"lr": 1e-6}, 5) as tracker:
        for step in range(1, 6):
            tracker.log({"x": float(step), "y": float("nan")}, step)
    with Tracker(["tensorboard"], tmp_path, "p", "e", {}, 5) as tracker:
        tracker.truncate_after(2)
        tracker.log({"x": 30.0}, 3)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert "y" not in events.Tags()["scalars"]  # non-finite values are not written


def test_wandb_missing_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match=r"pip install wandb.*trainer\.logger"):
        Tracker(["jsonl", "wandb"], tmp_path, "p", "e", {}, 1)


def test_wandb_is_offline_by_default_and_keeps_its_run_id(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(log=lambda metrics, step: calls.append(("log", step)),
                                finish=lambda: calls.append("finish"))
    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(kwargs) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with Tracker(["wandb"], tmp_path, "proj", "exp", {"a": 1}, 2) as tracker:
        tracker.log({"x": 1.0}, 1)
    monkeypatch.setenv("WANDB_MODE", "online")
    with Tracker(["wandb"], tmp_path, "proj", "exp", {"a": 1}, 2):
        pass
    first, second = calls[0], calls[3]
    assert calls[1:3] == [("log", 1), "finish"]
    assert first["mode"] == "offline" and second["mode"] == "online"
    assert first["id"] == second["id"] and first["resume"] == "allow"
    assert (first["project"], first["name"], first["config"]) == ("proj", "exp", {"a": 1})


def test_timer_accumulates_phases():
    timer = Timer()
    with timer("step"):
        for _ in range(2):
            with timer("gen"):
                time.sleep(0.01)
        with pytest.raises(RuntimeError):
            with timer("update"):
                raise RuntimeError("boom")
    metrics = timer.metrics()
    assert set(metrics) == {"timing/step_s", "timing/gen_s", "timing/update_s"}
    assert metrics["timing/gen_s"] >= 0.02
    assert metrics["timing/step_s"] >= metrics["timing/gen_s"] + metrics["timing/update_s"]
    assert timer.total("gen") == metrics["timing/gen_s"] and timer.total("ref") == 0.0


# ------------------------------------------------------------------------------------------- plot

def write_synthetic_run(run_dir):
    """40 steps of the metrics a GRPO run logs, with NaN/null values, sparse validation and a cut last line."""
    rng = np.random.default_rng(0)
    with Tracker(["jsonl"], run_dir, "p", "e", {}, 40) as tracker:
        for step in range(1, 41):
            score = min(1.0, 0.2 + step / 60 + rng.normal(0, 0.03))
            metrics = {
                "score/mean": score, "score/std": 0.3, "score/accuracy": score * 0.9,
                "response_length/mean": 200 - step, "response_length/max": 400.0,
                "actor/ref_kl_k1": step * 1e-4, "actor/entropy": 1.2 - step / 80, "actor/clipfrac": 0.02,
                "actor/grad_norm": float("nan") if step == 7 else 1.0 + rng.random(), "actor/lr": 1e-6,
                "actor/pg_loss": rng.normal(0, 0.1),
                "timing/gen_s": 6.0, "timing/kl_s": 0.5, "timing/update_actor_s": 3.0, "timing/step_s": 10.0,
                "perf/tokens_per_s": 900.0 + step,
                "dynamic_batch/samples_mean": 30.0, "dynamic_batch/samples_min": 20.0,
                "dynamic_batch/samples_max": 40.0,
                "dynamic_batch/tokens_mean": 7000.0, "dynamic_batch/tokens_max": 8000.0,
                "dynamic_batch/padding_ratio": 0.2, "reward/seconds": 0.3,
            }
            tracker.log(metrics, step)
            if step % 10 == 0:
                tracker.log({"val/score": score - 0.05}, step)  # logged separately: merged by step
    with open(run_dir / METRICS_FILE, "a") as f:
        f.write('{"step": 41, "score/me')


EXPECTED_PANELS = [
    plot.SCORE, plot.LENGTH, plot.KL, plot.ENTROPY, plot.CLIPFRAC, plot.GRAD_NORM, plot.LR, plot.TIMING,
    plot.THROUGHPUT, plot.DB_SAMPLES, plot.DB_TOKENS, "actor", "dynamic_batch", "reward",
]


def test_plot_run_draws_the_expected_panels(tmp_path, caplog):
    write_synthetic_run(tmp_path)
    with caplog.at_level(logging.INFO, logger="meshrl.trainer.plot"):
        out = plot.plot_run(tmp_path)
    assert out == tmp_path / "metrics.png"
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 50_000
    assert f"14 panels: {', '.join(EXPECTED_PANELS)}" in caplog.text


def test_plot_metrics_returns_the_panels_it_drew(tmp_path):
    records = [{"step": 1, "actor/grad_norm": 1.0, "timing/gen_s": 2.0, "x/y": None},
               {"step": 2, "actor/grad_norm": None, "timing/gen_s": 2.5}]
    out = tmp_path / "small.png"
    assert plot.plot_metrics(records, out) == [plot.GRAD_NORM, plot.TIMING]
    assert out.stat().st_size > 5_000


def test_series_merge_steps_and_keep_gaps():
    records = [{"step": 2, "a": None, "b": 1.0}, {"step": 1, "a": 1.0}, {"step": 2, "c": 5.0}, {"step": 3, "a": "text"}]
    series = plot.collect_series(records)
    steps, values = series["a"]
    assert steps.tolist() == [1, 2, 3] and values[0] == 1.0 and math.isnan(values[1]) and math.isnan(values[2])
    assert series["b"][0].tolist() == [2] and series["c"][0].tolist() == [2]
    assert "d" not in plot.collect_series([{"step": 1, "d": None}])  # never finite: nothing to draw


@pytest.mark.parametrize("key, panel", [
    ("timing/kl_s", plot.TIMING), ("actor/ppo_kl", plot.KL), ("val/gsm8k/score", plot.SCORE),
    ("val/accuracy", plot.SCORE), ("actor/clipfrac_lower", plot.CLIPFRAC), ("actor/lr", plot.LR),
    ("dynamic_batch/tokens_max", plot.DB_TOKENS), ("dynamic_batch/budget_utilisation_min", "dynamic_batch"),
    ("prompt_length/mean", "prompt_length"), ("epoch", "other"),
])
def test_panel_for(key, panel):
    assert plot.panel_for(key) == panel


def test_plot_cli_and_empty_or_missing_files(tmp_path, capsys):
    (tmp_path / METRICS_FILE).write_text("")
    out = tmp_path / "sub" / "empty.png"
    assert plot.main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    assert "panels: none" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="trainer.logger includes 'jsonl'"):
        plot.plot_run(tmp_path / "nowhere")
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "nowhere")])
