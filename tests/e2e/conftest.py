"""End-to-end helpers: run the real trainer (Ray + Megatron worker + vLLM engine) on the tiny model."""

from pathlib import Path

import pytest
from e2e_checks import steps_of

from meshrl.config import load_config
from meshrl.config.validate import validate_config

# A reward with spread on a random model (real rewards are all 0 there, which would leave the
# advantages, and so every gradient, at zero): the fraction of distinct characters in the response.
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(set(solution_str)) / max(len(solution_str), 1)
'''

# 64 of GSM8K's 7,473 training prompts: a run tokenizes only those (~2 s less per run; a test's own value wins).
SMALL_DATA = ["data.train_max_samples=64"]


@pytest.fixture
def train(tmp_path):
    """``train(*overrides) -> (final metrics, per-step metrics)`` for the tiny recipe in ``tmp_path``."""
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)

    def run(*overrides, run_dir: Path | None = None, recipe: str = "cpu_tiny_grpo"):
        from meshrl.trainer.main import run as run_training

        run_dir = run_dir or tmp_path / "run"
        cfg = load_config([f"trainer.default_local_dir={run_dir}", f"custom_reward_function.path={reward}",
                           *SMALL_DATA, *overrides], recipe=recipe)
        final = run_training(cfg, validate_config(cfg))
        return final, steps_of(run_dir)

    return run
