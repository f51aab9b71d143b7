"""The bookkeeping of bench/rollout_mismatch.py (the runs themselves are benchmarks, never tests)."""

import json

import pytest

from bench import rollout_mismatch as rm


def line(step, **metrics):
    return json.dumps({"step": step, **metrics})


def test_step_records_keep_training_steps_in_order_last_record_wins_and_only_the_kept_keys():
    lines = [line(2, **{"timing/step_s": 3.0, "rollout_corr/kl": 0.2, "actor/lr": 1e-5}),
             line(1, **{"timing/step_s": 1.0, "rollout_corr/kl": 0.1, "rollout/log_prob_mean_abs_diff": 0.5}),
             line(2, **{"val/score": 0.3}),  # a validation-only record: no step time
             line(1, **{"timing/step_s": 2.0, "rollout_corr/kl": 0.15, "score/mean": 0.25}),
             '{"step": 3, "timing/st',  # cut short by a killed process
             json.dumps({"step": "4", "timing/step_s": 1.0})]
    records = rm.step_records(lines)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0] == {"step": 1, "timing/step_s": 2.0, "rollout_corr/kl": 0.15, "score/mean": 0.25}
    assert "actor/lr" not in records[1] and records[1]["rollout_corr/kl"] == 0.2


def test_summarise_takes_finite_values_of_the_table_keys_only():
    steps = [{"step": 1, "rollout_corr/kl": 1.0, "rollout_corr/rollout_is_max": float("nan")},
             {"step": 2, "rollout_corr/kl": 3.0, "rollout_corr/rollout_is_max": 1.5, "other": 9.0}]
    summary = rm.summarise(steps)
    assert summary["rollout_corr/kl"] == {"mean": 2.0, "min": 1.0, "max": 3.0}
    assert summary["rollout_corr/rollout_is_max"] == {"mean": 1.5, "min": 1.5, "max": 1.5}
    assert "other" not in summary and "score/mean" not in summary


def test_table_has_a_row_per_step_and_marks_missing_metrics():
    result = {"settings": {"a": {"label": "A", "steps": [{"step": 1, "rollout_corr/kl": 7.5e-6,
                                                          "rollout_corr/rollout_is_mean": 0.99999208}]}}}
    header, rule, row = rm.table(result).splitlines()
    assert header.count("|") == rule.count("|") == row.count("|") == len(rm.TABLE) + 3
    assert row.startswith("| A | 1 | 7.50e-06 |") and "| 0.999992 |" in row and "| – |" in row


@pytest.mark.parametrize("value,digits,text", [(0, 3, "0"), (0.0327, 3, "0.0327"), (1.2e-7, 3, "1.20e-07"),
                                                (0.99999208, 6, "0.999992"), (None, 3, "–")])
def test_fmt(value, digits, text):
    assert rm._fmt(value, digits) == text
