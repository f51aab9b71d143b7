"""GSM8K reward: every real reference answer scores 1.0 against its own ground truth; extraction edge cases."""

from __future__ import annotations

import pytest

from meshrl.data.preprocess import build_rows
from meshrl.rewards.gsm8k import compute_score, extract_answer


@pytest.mark.parametrize("split", ["test", "train"])
def test_all_reference_answers_score_one(split: str) -> None:
    rows = build_rows("gsm8k", split)
    assert len(rows) == {"test": 1319, "train": 7473}[split]
    for row in rows:
        answer, truth = row["extra_info"]["answer"], row["reward_model"]["ground_truth"]
        assert compute_score(answer, truth) == 1.0, (row["extra_info"]["index"], answer[-40:], truth)
        assert compute_score(answer, truth, method="flexible") == 1.0
        assert compute_score(answer, str(int(float(truth)) + 1)) == 0.0


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so #### 1,234", "1234", "1234"),
        ("#### $5", "5", "5"),
        ("#### -7", "-7", "-7"),
        ("#### 3.25.", "3.25", "3.25"),
        ("first #### 1 then #### 2", "2", "2"),
        ("####42", "42", "42"),
        ("The answer is 12 apples, not 13", None, "13"),
        ("no digits at all", None, None),
        ("#### answer is 9", None, "9"),
        ("costs $1,000,000 in total", None, "1000000"),
    ],
)
def test_extraction(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_scores_follow_verl_semantics() -> None:
    assert compute_score("#### 18", "18") == 1.0
    assert compute_score("#### 17", "18") == 0.0
    assert compute_score("#### 17", "18", format_score=0.1) == 0.1
    assert compute_score("I think 18", "18", format_score=0.1) == 0.0  # nothing extracted: no format credit
    assert compute_score("#### 18", "18", score=2.0) == 2.0
    assert compute_score("#### 1,000", "1000") == 1.0
    assert compute_score("#### 18.00", "18") == 1.0
    assert compute_score("#### 18.00", "18", numeric=False) == 0.0  # verl's exact string comparison
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        extract_answer("#### 1", "lenient")  # type: ignore[arg-type]
