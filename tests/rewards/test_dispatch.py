"""Reward dispatch by data_source and custom reward functions loaded from a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrl.rewards.dispatch import RewardSpec, default_compute_score, load_custom_reward_function


@pytest.mark.parametrize("source", ["openai/gsm8k", "gsm8k"])
def test_gsm8k_sources(source: str) -> None:
    assert default_compute_score(source, "so #### 72", "72") == 1.0
    assert default_compute_score(source, "so #### 71", "72", {"index": 0}) == 0.0


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("5 + 38 = 43. The answer is 43.", 1.0),  # last number, no "####" needed
        ("so #### 43", 1.0),
        ("It is 43.0", 1.0),  # numeric comparison
        ("The answer is 43 shells, not 42", 0.0),  # only the last number counts
        ("The answer is 42.", 0.0),
        ("no number at all", 0.0),
    ],
)
def test_mawps_source_is_flexible_and_numeric(response: str, score: float) -> None:
    assert default_compute_score("mawps", response, "43") == score


@pytest.mark.parametrize(
    "source", ["DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math", "math500"]
)
def test_math_sources(source: str) -> None:
    assert default_compute_score(source, r"$\boxed{\frac12}$", "0.5") == {"score": 1.0, "math_verify_fallback": False}


def test_unknown_source_says_how_to_plug_in() -> None:
    with pytest.raises(NotImplementedError, match=r"data_source='aime24'.*custom_reward_function\.path"):
        default_compute_score("aime24", "x", "y")


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(body)
    return path


def test_custom_function_with_kwargs(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return float(solution_str.strip() == ground_truth) + bonus\n"
        "def other(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.5, 'note': data_source}\n",
    )
    fn = load_custom_reward_function(path)
    assert fn("src", " 4 ", "4") == 1.0
    assert load_custom_reward_function(str(path), "other")("x", "", "", None) == {"score": 0.5, "note": "x"}
    spec = RewardSpec(custom_path=str(path), reward_kwargs={"bonus": 0.25})
    assert spec.build()("src", "4", "4", None) == 1.25
    assert RewardSpec().build() is default_compute_score


def test_custom_errors_are_actionable(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path='nowhere.py': no such file"):
        load_custom_reward_function("nowhere.py")
    path = _write(tmp_path, "def helper(x):\n    return x\nVALUE = 3\n")
    missing = r"name='compute_score' is not a function in .*defined there: \['helper'\]"
    with pytest.raises(AttributeError, match=missing):
        load_custom_reward_function(path)
    signature = r"helper must accept \(data_source, solution_str, ground_truth, extra_info=None\)"
    with pytest.raises(TypeError, match=signature):
        load_custom_reward_function(path, "helper")


def test_rule_kwargs_reach_the_builtin_rule():
    from meshrl.rewards.dispatch import RewardSpec

    fn = RewardSpec(reward_kwargs={"method": "strict", "format_score": 0.1}).build()
    assert fn("mawps", "so #### 41", "43") == 0.1  # well-formed, wrong: partial credit
    assert fn("mawps", "so #### 43", "43") == 1.0
    assert fn("mawps", "the answer is 43", "43") == 0.0  # strict: no "####", no credit
    assert RewardSpec().build()("mawps", "the answer is 43", "43") == 1.0  # default stays flexible
