"""``meshrl plan``: parameter counts against megatron-core and published totals, the memory model's
scaling, refusals that name the knob, and the command's output."""

import json

import pytest

from meshrl.config import load_config
from meshrl.config.validate import validate_config
from meshrl.parallel.model_builder import model_spec
from meshrl.memory_plan import GIB, estimate, main
from meshrl.memory_plan.activations import all_to_all_bytes_per_token
from meshrl.memory_plan.weights import (active_parameters, expert_parameters, layer_parameters, load_hf_config,
                                        matmul_parameters, stage_parameters)
from meshrl.models.known import KNOWN_MODELS

# Parameter totals the Hugging Face hub shows for these checkpoints (safetensors), in billions.
PUBLISHED_B = {
    "Qwen/Qwen2.5-0.5B-Instruct": 0.494, "Qwen/Qwen2.5-1.5B-Instruct": 1.54, "Qwen/Qwen2.5-3B-Instruct": 3.09,
    "Qwen/Qwen2.5-7B-Instruct": 7.62, "Qwen/Qwen2.5-14B-Instruct": 14.8, "Qwen/Qwen2.5-32B-Instruct": 32.8,
    "Qwen/Qwen2.5-72B-Instruct": 72.7,
    "Qwen/Qwen2-7B-Instruct": 7.62, "deepseek-ai/deepseek-llm-7b-chat": 6.91,
    "Qwen/Qwen3-8B": 8.19, "Qwen/Qwen3-32B": 32.8, "google/gemma-2-2b-it": 2.61, "google/gemma-2-9b-it": 9.24,
    "mistralai/Mistral-7B-Instruct-v0.3": 7.25, "microsoft/Phi-3-mini-4k-instruct": 3.82,
    "THUDM/GLM-4-9B-0414": 9.40,
    # mixture-of-experts: the model cards' totals
    "Qwen/Qwen1.5-MoE-A2.7B": 14.3, "Qwen/Qwen3-30B-A3B": 30.5, "mistralai/Mixtral-8x7B-Instruct-v0.1": 46.7,
    "moonshotai/Moonlight-16B-A3B": 16.0,  # its card's "16B" (meshrl counts 15.96 B; 2.91 B active, the card's "3B")
    "deepseek-ai/DeepSeek-V3": 671,  # the paper's count, without the MTP layer (the hub's 685 B)
    # vision-language: language model and vision tower
    "Qwen/Qwen2.5-VL-7B-Instruct": 8.29, "Qwen/Qwen3-VL-8B-Instruct": 8.77,
}
# ... and the parameters one token uses, as the cards publish them ("A2.7B", "A3B", Mistral's 12.9 B,
# DeepSeek-V3's 37 B)
PUBLISHED_ACTIVE_B = {"Qwen/Qwen1.5-MoE-A2.7B": 2.7, "Qwen/Qwen3-30B-A3B": 3.3,
                      "mistralai/Mixtral-8x7B-Instruct-v0.1": 12.9,
                      "deepseek-ai/DeepSeek-V3": 37}


def spec_of(model: str, **changes):
    """The model's spec with ``changes`` to its language model's config (a vision-language model's text_config)."""
    config = load_hf_config(model)
    for key, value in changes.items():
        setattr(config.get_text_config(), key, value)
    return model_spec(config)


def test_known_models_are_all_checked():
    assert set(PUBLISHED_B) == set(KNOWN_MODELS)


@pytest.mark.parametrize("model", sorted(PUBLISHED_B))
def test_total_matches_published_count(model):
    from meshrl.parallel.vision import tower_parameters

    spec = spec_of(model)
    total = stage_parameters(spec) + (tower_parameters(load_hf_config(model)) if spec.vision else 0)
    assert total / 1e9 == pytest.approx(PUBLISHED_B[model], rel=0.01)


@pytest.mark.parametrize("model", sorted(PUBLISHED_ACTIVE_B))
def test_active_count_matches_published_count(model):
    spec = spec_of(model)
    assert active_parameters(spec) / 1e9 == pytest.approx(PUBLISHED_ACTIVE_B[model], rel=0.02)
    # FLOPs follow the experts a token runs, not the ones it skips
    assert matmul_parameters(spec) < active_parameters(spec) < stage_parameters(spec)


@pytest.mark.parametrize("model", sorted(PUBLISHED_ACTIVE_B))
@pytest.mark.parametrize("ep,etp", [(2, 1), (4, 1), (2, 2), (8, 2)])
def test_expert_shards_add_up_to_the_model(model, ep, etp):
    """EP x expert-TP ranks hold every routed expert exactly once between them; the rest of a layer is the TP
    layout's (TP 2 here)."""
    spec = spec_of(model)
    if spec.num_experts % ep:
        pytest.skip(f"{spec.num_experts} experts over EP {ep}")
    dense = layer_parameters(spec, tp=2, ep=spec.num_experts) - expert_parameters(spec) // 2  # one expert at ETP 2
    experts = layer_parameters(spec, tp=2, ep=ep, etp=etp) - dense
    assert experts * ep * etp == spec.num_experts * expert_parameters(spec)


def test_all_to_all_volume_per_step():
    """Each MoE layer dispatches a token's top-k hidden-state copies and combines them back, (EP - 1) / EP of them
    to other ranks; nothing crosses at EP 1. Qwen3-30B-A3B in bf16: 48 layers x 2 x 8 x 2048 x 2 B = 3 MiB a token."""
    spec = spec_of("Qwen/Qwen3-30B-A3B")
    assert all_to_all_bytes_per_token(spec, ep=1, act_bytes=2) == 0
    assert all_to_all_bytes_per_token(spec, ep=8, act_bytes=2) == 48 * 2 * 8 * 2048 * 2 * 7 / 8
    assert all_to_all_bytes_per_token(spec_of("Qwen/Qwen3-8B"), ep=8, act_bytes=2) == 0  # dense


@pytest.mark.parametrize("model", sorted(PUBLISHED_B))
def test_count_is_linear_in_layers(model):
    # DeepSeek-V3's first layers are dense: count from the first MoE layer; Qwen3-VL's deepstack needs its layers
    spec = spec_of(model)
    dense = max(spec.dense_layers, spec.deepstack_layers)
    counts = [stage_parameters(spec_of(model, num_hidden_layers=dense + n)) for n in (1, 2, 3, 8)]
    per_layer = layer_parameters(spec_of(model))
    assert counts[1] - counts[0] == counts[2] - counts[1] == per_layer
    assert counts[3] - counts[0] == 7 * per_layer


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                                   "deepseek-ai/deepseek-llm-7b-chat"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 2), (2, 2)])
def test_shards_add_up_to_the_model(model, tp, pp):
    spec = spec_of(model)
    per_stage = [stage_parameters(spec, tp=tp, pp=pp, stage=s) for s in range(pp)]
    replicated_norms = 2 * spec.num_layers * spec.hidden_size + spec.hidden_size  # held by every TP rank
    tied_copy = spec.vocab_size * spec.hidden_size if spec.tie_word_embeddings and pp > 1 else 0
    assert tp * sum(per_stage) == stage_parameters(spec) + (tp - 1) * replicated_norms + tied_copy


@pytest.mark.slow
def test_counts_match_megatron_gpt_model():
    """The real GPTModel (model_builder.build_model, local spec, CPU) of real-shaped configs with few layers."""
    from meshrl.models.tiny import TinySpec, tiny_config, tiny_spec
    from meshrl.parallel import state
    from meshrl.parallel.model_builder import build_model, unwrap

    cases = [("qwen2.5-0.5b L1", load_hf_config("Qwen/Qwen2.5-0.5B-Instruct"), 1, False),
             ("qwen2.5-0.5b L2", load_hf_config("Qwen/Qwen2.5-0.5B-Instruct"), 2, False),
             ("qwen2.5-0.5b critic", load_hf_config("Qwen/Qwen2.5-0.5B-Instruct"), 1, True),
             ("llama MHA untied", tiny_config(TinySpec(num_key_value_heads=4, tie_word_embeddings=False)), 3, False),
             ("qwen2 GQA untied", tiny_config(TinySpec(arch="qwen2", hidden_size=256, tie_word_embeddings=False)),
              2, True),
             # MoE: router, per-expert MLPs, shared expert and its gate
             ("qwen2_moe", tiny_config(tiny_spec("qwen2_moe")), 2, False),
             ("mixtral", tiny_config(tiny_spec("mixtral")), 1, False)]
    state.initialize(state.ParallelConfig())
    try:
        for name, config, layers, critic in cases:
            config.num_hidden_layers = layers
            chunks = build_model(config, critic=critic, perform_initialization=False)
            built = sum(p.numel() for chunk in chunks for p in unwrap(chunk).parameters())
            del chunks
            assert built == stage_parameters(model_spec(config), critic=critic), name
    finally:
        state.destroy()


def load(recipe, *overrides):
    cfg = load_config(list(overrides), recipe=recipe)
    validate_config(cfg)
    return cfg


def phase(result, name):
    return next(p for p in result.phases if p.name == name)


def test_memory_scales_with_the_knobs():
    base = estimate(load("remax_qwen2.5-7b_seq_balance"))
    half_budget = estimate(load("remax_qwen2.5-7b_seq_balance",
                                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12000"))
    update, update_half = phase(base, "actor update").items, phase(half_budget, "actor update").items
    # the fused output layer (the default) holds one chunk of logits whatever the budget (test_fused_output.py)
    assert update_half["actor logits"] == update["actor logits"]
    no_distopt = estimate(load("remax_qwen2.5-7b_seq_balance",
                           "actor_rollout_ref.actor.megatron.use_distributed_optimizer=False"))
    dp = base.layout["dp"]
    assert phase(no_distopt, "actor optimizer").items["actor optimizer"] == pytest.approx(
        dp * phase(base, "actor optimizer").items["actor optimizer"])
    tp4 = estimate(load("remax_qwen2.5-7b_seq_balance",
                        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"))
    assert phase(tp4, "actor update").items["actor logits"] == pytest.approx(update["actor logits"] / 2)
    no_recompute = estimate(load("remax_qwen2.5-7b_seq_balance",
                             "actor_rollout_ref.model.enable_gradient_checkpointing=False"))
    assert phase(no_recompute, "actor update").items["actor activations"] > 5 * update["actor activations"]
    # offloading the reference keeps it out of every phase but the one that reads it
    assert "ref params" in phase(base, "log-prob").items and "ref params" not in phase(base, "rollout").items
    # ReMax decodes one greedy response per prompt on top of the n samples
    unshared = estimate(load("remax_qwen2.5-7b_seq_balance", "actor_rollout_ref.actor.use_prefix_grouper=False"))
    assert unshared.flops["generation"] == pytest.approx(unshared.flops["old_log_probs"] * 5 / 4)
    # shared prompts (on by default): the policy's passes run a prompt once for its n responses
    cfg = load("remax_qwen2.5-7b_seq_balance")
    prompt, response, n = cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.actor_rollout_ref.rollout.n
    assert base.layout["shared_prompts"] and not unshared.layout["shared_prompts"]
    assert base.flops["old_log_probs"] / unshared.flops["old_log_probs"] == pytest.approx(
        (prompt + n * response) / (n * (prompt + response)))


def test_pipeline_first_stage_holds_pp_micro_batches():
    flat = estimate(load("grpo_qwen2-7b_math", "actor_rollout_ref.model.enable_gradient_checkpointing=False"))
    piped = estimate(load("grpo_qwen2-7b_math_megatron", "actor_rollout_ref.model.enable_gradient_checkpointing=False"))
    assert piped.stage["actor"] == 0  # the first stage is the fuller one without recompute
    # PP 2 halves the layers of a stage but keeps 2 micro-batches in flight: same activations at stage 0
    assert phase(piped, "actor update").items["actor activations"] == pytest.approx(
        phase(flat, "actor update").items["actor activations"])


def test_refuses_a_layout_that_cannot_fit_and_names_the_knobs(capsys):
    code = main(["remax_qwen2.5-7b_seq_balance", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                 "actor_rollout_ref.actor.megatron.use_distributed_optimizer=False"])
    out = capsys.readouterr().out
    assert code == 1
    assert "does NOT fit" in out
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size" in out
    assert "use_distributed_optimizer=True" in out


def test_refuses_a_rollout_budget_without_kv_room():
    result = estimate(load("remax_qwen2.5-7b_seq_balance", "actor_rollout_ref.rollout.gpu_memory_utilization=0.05"))
    assert not result.fits
    assert any("KV cache" in p for p in result.problems)
    assert any("gpu_memory_utilization" in a for a in result.advice)


def test_smaller_gpu_is_refused(capsys):
    assert main(["remax_qwen2.5-7b_seq_balance", "--gpu-memory-gib", "40"]) == 1
    assert "of 40.0 GiB" in capsys.readouterr().out


def test_json_output(capsys):
    assert main(["remax_qwen2.5-7b_seq_balance", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["model"]["parameters"] == stage_parameters(spec_of("Qwen/Qwen2.5-7B-Instruct"))
    assert {p["name"] for p in data["phases"]} == {"rollout", "log-prob", "actor update", "actor optimizer"}
    assert data["peak_bytes"] <= 80 * GIB
    assert data["flops"]["total"] == pytest.approx(sum(v for k, v in data["flops"].items()
                                                       if k not in ("total", "per_gpu")))


def test_impossible_layout_and_unknown_model_are_config_errors(capsys):
    assert main(["remax_qwen2.5-7b_seq_balance", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8"]) == 2
    assert ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size: TP=8 does not divide num_key_value_heads=4"
            in capsys.readouterr().err)  # the trainer's check, naming the key
    assert main(["remax_qwen2.5-7b_seq_balance", "actor_rollout_ref.model.path=org/not-a-model"]) == 2
    err = capsys.readouterr().err
    assert "not a local Hugging Face folder" in err and "Qwen/Qwen2.5-7B-Instruct" in err


def test_local_folder_is_read(tmp_path):
    config = load_hf_config("Qwen/Qwen2.5-1.5B-Instruct")
    config.save_pretrained(tmp_path)
    result = estimate(load("remax_qwen2.5-7b_seq_balance", f"actor_rollout_ref.model.path={tmp_path}"))
    assert result.model["parameters"] == stage_parameters(spec_of("Qwen/Qwen2.5-1.5B-Instruct"))


def test_ppo_counts_the_colocated_critic():
    result = estimate(load("ppo_qwen2.5-1.5b"))
    spec = spec_of("Qwen/Qwen2.5-1.5B-Instruct")
    assert [p.name for p in result.phases][-2:] == ["critic update", "critic optimizer"]
    assert "critic optimizer" in phase(result, "actor update").items  # not offloaded in this recipe
    tokens = 1024 * 1 * (512 + 1024)  # prompts x responses per prompt x full length
    assert result.flops["values"] == pytest.approx(2 * matmul_parameters(spec, critic=True) * tokens)
    # a scalar head instead of the (tied) vocabulary projection: the critic is smaller in FLOPs
    assert matmul_parameters(spec, critic=True) < matmul_parameters(spec)


def test_actor_dtype_sets_the_byte_counts():
    """megatron.dtype=bfloat16 on CPU is counted as mixed precision (bf16 params, fp32 master copy and
    moments); float32 on GPU as fp32 throughout; the reference follows the actor."""
    fp32 = estimate(load("cpu_tiny_grpo", "actor_rollout_ref.actor.use_kl_loss=True"))
    bf16 = estimate(load("cpu_tiny_grpo", "actor_rollout_ref.actor.use_kl_loss=True",
                     "actor_rollout_ref.actor.megatron.dtype=bfloat16"))
    static = phase(fp32, "actor optimizer").items, phase(bf16, "actor optimizer").items
    assert static[1]["actor params"] == pytest.approx(static[0]["actor params"] / 2)
    assert static[1]["actor optimizer"] == pytest.approx(static[0]["actor optimizer"] * 12 / 8)
    assert static[1]["ref params"] == pytest.approx(static[0]["ref params"] / 2)
    assert (fp32.layout["actor_dtype"], bf16.layout["actor_dtype"]) == ("float32", "bfloat16")
    gpu = estimate(load("remax_qwen2.5-7b_seq_balance"))
    gpu_fp32 = estimate(load("remax_qwen2.5-7b_seq_balance", "actor_rollout_ref.actor.megatron.dtype=float32"))
    assert phase(gpu_fp32, "actor update").items["actor params"] == pytest.approx(
        2 * phase(gpu, "actor update").items["actor params"])


def test_sum_pi_squared_raises_the_unfused_forward_logits_to_its_temporaries():
    """The old-log-prob pass's Σπ² (the optimal token baseline's) holds bf16 logits, their fp32 copy and an fp32 exp:
    10 B per logit element instead of the cross entropy's 6; the fused output layer squares in place."""
    unfused = ("actor_rollout_ref.model.use_fused_kernels=False",)
    otb = ("algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=True")
    base = phase(estimate(load("remax_qwen2.5-7b_seq_balance", *unfused)), "log-prob").items["forward logits"]
    with_pi2 = phase(estimate(load("remax_qwen2.5-7b_seq_balance", *unfused, *otb)), "log-prob").items["forward logits"]
    assert with_pi2 == pytest.approx(base * 10 / 6)
    fused = phase(estimate(load("remax_qwen2.5-7b_seq_balance")), "log-prob").items["forward logits"]
    assert phase(estimate(load("remax_qwen2.5-7b_seq_balance", *otb)), "log-prob").items["forward logits"] == fused


def test_the_reward_model_is_planned_as_its_own_role():
    base = ["reward_model.enable=True", "reward_model.model.path=tiny-rm:llama"]
    without = estimate(load_config([], recipe="cpu_tiny_ppo"), gpu_memory_gib=80)
    result = estimate(load_config(base, recipe="cpu_tiny_ppo"), gpu_memory_gib=80)
    params = stage_parameters(spec_of("tiny-rm:llama"), critic=True) * 4  # fp32 on CPU
    phases = {p.name: p for p in result.phases}
    assert "reward model" in phases and "reward model" not in {p.name for p in without.phases}
    assert all(p.items["reward model params"] == params for p in result.phases)  # resident throughout
    assert phases["reward model"].items["reward model activations"] > 0
    assert phases["rollout"].items["runtime overhead"] > without.phases[0].items["runtime overhead"]  # a process more
    assert result.flops["reward_model"] > 0 and result.layout["reward_model"]["tp"] == 1
    offloaded = estimate(load_config([*base, "reward_model.megatron.param_offload=True"], recipe="cpu_tiny_ppo"), 80)
    assert [p.name for p in offloaded.phases if "reward model params" in p.items] == ["reward model"]


def test_lora_counts_pefts_adapters_and_builds_no_reference():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from meshrl.models.resolve import resolve_model_path

    overrides = ["actor_rollout_ref.actor.use_kl_loss=True"]
    full = estimate(load_config(overrides, recipe="cpu_tiny_grpo"), gpu_memory_gib=80)
    lora = estimate(load_config([*overrides, "actor_rollout_ref.model.lora_rank=8",
                             "actor_rollout_ref.model.target_modules=all-linear"], recipe="cpu_tiny_grpo"), 80)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:llama"))
    trainable = sum(p.numel() for p in get_peft_model(hf, LoraConfig(r=8, target_modules="all-linear")).parameters()
                    if p.requires_grad)
    assert lora.layout["lora"]["trained_parameters"] == trainable  # PEFT's own count
    update = {p.name: p for p in lora.phases}["actor update"].items
    assert update["actor grads"] == trainable * 4 and update["actor optimizer"] == trainable * 8  # fp32 CPU, Adam
    assert any("ref params" in p.items for p in full.phases) and not any("ref params" in p.items for p in lora.phases)
    # no weight gradients for the frozen base: 2·N per token less, one reference pass's worth per epoch
    epochs = load_config([], recipe="cpu_tiny_grpo").actor_rollout_ref.actor.ppo_epochs
    assert full.flops["actor_update"] - lora.flops["actor_update"] == pytest.approx(full.flops["reference"] * epochs)


def test_a_generative_reward_model_holds_its_server_through_every_phase():
    judge = ["reward_model.enable=True", "reward_model.model.path=tiny:qwen2",
             "custom_reward_function.path=recipes/rewards/llm_judge.py"]
    key = "reward judge (vLLM server)"
    # on CPU: its weights, profiled activations and KV cache, with no Megatron reward-model role
    cpu = estimate(load_config([*judge, "reward_model.rollout.kv_cache_memory_bytes=1073741824"],
                           recipe="cpu_tiny_grpo"), gpu_memory_gib=80)
    weights = stage_parameters(spec_of("tiny:qwen2")) * 2  # reward_model.rollout.dtype: bfloat16 (verl's default)
    assert all(p.items[key] > weights + GIB for p in cpu.phases)
    assert "reward model" not in {p.name for p in cpu.phases}
    # on GPU: its share of the whole GPU, as vLLM allocates it
    gpu = estimate(load_config([*judge, "trainer.device=cuda", "reward_model.rollout.gpu_memory_utilization=0.25"],
                           recipe="cpu_tiny_grpo"), gpu_memory_gib=80)
    assert all(p.items[key] == 0.25 * 80 * GIB for p in gpu.phases)


def test_the_cpu_engine_sleeps_without_its_weights_unless_adapters_are_synced():
    """Sleep level 2 (vllm_engine): vLLM's weights only in the rollout; with LoRA adapter syncs (level 1) in every
    phase, on CPU where its weights are host memory."""
    def holding(result):
        return [p.name for p in result.phases if "vLLM weights" in p.items]

    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=all-linear"]
    full = estimate(load_config([], recipe="cpu_tiny_grpo"), gpu_memory_gib=80)
    adapters = estimate(load_config(lora, recipe="cpu_tiny_grpo"), gpu_memory_gib=80)
    merged = estimate(load_config([*lora, "actor_rollout_ref.model.lora.merge=True"], recipe="cpu_tiny_grpo"),
                  gpu_memory_gib=80)
    assert holding(full) == holding(merged) == ["rollout"]
    assert holding(adapters) == [p.name for p in adapters.phases] and len(adapters.phases) > 1
    # verl's enable_sleep_mode=False: an engine without sleep mode holds everything in every phase
    awake = estimate(load_config(["+actor_rollout_ref.rollout.enable_sleep_mode=False"], recipe="cpu_tiny_grpo"),
                     gpu_memory_gib=80)
    assert holding(awake) == [p.name for p in awake.phases]
