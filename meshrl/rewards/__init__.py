"""Rule rewards (GSM8K, MATH via math-verify), dispatch by ``data_source``, and a process pool with timeouts."""

from meshrl.rewards.dispatch import RewardSpec, default_compute_score, load_custom_reward_function
from meshrl.rewards.pool import RewardBatch, RewardPool

__all__ = ["RewardBatch", "RewardPool", "RewardSpec", "default_compute_score", "load_custom_reward_function"]
