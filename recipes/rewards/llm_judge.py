"""An LLM-judge reward in verl's GenRM form: point ``custom_reward_function.path`` here and ``reward_model.model.path``
at a chat model, with ``reward_model.enable=True`` (``meshrl.rewards.judge`` serves it and passes
``reward_router_address`` / ``reward_model_tokenizer`` to every call).

Score = ``rule_weight`` x the built-in rule reward of the row's data source (GSM8K, MATH, ...; skipped at 0) +
(1 - ``rule_weight``) x the judge's 0-10 verdict / 10 (0 when the reply holds no number from 0 to 10). Set both
through ``custom_reward_function.reward_kwargs`` (``rule_weight``, ``max_tokens``). Extra outputs per response:
``judge_score`` (the verdict / 10, None when unparsed), ``judge_parsed``, ``judge_response`` (the reply).
"""

import re

from meshrl.rewards.dispatch import default_compute_score
from meshrl.rewards.judge import chat_complete

TEMPLATE = """You are given a problem and a proposed solution.

Problem:
{problem}

Solution:
{solution}

Is the solution correct? Give a score from 0 to 10, where 0 means wrong or irrelevant and 10 means fully correct \
and well reasoned. Reply with the score only."""


def judge_messages(problem: str, solution: str) -> list[dict]:
    return [{"role": "user", "content": TEMPLATE.format(problem=problem, solution=solution)}]


def parse_verdict(reply: str) -> float | None:
    """The last whole number from 0 to 10 in ``reply``, divided by 10; None when there is none."""
    numbers = [int(n) for n in re.findall(r"(?<![\d.])\d{1,2}(?![\d.])", reply) if int(n) <= 10]
    return numbers[-1] / 10 if numbers else None


async def compute_score(data_source, solution_str, ground_truth, extra_info=None, reward_router_address=None,
                        reward_model_tokenizer=None, rule_weight: float = 0.5, max_tokens: int = 16):
    problem = (extra_info or {}).get("question") or (extra_info or {}).get("prompt") or ""
    request = {"messages": judge_messages(problem, solution_str), "temperature": 0.0, "max_tokens": max_tokens}
    reply = await chat_complete(reward_router_address, request)
    text = reply["choices"][0]["message"]["content"] or ""
    verdict = parse_verdict(text)
    score = (1 - rule_weight) * (verdict or 0.0)
    if rule_weight:
        rule = default_compute_score(data_source, solution_str, ground_truth, extra_info)
        score += rule_weight * float(rule["score"] if isinstance(rule, dict) else rule)
    return {"score": score, "judge_score": verdict, "judge_parsed": verdict is not None, "judge_response": text}
