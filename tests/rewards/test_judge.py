"""The generative reward model's plumbing (``meshrl.rewards.judge``, ``meshrl.config.reward_model_kind``) and async
reward functions in the pool. The served judge itself is checked end to end in ``tests/e2e/test_judge_e2e.py``."""

import json
import textwrap
from pathlib import Path

import pytest

from meshrl.config import ConfigError, load_config
from meshrl.config.reward_model_kind import DISCRIMINATIVE, GENERATIVE, judge_rollout, reward_model_kind
from meshrl.config.validate import validate_config
from meshrl.rewards.dispatch import JudgeSettings, RewardSpec
from meshrl.rewards.judge import accepts_judge_arguments, judge_problems, judge_server
from meshrl.rewards.pool import RewardPool
from meshrl.config.refusals import Checked, refuse
from meshrl.trainer.main import reward_function

ASYNC_REWARD = '''
import asyncio, os, time

async def compute_score(data_source, solution_str, ground_truth, extra_info=None, pause=0.2):
    if solution_str == "hang":
        await asyncio.sleep(60)
    start = time.monotonic()
    await asyncio.sleep(pause)
    return {"score": float(len(solution_str)), "start": start, "end": time.monotonic(), "pid": os.getpid()}
'''

JUDGE_REWARD = '''
async def compute_score(data_source, solution_str, ground_truth, extra_info=None, reward_router_address=None,
                        reward_model_tokenizer=None):
    return {"score": 1.0, "address": reward_router_address, "tokenizer": reward_model_tokenizer.name_or_path}
'''


def _file(tmp_path: Path, text: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    depth = best = 0
    for _, step in events:
        depth += step
        best = max(best, depth)
    return best


@pytest.mark.parametrize("workers", [0, 2])
def test_an_async_reward_function_runs_its_calls_concurrently(tmp_path, workers):
    spec = RewardSpec(_file(tmp_path, ASYNC_REWARD, f"async_{workers}.py"))
    with RewardPool(spec, num_workers=workers, timeout_s=30) as pool:
        solutions = [f"{'x' * (i + 1)}" for i in range(8)]
        result = pool.score(["d"] * 8, solutions, [""] * 8)
    assert result.scores == [float(len(s)) for s in solutions]  # in input order
    assert result.metrics["reward/num_errors"] == 0
    # one chunk per worker (8 / workers calls), all of its calls in flight at once: a sequential loop never
    # overlaps two calls (a worker that starts late takes the second chunk after the first: no more overlap)
    spans = list(zip(result.extras["start"], result.extras["end"]))
    assert _max_overlap(spans) >= 8 // max(workers, 1)


def test_an_async_call_past_the_limit_times_out_inside_the_worker(tmp_path):
    spec = RewardSpec(_file(tmp_path, ASYNC_REWARD, "async_hang.py"))
    with RewardPool(spec, num_workers=1, timeout_s=1.0) as pool:
        result = pool.score(["d"] * 3, ["ab", "hang", "abc"], [""] * 3)
        assert result.scores == [2.0, 0.0, 3.0]
        assert result.metrics["reward/num_timeouts"] == 1
        assert pool.totals["num_worker_restarts"] == 0  # the event loop cut the call; the worker lives on


def test_judge_settings_reach_every_call(tmp_path):
    from meshrl.models.resolve import resolve_model_path

    folder = str(resolve_model_path("tiny:llama"))
    spec = RewardSpec(_file(tmp_path, JUDGE_REWARD, "judge_fn.py"), judge=JudgeSettings("127.0.0.1:9", folder))
    with RewardPool(spec, num_workers=1, timeout_s=30) as pool:
        result = pool.score(["d"] * 2, ["a", "b"], [""] * 2)
    assert result.extras["address"] == ["127.0.0.1:9"] * 2
    assert result.extras["tokenizer"] == [folder] * 2


def _cfg(tmp_path, *overrides):
    fn = _file(tmp_path, JUDGE_REWARD, "judge_cfg.py")
    return load_config([f"custom_reward_function.path={fn}", "reward_model.enable=True", *overrides],
                       recipe="cpu_tiny_grpo")


def test_the_checkpoint_and_the_function_decide_the_reward_model_kind(tmp_path):
    assert reward_model_kind(_cfg(tmp_path, "reward_model.model.path=embedded:smollm2")) == GENERATIVE
    assert reward_model_kind(_cfg(tmp_path, "reward_model.model.path=tiny-rm:llama")) == DISCRIMINATIVE
    assert reward_model_kind(_cfg(tmp_path, "reward_model.model.path=embedded:smollm2",
                                  "custom_reward_function.path=null")) == DISCRIMINATIVE
    folder = tmp_path / "causal"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert reward_model_kind(_cfg(tmp_path, f"reward_model.model.path={folder}")) == GENERATIVE
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"]}))
    assert reward_model_kind(_cfg(tmp_path, f"reward_model.model.path={folder}")) == DISCRIMINATIVE


def test_a_judge_run_has_no_megatron_reward_role_and_reads_the_rollout_keys(tmp_path):
    plan = validate_config(_cfg(tmp_path, "reward_model.model.path=embedded:smollm2",
                                "reward_model.rollout.max_num_seqs=8"))
    assert plan.reward_judge and not plan.use_reward_model
    assert "reward_judge" in plan.roles and "reward_model" not in plan.roles
    assert not [w for w in plan.warnings if "reward_model.rollout" in w]
    # the same key in a run with a discriminative model is named as having no effect
    plan = validate_config(_cfg(tmp_path, "reward_model.model.path=tiny-rm:llama",
                                "reward_model.rollout.max_num_seqs=8"))
    assert plan.use_reward_model and not plan.reward_judge
    assert [w for w in plan.warnings if "reward_model.rollout.max_num_seqs=8" in w]


def test_the_server_command_follows_verl_keys_in_either_home(tmp_path):
    cfg = _cfg(tmp_path, "reward_model.model.path=embedded:smollm2", "reward.reward_model.rollout.dtype=float32",
               "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.rollout.prompt_length=512",
               "reward_model.rollout.response_length=64", "reward_model.rollout.enable_prefix_caching=False",
               "reward_model.rollout.kv_cache_memory_bytes=268435456",
               "+reward_model.rollout.engine_kwargs.vllm.max_logprobs=5")
    assert judge_problems(cfg) == []
    cmd = judge_server(cfg, "/models/judge").command(port=1234)
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--dtype"] == "float32"  # from reward.reward_model.rollout (verl's newer home)
    assert flags["--tensor-parallel-size"] == "1" and flags["--max-model-len"] == "576"
    assert flags["--kv-cache-memory-bytes"] == "268435456" and "--gpu-memory-utilization" not in flags
    assert flags["--max-logprobs"] == "5" and flags["--port"] == "1234"
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--served-model-name") + 1:cmd.index("--host")] == ["embedded:smollm2", "/models/judge"]


def test_judge_settings_meshrl_cannot_serve_are_refused(tmp_path):
    cfg = _cfg(tmp_path, "reward_model.model.path=embedded:smollm2", "reward_model.rollout.name=sglang",
               "reward_model.rollout.skip_tokenizer_init=True", "reward_model.rollout.load_format=dummy",
               "reward_model.rollout.tensor_model_parallel_size=1",
               "reward.reward_model.rollout.tensor_model_parallel_size=4")
    problems = "\n".join(judge_problems(cfg))
    for expected in ("name=sglang", "skip_tokenizer_init=True", "load_format=dummy",
                     "reward_model.rollout.tensor_model_parallel_size=1, reward.reward_model.rollout."):
        assert expected in problems
    values, _ = judge_rollout(_cfg(tmp_path, "reward.reward_model.rollout.max_num_seqs=3"))
    assert values["max_num_seqs"] == 3


def test_a_judge_function_must_take_verls_arguments(tmp_path):
    plain = _file(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                            "    return 0.0\n", "plain.py")
    with pytest.raises(ConfigError, match="reward_router_address and reward_model_tokenizer"):
        check_reward_function(_cfg(tmp_path, "reward_model.model.path=embedded:smollm2",
                                   f"custom_reward_function.path={plain}"))
    # the same function beside a discriminative model is fine (it reads extra_info["rm_score"])
    check_reward_function(_cfg(tmp_path, "reward_model.model.path=tiny-rm:llama",
                               f"custom_reward_function.path={plain}"))
    assert accepts_judge_arguments(lambda *a, **kw: 0.0)


def check_reward_function(cfg) -> None:
    """The launch stage's reward-function rule on ``cfg``, raising as the stage does."""
    refuse(reward_function(Checked(cfg)))
