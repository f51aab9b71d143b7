"""Which models LoRA adapts here: the ``model`` stage's refusal rule for ``actor_rollout_ref.model.lora``.

Adapters, their PEFT names and the merged sync follow the HF projections q/k/v/o and gate/up/down; checkpoints that
fuse them (qkv_proj, gate_up_proj) and multi-latent attention (no q/k/v projections) are refused, as are a router
target on a dense model and the expert adapters ``parallel.lora`` cannot build (``expert_lora_problem``).

On a vision-language model the adapters sit on the language model only. verl's FSDP LoRA is PEFT on transformers'
class, which selects modules by their path in that class (``model.language_model.layers.N...``, the tower's
``model.visual...``): settings with which PEFT would also adapt the tower (``all-linear`` or a name such as
``gate_proj`` without ``exclude_modules='.*visual.*'``, as verl's VL LoRA script sets it), or a regular expression
that selects other language-model modules there than meshrl resolved, are refused rather than trained on fewer
modules than the user's settings ask for (``vision_language_lora_problems``).
"""

from __future__ import annotations

import re
from typing import Any

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
    if spec.vision and lora.keys == "FSDP":
        return vision_language_lora_problems(c.hf_config, *_peft_settings(c.cfg.actor_rollout_ref.model, lora),
                                             lora.targets)
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


def _peft_settings(model: Any, lora: Any) -> tuple[Any, Any]:
    """(target_modules, exclude_modules) as PEFT reads them: the adapter folder's (``lora_adapter_path``), else the
    FSDP keys'."""
    from omegaconf import OmegaConf

    if lora.adapter_path is not None:
        import json
        from pathlib import Path

        config = json.loads((Path(lora.adapter_path) / "adapter_config.json").read_text())
        return config.get("target_modules"), config.get("exclude_modules")
    plain = [OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
             for v in (model.target_modules, model.exclude_modules)]
    return plain[0], plain[1]


def _peft_selects(path: str, wanted: Any) -> bool:
    """PEFT's rule for ``target_modules`` / ``exclude_modules``: a string is a regular expression full-matched against
    the module's path; a list names modules by their path's last components."""
    if not wanted:
        return False
    if isinstance(wanted, str):
        return re.fullmatch(wanted, path) is not None
    return any(path == name or path.endswith("." + name) for name in wanted)


def vision_language_lora_problems(hf_config, target_modules: Any, exclude_modules: Any,
                                  targets: tuple[str, ...]) -> list[str]:
    """What PEFT would adapt in transformers' class of the vision-language ``hf_config`` (built on the meta device)
    with these settings, against meshrl's adapters (``targets``: the language model's projections): refusals when
    PEFT would adapt tower modules, or other language-model projections (module docstring)."""
    import torch

    from meshrl.models.families import family
    from meshrl.models.hf_classes import hf_class

    with torch.device("meta"):
        model = hf_class(family(hf_config.model_type).policy_class)._from_config(hf_config)
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]

    def adapted(path: str) -> bool:
        wanted = target_modules == "all-linear" or _peft_selects(path, target_modules)
        return wanted and not _peft_selects(path, exclude_modules)

    tower = [path for path in linears if ".visual." in f".{path}" and adapted(path)]
    language = {path.rsplit(".", 1)[-1] for path in linears if ".layers." in path and ".visual." not in f".{path}"
                and adapted(path)}
    problems = []
    if tower:
        shown = ", ".join(tower[:3]) + (f" and {len(tower) - 3} more" if len(tower) > 3 else "")
        problems.append(f"{KEY}: with these target_modules / exclude_modules, PEFT (verl's FSDP LoRA) would also adapt "
                        f"{hf_config.model_type}'s vision tower ({shown}); meshrl adapts the language model only: "
                        "exclude the tower, exclude_modules='.*visual.*', as verl's vision-language LoRA script does")
    if language != set(targets):
        problems.append(f"{KEY}: in {hf_config.model_type}'s module paths (model.language_model.layers.N...) PEFT "
                        f"would adapt {sorted(language) or 'no projection'} of the language model, not "
                        f"{sorted(targets)} as meshrl resolved them: name the projections as a list "
                        "(target_modules=[q_proj,v_proj,...])")
    return problems
