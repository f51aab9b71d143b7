"""verl's own example scripts train one CPU step with only paths and sizes swapped.

The argument lines are vendored (``tests/verl_scripts/arguments.json``, extracted from both verl mirrors by
``extract.py``). Swapped: the model and data paths (the tiny Llama, the packaged GSM8K), the hardware sizes (one CPU
process, parallel sizes 1; the process count also where a script leaves it at verl's default), the batch sizes, lengths
and token budgets the script sets (CPU-sized), the run length (one step, no validation, no checkpoint; 16 training
prompts loaded), where the run writes, the logger (``wandb`` is not installed here; console and jsonl instead), and
where verl's own config files live (a script's ``--config-path`` into verl's checkout and the tool config it names:
the vendored copies, ``classify.with_verl_files``). verl's SGLang engine, not installed here, becomes vLLM, meshrl's
(``ENGINE``). Everything else is the script's.
"""

import json
import re
from pathlib import Path

import pytest
from e2e_checks import geo3k_data, with_extended

from verl_scripts import classify

from meshrl.config import load_config
from meshrl.trainer.main import parse_args, preflight

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_session")]

VENDORED = Path(__file__).resolve().parents[1] / "verl_scripts" / "arguments.json"
SCRIPTS = {
    # current verl, Megatron GRPO at TP2 x PP2 with a KL loss (model_engine=megatron, no --config-name)
    "grpo_megatron": ("verl-project/verl", "examples/grpo_trainer/run_qwen3_8b_megatron.sh"),
    # early-2026 verl, Megatron PPO: critic, reference layout keys, --config-path/--config-name
    "ppo_megatron": ("volcengine/verl", "examples/ppo_trainer/run_deepseek_math_gsm8k_megatron.sh"),
    # current verl, an FSDP script (fsdp_config offload keys, gradient checkpointing) with CISPO's loss
    "cispo_fsdp": ("verl-project/verl", "examples/cispo_trainer/run_qwen3_8b_fsdp.sh"),
    # the family scripts, each on the tiny model of its own family: PPO with a Gemma 2 policy and critic (soft-
    # capping, sliding-window layers, GeGLU) unpadded; GRPO with a KL loss on Qwen3 (q/k norms) packed
    "gemma2_ppo": ("volcengine/verl", "examples/ppo_trainer/run_gemma.sh", "tiny:gemma2"),
    "qwen3_grpo": ("volcengine/verl", "examples/grpo_trainer/run_qwen3-8b.sh", "tiny:qwen3"),
    # PPO scored by a learned reward model (verl's reward-loop keys, reward_model.rollout.*) on a tiny one
    "rm_ppo": ("volcengine/verl", "examples/ppo_trainer/run_qwen2-7b_rm.sh"),
    # LoRA with verl's FSDP keys (lora_rank, target_modules=all-linear) and with its Megatron keys (model.lora.*)
    "lora_fsdp": ("volcengine/verl", "examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh"),
    "lora_megatron": ("volcengine/verl", "examples/grpo_trainer/run_qwen2-7b_math_megatron_lora.sh"),
    # the same at inference TP2 (two ranks, one engine across them): vLLM slices the synced adapters per TP rank
    "lora_megatron_rollout_tp2": ("volcengine/verl", "examples/grpo_trainer/run_qwen2-7b_math_megatron_lora.sh"),
    # current verl's method scripts (FSDP keys): GDPO (its reward file swapped for tests/verl_scripts/gdpo_reward.py,
    # GSM8K in verl's dict form with the two components the script names), GMPO's geometric-mean loss, GSPO, the
    # optimal token baseline (Σπ² from the old-log-prob pass), SAPO on Qwen3 and on Qwen3-MoE
    "gdpo_fsdp": ("verl-project/verl", "examples/gdpo_trainer/run_qwen3_8b_fsdp.sh"),
    "gmpo_fsdp": ("verl-project/verl", "examples/gmpo_trainer/run_qwen3_8b_fsdp.sh"),
    "gspo_fsdp": ("verl-project/verl", "examples/gspo_trainer/run_qwen3_8b_fsdp.sh"),
    "otb_fsdp": ("verl-project/verl", "examples/otb_trainer/run_qwen3_8b_fsdp.sh"),
    "sapo_fsdp": ("verl-project/verl", "examples/sapo_trainer/run_qwen3_8b_fsdp.sh"),
    "sapo_moe_fsdp": ("verl-project/verl", "examples/sapo_trainer/run_qwen3_30b_a3b_fsdp.sh", "tiny:qwen3_moe"),
    # verl's rollout correction in bypass mode at one response per prompt (the scripts leave rollout.n at 1): RLOO
    # with sequence IS weights applied by the REINFORCE loss; GRPO under PPO's clip with token and sequence rejection
    "rollout_corr_rloo": ("verl-project/verl", "examples/rollout_correction/run_qwen2_5_7b_fsdp.sh"),
    "rollout_corr_multi_rs": ("verl-project/verl", "examples/rollout_correction/run_qwen2_5_7b_fsdp_multi_rs.sh"),
    # verl's asynchronous trainers' scripts (their entry modules: meshrl.trainer.one_step_off_main, fully_async_main):
    # one-step-off GRPO on GSM8K (FSDP keys, hybrid_engine=False, a rollout pool of its own); fully async GRPO with a
    # KL loss at Megatron TP2 (train_batch_size=0: the trainer's batch is ppo_mini_batch_size x require_batches) on the
    # tiny Qwen2.5-VL and Geometry3K-layout data: the rollouter generates from the images on the HF engine
    "one_step_off_fsdp": ("verl-project/verl",
                          "verl/experimental/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh"),
    "fully_async_megatron": ("verl-project/verl",
                             "verl/experimental/fully_async_policy/shell/geo3k_qwen25vl_7b_megatron_4_4.sh",
                             "tiny:qwen2_5_vl"),
    # one-step-off DAPO with verl's rollout correction in decoupled mode (sequence rejection, the old-log-prob pass):
    # the dapo reward manager's overlong penalty (its lengths CPU-sized like the others) and the policy's HF config
    # override (max_position_embeddings), which the trainer's model and the engine both take
    "one_step_off_dapo_ris": ("verl-project/verl",
                              "verl/experimental/one_step_off_policy/shell/dapo_7b_math_fsdp2_64_64_ris.sh"),
    # verl's Qwen2.5-VL GRPO on Geometry3K (FSDP keys, gradient checkpointing, vLLM with its image-cache switch) on
    # the tiny Qwen2.5-VL and Geometry3K-layout data: the HF engine stands in for vLLM on CPU, said at start
    "qwen25vl_fsdp": ("volcengine/verl", "examples/grpo_trainer/run_qwen2_5_vl-7b.sh", "tiny:qwen2_5_vl"),
    # its Megatron form: TP2 (swapped to 1), actor and reference from a converted checkpoint, offloads, a KL loss
    "qwen25vl_megatron": ("volcengine/verl", "examples/grpo_trainer/run_qwen2_5_vl-7b-megatron.sh",
                          "tiny:qwen2_5_vl"),
    # Qwen3-VL's FSDP script: gradient checkpointing over the deepstack layers (their features as checkpoint arguments)
    "qwen3vl_fsdp": ("verl-project/verl", "examples/grpo_trainer/run_qwen3_vl_8b_fsdp.sh", "tiny:qwen3_vl"),
    # verl's VL LoRA script: all-linear adapters on the language model, the tower excluded ('.*visual.*'), merged into
    # the HF engine's weights
    "qwen25vl_lora_fsdp": ("verl-project/verl", "examples/tuning/lora/run_qwen2_5_vl_7b_fsdp.sh", "tiny:qwen2_5_vl"),
    # verl's Geometry3K multi-turn tool scripts (--config-path into verl's examples: its chat template with tool calls
    # and image items, multi_turn, return_multi_modal_inputs=False; its Geo3kTool config), FSDP and Megatron forms,
    # on data from `meshrl preprocess geo3k_multiturn_w_tool`: every turn generated with the prompt's image
    "geo3k_multiturn_fsdp": ("volcengine/verl", "examples/sglang_multiturn/geo3k/run_qwen2.5-3b_geo3k_multiturn.sh",
                             "tiny:qwen2_5_vl"),
    "geo3k_multiturn_megatron": ("volcengine/verl",
                                 "examples/sglang_multiturn/geo3k/run_qwen2.5-3b_megatron_geo3k_multiturn.sh",
                                 "tiny:qwen2_5_vl"),
}
# the scripts whose data are images: Geometry3K-layout data (e2e_checks.geo3k_data) instead of GSM8K
IMAGES = {"qwen25vl_fsdp", "qwen25vl_megatron", "qwen3vl_fsdp", "qwen25vl_lora_fsdp", "geo3k_multiturn_fsdp",
          "geo3k_multiturn_megatron", "fully_async_megatron"}
# the multi-turn tool scripts' data: verl's geo3k_multiturn_w_tool layout (the tool's ground truth in each row)
MULTI_TURN = {"geo3k_multiturn_fsdp", "geo3k_multiturn_megatron"}
# verl's engines that are not installed here, and meshrl's engine in their place (the one swap beyond paths and sizes)
ENGINE = {"sglang": "vllm"}
ASYNC = {"one_step_off_fsdp": "one_step_off", "fully_async_megatron": "fully_async",
         "one_step_off_dapo_ris": "one_step_off"}
# verl's rollout-correction scripts run in bypass mode: the trainer computes no log-probs of its own to compare with
# the engine's (rollout/log_prob_*); the actor compares the policy it trains with the engine's (rollout_corr/kl, ...).
BYPASS = {"rollout_corr_rloo", "rollout_corr_multi_rs", "one_step_off_fsdp", "fully_async_megatron"}
# Swaps appended after the CPU sizes, by script name.
AFTER = {"lora_megatron_rollout_tp2": ["trainer.n_gpus_per_node=2",
                                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
         # its CP2 x VPP2 layout on one process (CP is refused for vision-language models: meshrl.parallel.
         # vision_language), and a prompt budget for the tool schema its template renders into the system message
         "geo3k_multiturn_megatron": [*(f"actor_rollout_ref.{role}.megatron.{key}" for role in ("actor", "ref")
                                        for key in ("context_parallel_size=1",
                                                    "virtual_pipeline_model_parallel_size=null")),
                                      "data.max_prompt_length=1024"],
         "geo3k_multiturn_fsdp": ["data.max_prompt_length=1024"]}
# `make test-extended` (see the Makefile); every script's arguments load and validate in the unit tests
# (tests/foundation/test_verl_features.py, test_verl_invocation.py for --config-path / --config-name). Qwen3's
# layers match HF at TP2 and PP2 (tests/parallel/test_parallel_multiproc.py) and reach vLLM (test_family_vllm.py); LoRA
# with verl's FSDP keys trains the adapters as lora_megatron does (the two key sets are mapped in
# tests/parallel/test_lora_keys.py); Megatron PPO's critic path is gemma2_ppo's and test_algorithms_e2e.py's PPO case's;
# CISPO's step is GRPO's with the loss checked against verl's in tests/algorithms/test_verl_reference.py, and the FSDP
# keys' warnings are the key-policy unit tests'.
# The adapters at inference TP2 take lora_megatron's path to the engine; only vLLM's slicing per TP rank is new.
# The one-step-off trainer trains in tests/e2e/test_async_e2e.py (three steps, each batch one version late), and its
# script's keys load and validate in the unit tests; one_step_off_dapo_ris runs an asynchronous trainer from a verl
# script through its entry module in make test; the fully async trainer trains in test_async_e2e.py (staleness 0 =
# the synchronous run) and fully_async_megatron's keys (train_batch_size=0 filled from require_batches) validate in the
# unit tests (test_verl_invocation.py, test_config.py); its images through the rollouter are only checked here.
# The method scripts: each loss and estimator is checked against verl's in tests/algorithms/test_verl_reference.py and
# trains GRPO's path (test_algorithms_e2e.py's grpo case); GDPO's reward components reach its estimator in
# tests/trainer/test_advantage_glue.py; rollout correction (IS, rejection, bypass mode) trains in
# test_algorithms_e2e.py's remax and ppo cases; Qwen3-MoE matches HF in tests/parallel/test_moe_parallel.py.
# verl's Qwen2.5-VL scripts: their model trains the same path in tests/e2e/test_vision_language_e2e.py (extended) and
# matches transformers in tests/parallel/test_parallel_multiproc.py (vision_language); their keys validate in the unit
# tests; LoRA on both VL models matches PEFT in tests/parallel/test_lora_vision_language.py. The Geometry3K multi-turn
# scripts: every turn sampled with the image and trained at transformers' positions in
# tests/rollout/test_agent_images.py, their keys (verl's config files, the template, the tool) pass preflight on the
# tiny Qwen2.5-VL in tests/foundation/test_verl_features.py.
EXTENDED = {"qwen25vl_fsdp", "qwen25vl_megatron", "qwen3vl_fsdp", "qwen25vl_lora_fsdp", "qwen3_grpo", "lora_fsdp",
            "ppo_megatron", "cispo_fsdp", "lora_megatron_rollout_tp2", "gdpo_fsdp", "gmpo_fsdp", "gspo_fsdp",
            "otb_fsdp", "sapo_fsdp", "sapo_moe_fsdp", "rollout_corr_rloo", "rollout_corr_multi_rs", "one_step_off_fsdp",
            "fully_async_megatron", "geo3k_multiturn_fsdp", "geo3k_multiturn_megatron"}
PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
# CPU sizes for the size keys a script sets (only those it sets: setting a key it leaves alone could
# conflict with its deprecated twin, e.g. ppo_micro_batch_size vs ppo_micro_batch_size_per_gpu).
SIZES = {
    r"data\.train_batch_size": "4", r".*ppo_mini_batch_size": "4", r".*micro_batch_size(_per_gpu)?": "2",
    r".*max_token_len_per_gpu": "2048", r"data\.max_prompt_length": "256", r"data\.max_response_length": "12",
    r"actor_rollout_ref\.rollout\.n": "2", r".*\.megatron\.(tensor|pipeline)_model_parallel_size": "1",
    r"actor_rollout_ref\.rollout\.tensor_model_parallel_size": "1", r"trainer\.n_gpus_per_node": "1",
    r"trainer\.nnodes": "1", r"reward_model\.rollout\.tensor_model_parallel_size": "1",
    r"rollout\.nnodes": "1", r"rollout\.n_gpus_per_node": "1",  # the asynchronous trainers' rollout pool
    # DAPO's overlong buffer: the last 4 of the 12 response tokens
    r"reward\.reward_kwargs\.max_resp_len": "12", r"reward\.reward_kwargs\.overlong_buffer_cfg\.len": "4",
}
MODEL_KEYS = r"(actor_rollout_ref|critic)\.model\.path"
# with a reward file of verl's repository swapped for meshrl's test reward (classify.PATH_SWAPS)
DATA = {r"data\.train_files": "embedded:gsm8k/train", r"data\.val_files": "embedded:gsm8k/test",
        r"reward_model\.model\.path": "tiny-rm:llama", **classify.PATH_SWAPS}


def vendored_script(mirror: str, path: str) -> dict:
    scripts = json.loads(VENDORED.read_text())["scripts"]
    (script,) = [s for s in scripts if s["mirror"] == mirror and s["path"] == path]
    return script


def vendored_call(mirror: str, path: str) -> tuple[str, list[str]]:
    """The script's verl entry module and its arguments."""
    (call,) = vendored_script(mirror, path)["calls"]
    return call["module"], call["args"]


def vendored_args(mirror: str, path: str) -> list[str]:
    return vendored_call(mirror, path)[1]


def swapped(args: list[str], run_dir: Path, model: str, data: dict[str, str] = DATA,
            sizes: dict[str, str] | None = None) -> list[str]:
    """The script's arguments with the model, data and sizes swapped (``sizes``: more size keys, pattern: value)."""
    swaps = {MODEL_KEYS: model, **data, **SIZES, **(sizes or {})}
    out = []
    for arg in args:
        key, sep, value = arg.lstrip("+").partition("=")
        replacement = next((v for pattern, v in swaps.items() if sep and re.fullmatch(pattern, key)), None)
        if key == "actor_rollout_ref.rollout.name" and value in ENGINE:
            replacement = ENGINE[value]
        out.append(arg if replacement is None else f"{key}={replacement}")
    # the machine's size where the script leaves verl's default (8 GPUs a node: verl's rollout-correction scripts)
    keys = {arg.lstrip("+").partition("=")[0] for arg in args}
    out += [f"{key}=1" for key in ("trainer.nnodes", "trainer.n_gpus_per_node") if key not in keys]
    return out + ["trainer.total_training_steps=1", "trainer.val_before_train=False", "trainer.test_freq=-1",
                  "trainer.save_freq=-1", "trainer.device=cpu", f"trainer.default_local_dir={run_dir}",
                  "trainer.logger=[console,jsonl]", "data.train_max_samples=16"]


@pytest.mark.parametrize("name", with_extended(SCRIPTS, EXTENDED))
def test_verl_script_trains_one_cpu_step(name, tmp_path):
    from meshrl.trainer.main import run

    mirror, path, *model = SCRIPTS[name]
    module, args = vendored_call(mirror, path)
    args = classify.with_verl_files(args, vendored_script(mirror, path).get("files", {}), tmp_path / "verl")
    data = DATA
    if name in IMAGES:
        geo3k = geo3k_data(tmp_path, "geo3k_multiturn_w_tool" if name in MULTI_TURN else "geo3k")
        data = {**DATA, r"data\.train_files": str(geo3k / "train.parquet"),
                r"data\.val_files": str(geo3k / "test.parquet")}
    script = swapped(args, tmp_path, model[0] if model else "tiny:llama", data) + AFTER.get(name, [])
    if name == "qwen25vl_megatron":  # the script's step 1, `meshrl convert hf-to-mcore`, on the tiny model
        from meshrl.models.tiny_vision import tiny_vl_model_dir

        checkpoint = classify.converted_checkpoint(tiny_vl_model_dir("qwen2_5_vl"))
        script += [f"actor_rollout_ref.{role}.megatron.dist_checkpointing_path={checkpoint}"
                   for role in ("actor", "ref")]
    recipe, overrides = parse_args(script, classify.entry_config(module))  # the entry module's config, as verl's
    cfg = load_config(overrides, recipe=recipe)
    plan = preflight(cfg)
    final = run(cfg, plan)
    step = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and final["actor/optimizer_steps"] >= 1
    if name in BYPASS:  # the engine serves the policy the actor trains: before its step they are one policy
        assert abs(step["rollout_corr/kl"]) < 1e-5 and step["rollout_corr/k3_kl"] < 1e-5
        assert not {key for key in step if key.startswith("rollout/log_prob")}
    else:
        assert step["rollout/log_prob_max_abs_diff"] < 1e-3  # the engine serves the policy the trainer evaluates
    if plan.use_reference:  # step 1: the policy is still the reference (bypass mode: the engine's log-probs of it)
        assert step["actor/ref_log_prob_max_abs_diff"] <= (1e-5 if name in BYPASS else 0.0)
    if name in ("ppo_megatron", "gemma2_ppo"):
        assert plan.use_critic and step["critic/optimizer_steps"] >= 1
    if name == "rm_ppo":  # the reward model's scores are the rewards
        assert plan.use_reward_model and step["score/mean"] == step["score/reward_model_mean"]
    if "lora" in name:  # adapters on a frozen base; the reference is the policy with them off
        assert plan.lora is not None and final["actor/optimizer_steps"] >= 1
    if name == "lora_megatron_rollout_tp2":  # the engine served the adapters alone (not merged weights) at TP2
        assert not plan.lora.merge and cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    if name == "cispo_fsdp":
        assert plan.policy_loss == "cispo" and "actor/pg_loss" in step
    if name in IMAGES:  # the script names vLLM; the HF engine ran it, and the start-up notes said so
        assert cfg.actor_rollout_ref.rollout.name == "hf"
        assert any("runs on the HF engine instead" in note for note in plan.warnings)
    if name in MULTI_TURN:  # conversations with verl's template and its tool, the images carried to every turn
        assert cfg.actor_rollout_ref.rollout.multi_turn.enable and cfg.actor_rollout_ref.model.custom_chat_template
        # every sample (4 prompts x 2) went through the agent loop (the random model calls no tool in 12 tokens: later
        # turns of an image prompt are tests/rollout/test_agent_images.py's)
        assert step["agent/turn_1/samples"] == 8 and "agent/finish/length" in step
    check_method(name, plan, step)


def check_method(name: str, plan, step: dict) -> None:
    """The method script ``name`` trained with its own method: its loss's or estimator's diagnostics are logged."""
    if name == "gdpo_fsdp":  # each component the script names, from the swapped reward file, reached the estimator
        assert plan.adv_estimator == "gdpo"
        means = [step[f"gdpo/{key}/mean"] for key in ("accuracy_reward", "format_reward")]
        assert step["score/mean"] == pytest.approx(sum(means))  # the reward file's score: their sum
        assert all(0.0 <= step[f"gdpo/{key}/min"] <= step[f"gdpo/{key}/max"] <= 1.0
                   for key in ("accuracy_reward", "format_reward"))
    if name == "gmpo_fsdp":
        assert plan.policy_loss == "geo_mean" and {"actor/clipfrac", "actor/clipfrac_lower"} <= set(step)
    if name in ("gspo_fsdp", "gspo_moe_megatron"):
        assert plan.policy_loss == "gspo" and plan.loss_agg_mode == "seq-mean-token-mean" and "actor/clipfrac" in step
    if name == "otb_fsdp":  # the baseline's Σπ² came from the old-log-prob pass; verl's variance proxies from it
        assert plan.adv_estimator == "optimal_token_baseline" and plan.sum_pi_squared
        assert step["variance_proxy/proxy2_total_power"] >= 0 and step["variance_proxy/expected_w"] > 0
    if name.startswith("sapo"):
        assert plan.policy_loss == "sapo" and "actor/ppo_kl" in step
    if name == "dppo_moe_megatron":
        assert plan.policy_loss == "dppo_tv" and {"actor/clipfrac", "actor/clipfrac_lower"} <= set(step)
    if name in ASYNC:  # verl's trainer, its staleness metrics: step 1 trains on the first weights' samples
        assert plan.rollout_correction.bypass == (name in BYPASS)
        assert step["fully_async/count/current_param_version"] == 0
        assert step["training/off_policy/trajectory_staleness/max"] == 0
        assert step["fully_async/static/required_samples"] == 4 and step["fully_async/count/total_generated_samples"] \
            >= 4
    if name == "rollout_corr_rloo":  # sequence IS weights, batch-normalised (mean 1), applied by REINFORCE's loss
        assert plan.adv_estimator == "rloo" and plan.rollout_correction.bypass
        assert step["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    if name == "one_step_off_dapo_ris":  # the tiny model's responses all reach 12 tokens and score 0 on GSM8K: each
        # gets DAPO's full penalty, -(12 - (12 - 4)) / 4 x penalty_factor 1.0; the sequence rejection ran
        assert step["score/mean"] == -1.0 and "rollout_corr/rollout_rs_masked_fraction" in step
        assert step["response_length/mean"] == 12
    if name == "rollout_corr_multi_rs":  # both rejection criteria ran; same policy: nothing is rejected
        assert plan.adv_estimator == "grpo" and plan.rollout_correction.bypass
        assert {"rollout_corr/rollout_rs_token_k1_mean", "rollout_corr/rollout_rs_seq_max_k2_mean"} <= set(step)
        assert step["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_verl_sandbox_script_scores_code_in_a_local_sandbox(tmp_path, capsys):
    """verl's sandbox-fusion PPO script on HumanEval, its URL left out: meshrl starts a local sandbox for the
    run, says its URL once, scores the code responses there (a failed program is counted by reason) and
    stops it when the run ends."""
    from meshrl.data.code_tasks import preprocess
    from meshrl.rewards.sandbox import SandboxUnreachable, run_code
    from meshrl.trainer.main import run

    files = preprocess(tmp_path / "humaneval")
    args = [a for a in vendored_args("volcengine/verl", "examples/ppo_trainer/run_deepseek7b_llm_sandbox_fusion.sh")
            if not a.startswith("reward_model.sandbox_fusion.url=")]
    data = {r"data\.train_files": str(files["train"]), r"data\.val_files": str(files["test"])}
    recipe, overrides = parse_args(swapped(args, tmp_path / "run", "tiny:llama", data))
    cfg = load_config(overrides, recipe=recipe)
    assert (cfg.reward_model.reward_manager, cfg.reward_model.sandbox_fusion.max_concurrent) == ("prime", 128)
    run(cfg, preflight(cfg))
    said = [line for line in capsys.readouterr().err.splitlines() if "code rewards run in a local sandbox" in line]
    assert len(said) == 1, said
    url = re.search(r"at (http://\S+/run_code)", said[0]).group(1)
    with pytest.raises(SandboxUnreachable):  # stopped with the run
        run_code(url, "print(1)", retries=0)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and step["critic/optimizer_steps"] >= 1
    errors = {k.removeprefix("reward/errors/"): v for k, v in step.items() if k.startswith("reward/errors/")}
    # a random model's responses: none passes HumanEval's tests, and each fails with a reason (no code block, or
    # code that cannot run)
    responses = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    assert step["score/mean"] == 0.0 and sum(errors.values()) == responses, errors
    assert set(errors) <= {"no_code", "timeout", "cpu_time", "memory", "output_limit", "signal", "runtime_error"}
