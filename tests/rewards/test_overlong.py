"""verl's dapo reward manager: DAPO's overlong penalty (``meshrl.rewards.overlong``) and its arguments' checks
(``meshrl.config.reward_kwargs``); in the trainer: tests/trainer/test_trainer_loop.py."""

from __future__ import annotations

import pytest
import torch

from meshrl.config import ConfigError, load_config
from meshrl.config.validate import validate_config
from meshrl.rewards.overlong import OverlongBuffer, overlong_buffer

# verl's DAPO scripts' form, at a small size
DAPO = ["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=True", "+reward.reward_kwargs.max_resp_len=16"]


def test_the_penalty_is_zero_up_to_the_buffer_then_linear_to_minus_the_factor():
    buffer = OverlongBuffer(max_resp_len=16, length=4, penalty_factor=0.5, log=False)
    got = buffer.penalty(torch.tensor([3, 12, 13, 14, 16]))
    # 12 = 16 - 4 tokens: no penalty; each token past it costs 0.5 / 4; at 16, -0.5
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def test_verls_dapo_script_keys_configure_it_and_the_older_section_too():
    cfg = load_config(DAPO, recipe="cpu_tiny_grpo")
    validate_config(cfg)
    assert overlong_buffer(cfg) == OverlongBuffer(16, 4, 0.5, True)
    older = [k.replace("reward.reward_kwargs", "reward_model.reward_kwargs") for k in DAPO]
    assert overlong_buffer(load_config(older, recipe="cpu_tiny_grpo")) == OverlongBuffer(16, 4, 0.5, True)
    off = load_config([*DAPO[:1], "+reward.reward_kwargs.overlong_buffer_cfg.enable=False"], recipe="cpu_tiny_grpo")
    validate_config(off)
    assert overlong_buffer(off) is None


@pytest.mark.parametrize("overrides, message", [
    (DAPO[1:], "read by the dapo manager only"),  # the naive manager reads no reward_kwargs
    ([*DAPO, "+reward.reward_kwargs.overlong_bufer=1"], "overlong_bufer: not an argument of the dapo reward manager"),
    ([*DAPO, "+reward.reward_kwargs.overlong_buffer_cfg.lenght=2"], "lenght: not a key of DAPO's overlong buffer"),
    ([*DAPO[:-1]], "max_resp_len: required"),
    ([*DAPO, "reward.reward_kwargs.overlong_buffer_cfg.len=0"], "len: must be > 0"),
    ([*DAPO, "reward.reward_kwargs.max_resp_len=2"], "max_resp_len: must be >= overlong_buffer_cfg.len (4)"),
    ([*DAPO, "+reward_model.reward_kwargs.max_resp_len=8"], "both set, to different values"),
])
def test_its_arguments_are_checked_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(load_config(overrides, recipe="cpu_tiny_grpo"))
