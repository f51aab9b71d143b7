"""The policy worker driven in-process (``worker_checks.py``: one fresh process per parameter dtype, ~15 s
each): asserts on its results."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"worker_checks_{request.param}") / "results.json"
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    run = subprocess.run([sys.executable, str(HERE / "worker_checks.py"), "--out", str(out), "--dtype", request.param],
                         env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return {"dtype": request.param, **json.loads(out.read_text())}


def test_on_policy_update_equals_the_update_on_recomputed_log_probs(results):
    r = results["on_policy"]
    assert r["recompute_returns_nothing"] and r["returned_shape_ok"]
    # logπ_θ.detach() in place of the recomputed logπ_old: the same loss and gradient (bitwise here;
    # fp32 rounding is all that could differ)
    assert r["loss_diff"] <= 1e-6 * abs(r["pg_loss"]) + 1e-7
    assert r["grad_diff"] <= 1e-6 * r["grad_max_abs"]
    assert r["grad_norm_diff"] <= 1e-6
    # the log-probs handed back are the policy's before the step, zero outside the responses
    assert r["returned_vs_recomputed"] <= 1e-6
    assert r["returned_outside_mask"] == 0.0


def test_sum_pi_squared_comes_with_the_old_log_probs_when_asked(results):
    r = results["sum_pi_squared"]
    assert r["off_by_default"] and r["shape_ok"] and r["outside_mask"] == 0.0
    assert 0 < r["min"] and r["max"] <= 1 + 1e-6 and r["below_token_p_squared"] <= 1e-6
    assert r["fused_vs_unfused"] <= (1e-6 if results["dtype"] == "float32" else 1e-3), r
    assert r["log_probs_changed"] == 0.0


def test_the_kept_version_weights_give_their_log_probs_and_leave_the_policys_own(results):
    r = results["version_weights"]
    assert r["version_vs_kept"] == 0.0 and r["weights_put_back"] == 0.0  # copies both ways: bit for bit
    assert r["moved_vs_kept"] > 1e-3  # the policy moved: the check could fail


def test_parameter_dtype_and_mixed_precision_optimizer(results):
    r, dtype = results["precision"], f"torch.{results['dtype']}"
    assert r["param_dtypes"] == [dtype] and r["ref_param_dtypes"] == [dtype]  # norms included
    assert r["grad_dtypes"] == ["torch.float32"] and r["adam_state_dtypes"] == ["torch.float32"]
    if results["dtype"] == "bfloat16":
        # megatron's mixed precision: an fp32 main copy of every parameter, updated, copied back
        assert r["optimizer"] == "Float16OptimizerWithFloat16Params"
        assert r["main_param_dtypes"] == ["torch.float32"] and r["main_params"] > 0
    else:
        assert r["optimizer"] == "FP32Optimizer" and r["main_params"] == 0
    assert r["loss_scale"] == 1.0 and r["weights_moved"] > 0
    assert r["grad_norm"] > 0 and r["loss"] == r["loss"]


def test_log_probs_are_fp32_and_close_to_the_fp32_model(results):
    r = results["precision"]
    assert r["log_prob_dtype"] == "torch.float32"
    assert r["ref_vs_actor"] == 0.0  # the reference follows the actor's dtype: step-1 KL stays exactly 0
    if results["dtype"] == "float32":
        assert r["log_prob_vs_fp32_max"] == 0.0
    else:
        # tiny Llama, 49k vocabulary, log-probs near -10.8: measured max 0.027, mean 0.008 (bf16 weights
        # and activations; the log-softmax itself runs in fp32)
        assert r["log_prob_vs_fp32_max"] < 0.06 and r["log_prob_vs_fp32_mean"] < 0.02


def test_checkpoint_round_trip(results):
    assert results["checkpoint"] == {"weights": 0.0, "main_params": 0.0}


def assert_same_results(r: dict, dtype: str, loss_floor: float = 0.0) -> None:
    """Two runs of the same update (``worker_checks.differences``) agree: to fp32 rounding, or in bf16 up to the
    rounding of other matmul shapes (measured 4e-3 of the largest gradient)."""
    if dtype == "float32":
        assert r["log_prob_diff"] <= 1e-5
        assert r["loss_diff"] <= 1e-6 * abs(r["loss"]) + loss_floor
        assert r["grad_diff"] <= 1e-5 * r["grad_max_abs"]
    else:
        assert r["log_prob_diff"] <= 0.05
        assert r["loss_diff"] <= 1e-3 * abs(r["loss"])
        assert r["grad_diff"] <= 2e-2 * r["grad_max_abs"]


def test_fixed_size_micro_batches_without_dynamic_bsz(results):
    """use_dynamic_bsz=False with ppo_micro_batch_size_per_gpu=k: ⌈rows / k⌉ micro-batches of at most k, and
    the loss and gradient of the token-budget split (the global normaliser does not depend on the split)."""
    r = results["fixed_micro_batches"]
    assert r["micro_batches"] == -(-r["rows"] // r["k"]) and r["samples_max"] <= r["k"]
    assert r["dynamic_micro_batches"] != r["micro_batches"]
    assert r["log_prob_micro_batches"] == -(-r["rows"] // r["log_prob_k"])  # rollout.log_prob_micro_batch_size_per_gpu
    # measured in fp32: loss 5e-8, gradient 6e-8 of 0.22, log-probs 2e-6
    assert_same_results(r, results["dtype"])


def test_remove_padding_packs_micro_batches_with_the_row_layouts_results(results):
    """use_remove_padding=True (verl's default): every forward packs; log-probs, loss and gradient equal
    the row layout's (fp32), up to bf16 rounding of other matmul shapes."""
    r = results["remove_padding"]
    assert r["configured"] is True and r["packed_forwards"] == r["forwards"] > 0 and r["row_forwards_packed"] == 0
    assert_same_results(r, results["dtype"], loss_floor=1e-7)


def test_shared_prompts_are_on_by_default_and_give_the_unshared_results_for_fewer_tokens(results):
    """actor.use_prefix_grouper unset: the worker shares a prompt between its responses (3 per prompt here): fewer
    tokens computed, the same log-probs, loss and gradient (fp32), up to bf16 rounding of other matmul shapes."""
    r = results["shared_prompts"]
    assert r["configured"] is True and 0 < r["tokens_shared"] < r["tokens_unshared"]
    assert_same_results(r, results["dtype"], loss_floor=1e-7)


def verl_cosine_lr(step: int, lr: float, min_lr_ratio: float, warmup_ratio: float, total: int) -> float:
    """verl's learning rate at RL step ``step`` (0-based) for ``warmup_style=cosine``, written from its
    definition: linear warm-up from 0 over int(ratio·total) steps, then a half cosine to lr·min_lr_ratio."""
    warmup = int(warmup_ratio * total)
    if step < warmup:
        return lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return lr * max(min_lr_ratio, (1 + min_lr_ratio) / 2 + (1 - min_lr_ratio) / 2 * math.cos(math.pi * progress))


def test_lr_schedule_steps_once_per_rl_step(results):
    """Every optimizer step of RL step k (two mini-batches × two epochs here) uses verl's lr(k): the
    schedule is sized in RL steps, so stepping it per mini-batch would run it four times too fast."""
    r = results["lr_schedule"]
    expected = [verl_cosine_lr(k, r["lr"], r["min_lr_ratio"], r["warmup_ratio"], r["total"]) for k in range(r["total"])]
    assert len(set(expected)) == r["total"]  # warm-up, peak and decay are all visited
    for k, lrs in enumerate(r["per_optimizer_step"]):
        assert len(lrs) == 4
        assert lrs == pytest.approx([expected[k]] * 4, rel=1e-9, abs=1e-15)
    assert r["logged"] == pytest.approx(expected, rel=1e-9, abs=1e-15)
