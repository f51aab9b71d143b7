"""The reward-model role scores like transformers' own ``*ForSequenceClassification`` (``reward_model_checks.py``,
run in a fresh process, ~15 s)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward_model_checks") / "results.json"
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    run = subprocess.run([sys.executable, str(HERE / "reward_model_checks.py"), "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(out.read_text())


def test_scores_equal_transformers_sequence_classification(results):
    expected = results["expected"]
    assert len(set(round(e, 4) for e in expected)) == len(expected)  # distinct conversations, distinct scores
    for layout in ("packed", "rows"):
        assert max(abs(a - b) for a, b in zip(results[layout], expected)) < 1e-5, (layout, results[layout], expected)


def test_conversation_is_rendered_with_the_reward_models_template(results):
    first = results["rendered"][0]
    # the chat template's markers around the prompt and the response, the response's text without its EOS
    assert first.count("<|im_start|>") == 3 and "What is 2 + 3?" in first and "The answer is 5." in first
    assert first.endswith("The answer is 5.<|im_end|>\n")
