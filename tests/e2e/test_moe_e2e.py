"""The seed's MoE script (verl's ``run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh``: PPO with GAE, a Qwen1.5-MoE policy
and critic at TP4 x PP2 started from Megatron dist checkpoints) trains one CPU step on ``tiny:qwen2_moe`` (its
shared expert and gate, Qwen1.5-MoE's unnormalised top-k weights) with only paths and sizes swapped, as
``test_verl_scripts`` swaps them; the script's own step 1 (convert the HF model to a Megatron checkpoint) is
``meshrl convert hf-to-mcore``, once for the policy and once for the critic. The engine's step-1 log-probs must
be the trainer's: the experts came through the resharding into vLLM's fused-MoE layers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_verl_scripts import swapped, vendored_args

from meshrl.config import load_config
from meshrl.trainer.main import parse_args, preflight

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.usefixtures("ray_session")]

SCRIPT = ("volcengine/verl", "examples/ppo_trainer/run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh")
MODEL = "tiny:qwen2_moe"


def test_the_seeds_moe_script_trains_one_cpu_step(tmp_path: Path) -> None:
    from meshrl.models.resolve import resolve_model_path
    from meshrl.trainer.main import run

    hf_dir = resolve_model_path(MODEL)
    checkpoints = {}
    for role, flags in (("actor_rollout_ref", []), ("critic", ["--critic"])):
        checkpoints[role] = tmp_path / f"mcore-{role}"
        subprocess.run([sys.executable, "-m", "meshrl.parallel.convert_cli", "hf-to-mcore", "--hf", str(hf_dir),
                        "--out", str(checkpoints[role]), *flags], check=True, capture_output=True)
    args = []
    for arg in swapped(vendored_args(*SCRIPT), tmp_path / "run", MODEL):
        key = arg.partition("=")[0]
        if key.endswith("megatron.dist_checkpointing_path"):
            arg = f"{key}={checkpoints[key.split('.')[0]]}"
        args.append(arg)
    recipe, overrides = parse_args(args)
    cfg = load_config(overrides, recipe=recipe)
    plan = preflight(cfg)
    final = run(cfg, plan)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert plan.use_critic and step["step"] == 1
    assert final["actor/optimizer_steps"] >= 1 and step["critic/optimizer_steps"] >= 1
    assert step["rollout/log_prob_max_abs_diff"] < 1e-3


# Megatron EP2 (the two ranks hold four experts each, tokens exchanged all-to-all) -> a TP2 vLLM engine on the same
# two ranks, with a KL loss (the reference runs at EP2 too), megatron's load-balancing loss through verl's keys and
# router replay (R2: the old-log-prob pass records each token's experts, both mini-batches' updates replay them).
EP2 = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
       "actor_rollout_ref.actor.megatron.router_replay.mode=R2",
       "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2",
       "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.total_training_steps=1",
       "trainer.test_freq=-1", "trainer.val_before_train=False", "actor_rollout_ref.actor.use_kl_loss=True",
       "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_load_balancing_type=aux_loss",
       "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01"]


def test_one_grpo_step_through_megatron_ep2_and_vllm_tp2(train, tmp_path: Path) -> None:
    _, steps = train(f"actor_rollout_ref.model.path={MODEL}", *EP2, run_dir=tmp_path / "ep2")
    step = steps[1]
    assert step["rollout/log_prob_max_abs_diff"] < 1e-3, step["rollout/log_prob_max_abs_diff"]
    assert step["actor/ref_log_prob_max_abs_diff"] < 1e-5  # the reference is the policy's exact copy at step 1
    assert step["actor/grad_norm"] > 0 and step["actor/optimizer_steps"] == 2
    # the routes came back from the old-log-prob pass, through the driver, into both updates' routers
    assert 0.0 <= step["actor/replayed_route_changes"] <= 1.0
