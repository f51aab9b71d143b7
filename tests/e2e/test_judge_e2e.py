"""A generative reward model end to end: one GRPO step of the tiny policy scored by an LLM judge (the embedded
SmolLM2-135M-Instruct served by vLLM's OpenAI server, started and stopped by the run) through the shipped example
function ``recipes/rewards/llm_judge.py``, async, with verl's ``reward_router_address`` / ``reward_model_tokenizer``.

Independent check: each judge reply the function received equals transformers' own greedy generation for the same
chat messages (fp32: vLLM's greedy tokens are HF's). Afterwards the server is gone (its port refuses), and so is its
shared memory."""

import json
import os
import socket
from pathlib import Path

import pytest
from run_sandbox import SHM, _mapped_inodes

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12

# The shipped function, wrapped to log what it asked and what the judge answered.
WRAPPER = f'''
import importlib.util, json

_spec = importlib.util.spec_from_file_location("llm_judge_under_test", {str(REPO / "recipes/rewards/llm_judge.py")!r})
judge = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(judge)


async def compute_score(data_source, solution_str, ground_truth, extra_info=None, log_file=None, **kwargs):
    out = await judge.compute_score(data_source, solution_str, ground_truth, extra_info, rule_weight=0.0,
                                    max_tokens={MAX_TOKENS}, **kwargs)
    problem = (extra_info or {{}}).get("question") or ""
    with open(log_file, "a") as f:
        f.write(json.dumps({{"messages": judge.judge_messages(problem, solution_str), "reply": out["judge_response"],
                            "address": kwargs["reward_router_address"],
                            "tokenizer": kwargs["reward_model_tokenizer"].name_or_path}}) + "\\n")
    return out
'''


def _shipped():
    import importlib.util

    spec = importlib.util.spec_from_file_location("llm_judge_shipped", REPO / "recipes/rewards/llm_judge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_grpo_step_scored_by_a_served_judge(train, tmp_path):
    from meshrl.models.resolve import resolve_model_path

    shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()
    function, log = tmp_path / "judge_reward.py", tmp_path / "judge_calls.jsonl"
    function.write_text(WRAPPER)
    _, steps = train(
        f"custom_reward_function.path={function}", f"+custom_reward_function.reward_kwargs.log_file={log}",
        "reward_model.enable=True", "reward_model.model.path=embedded:smollm2", "reward_model.timeout_s=300",
        "reward_model.rollout.dtype=float32", "reward_model.rollout.tensor_model_parallel_size=1",
        "reward_model.rollout.prompt_length=1024", "reward_model.rollout.response_length=64",
        "reward_model.rollout.kv_cache_memory_bytes=268435456", "reward_model.rollout.max_num_seqs=16",
        "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=False",
        run_dir=tmp_path / "run")
    step = steps[1]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 8  # 4 prompts x 2 responses, each judged once
    assert step["reward/num_errors"] == 0 and step["reward/num_timeouts"] == 0
    folder = str(resolve_model_path("embedded:smollm2"))
    assert {c["tokenizer"] for c in calls} == {folder}
    # the step's scores are the judge's verdicts (rule_weight 0): their mean, and the parsed ones counted
    verdicts = [_shipped().parse_verdict(c["reply"]) for c in calls]
    assert step["score/mean"] == pytest.approx(sum(v or 0.0 for v in verdicts) / len(verdicts), abs=1e-6)
    assert step.get("reward/num_judge_parsed", 0.0) == sum(v is not None for v in verdicts)

    # transformers' greedy generation for the same messages gives the replies the served judge gave
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    for call in calls[:3]:
        ids = tokenizer.apply_chat_template(call["messages"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == call["reply"], call

    # the run stopped its server: nothing answers at its address any more
    host, port = calls[0]["address"].split(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
        pass
    assert (tmp_path / "run" / "logs" / "reward-judge.log").is_file()
    # nor any of its shared memory (vLLM's server force-kills its engine core and worker, whose message queues stayed)
    if SHM.is_dir():
        mapped = _mapped_inodes(set())
        left = [n for n in set(os.listdir(SHM)) - shm_before
                if n.startswith(("psm_", "sem.mp-")) and (SHM / n).exists() and (SHM / n).stat().st_ino not in mapped]
        assert left == [], left
