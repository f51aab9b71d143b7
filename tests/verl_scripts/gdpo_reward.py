"""A GDPO reward function for GSM8K-like data, the swap for a verl script's own reward file.

verl's GDPO script (``examples/gdpo_trainer/run_qwen3_8b_fsdp.sh``) points ``reward.custom_reward_function.path`` at
verl's ``rlla.py`` (tool-call data) and names the two components its returned dict holds beside ``score`` in
``algorithm.gdpo_reward_keys=[accuracy_reward, format_reward]``. A reward file is a path a user swaps, as the model
and the data are: this one scores GSM8K rows in verl's dict form, with the same two components.

- ``accuracy_reward``: 1.0 when the answer after the last ``####`` equals the ground truth, else 0.0 (meshrl's GSM8K
  rule, ``meshrl.rewards.gsm8k``, strict extraction);
- ``format_reward``: 1.0 for a ``#### <number>`` answer line, 0.5 for a number anywhere without one, else 0.0;
- ``score``: their sum, as rlla.py sums its components.
"""

from __future__ import annotations

from meshrl.rewards import gsm8k


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict[str, float]:
    accuracy = gsm8k.compute_score(solution_str, ground_truth, method="strict")
    if gsm8k.extract_answer(solution_str, "strict") is not None:
        form = 1.0
    elif gsm8k.extract_answer(solution_str, "flexible") is not None:
        form = 0.5
    else:
        form = 0.0
    return {"score": accuracy + form, "accuracy_reward": accuracy, "format_reward": form}
