"""Registries: built-in names, did-you-mean errors, user functions by "module:function", dispatch."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from meshrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_PENALTIES,
    POLICY_LOSSES,
    Registry,
    call_with_available,
    get_advantage_estimator,
    get_policy_loss,
    grpo,
)


def test_verl_names_are_registered() -> None:
    assert set(ADVANTAGE_ESTIMATORS.names()) >= {
        "gae", "grpo", "rloo", "remax", "gpg", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo",
        "grpo_passk",
    }  # fmt: skip
    assert set(POLICY_LOSSES.names()) >= {"vanilla", "gpg", "reinforce", "gspo", "cispo"}
    assert set(KL_PENALTIES.names()) >= {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert get_advantage_estimator("grpo") is grpo


def test_unknown_name_lists_available_and_suggests() -> None:
    with pytest.raises(ValueError) as error:
        get_advantage_estimator("grop")
    message = str(error.value)
    assert "Did you mean 'grpo'" in message
    assert "gae, gdpo, gpg, grpo" in message
    with pytest.raises(ValueError, match="Did you mean 'vanilla'"):
        get_policy_loss("vanila")


def test_user_function_by_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rl_methods.py").write_text(
        textwrap.dedent(
            """
            import torch

            def constant_advantage(token_rewards, response_mask, *, uid, value=2.0):
                return torch.where(response_mask.bool(), value, 0.0)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    estimator = get_advantage_estimator("my_rl_methods:constant_advantage")
    mask = torch.tensor([[1, 0]])
    result = call_with_available(estimator, torch.zeros(1, 2), mask, uid=torch.tensor([0]), gamma=0.9, value=3.0)
    assert result.tolist() == [[3.0, 0.0]]
    with pytest.raises(ValueError, match="did you mean 'constant_advantage'"):
        get_advantage_estimator("my_rl_methods:constant_advantages")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_advantage_estimator("no_such_module_xyz:f")


def test_register_decorator_and_duplicate_names() -> None:
    registry: Registry = Registry("test method")

    @registry.register("a", "alias")
    def method() -> int:
        return 1

    assert registry.get("alias") is registry.get("a") is method
    registry.register("a")(method)  # registering the same function again is harmless

    with pytest.raises(ValueError, match="already registered"):

        @registry.register("a")
        def other() -> int:
            return 2


def test_call_with_available_names_a_missing_input() -> None:
    with pytest.raises(ValueError, match="needs values"):
        call_with_available(get_advantage_estimator("gae"), torch.zeros(1, 2), torch.ones(1, 2), uid=torch.tensor([0]))
