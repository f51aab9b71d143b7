"""Which models LoRA adapts here: the ``model`` stage's refusal rule for ``actor_rollout_ref.model.lora``.

Adapters, their PEFT names and the merged sync follow the HF projections q/k/v/o and gate/up/down; checkpoints that
fuse them (qkv_proj, gate_up_proj) and multi-latent attention (no q/k/v projections) are refused, as are a router
target on a dense model and the expert adapters ``parallel.lora`` cannot build (``expert_lora_problem``).
"""

from __future__ import annotations

from meshrl.config.refusals import Checked, refusal
from meshrl.models.families import model_spec
from meshrl.parallel.lora import LoraSettings, expert_lora_problem

KEY = "actor_rollout_ref.model.lora"


@refusal("model", KEY)
def lora_on_this_model(c: Checked) -> list[str]:
    """LoRA only where its adapters map onto the model's projections (module docstring)."""
    lora, model_type = c.plan.lora, c.hf_config.model_type
    if lora is None:
        return []
    spec = model_spec(c.hf_config)
    if spec.hf_fused:
        return [f"{KEY}: LoRA on {model_type}, whose HF checkpoint fuses its projections (qkv_proj, gate_up_proj), is "
                "not built yet; train every weight (no LoRA keys) or use another family"]
    if spec.mla:
        return [f"{KEY}: LoRA on {model_type}'s multi-latent attention is not built yet; train every weight (no LoRA "
                "keys) or use another family"]
    if not spec.moe:
        return [] if not lora.router else [
            f"{KEY}.target_modules: 'router' adapts a mixture-of-experts router, and {model_type} has none: drop it"]
    if not (lora.experts or lora.router):
        return []
    if lora.keys == "Megatron" and not lora.shared_a and {"gate_proj", "up_proj"} & set(lora.targets):
        return [f"{KEY}.type=canonical_lora on {model_type}'s routed experts is not built (PEFT's expert adapter "
                "holds one A for gate and up): use lora.type=lora"]
    settings = LoraSettings(rank=lora.rank, alpha=lora.alpha, targets=lora.targets, dropout=lora.dropout,
                            router=lora.router)
    problem = expert_lora_problem(settings)
    return [f"{KEY} on {model_type}: {problem}"] if problem else []
