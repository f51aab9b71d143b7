"""verl's LoRA keys -> the policy's ``LoraPlan`` (``meshrl.parallel.lora`` builds it), or the reason it cannot be.

verl has two spellings, and a run uses one:

- FSDP (PEFT): ``actor_rollout_ref.model.lora_rank`` (> 0 enables), ``lora_alpha``, ``target_modules`` and
  ``exclude_modules`` as PEFT reads them (``all-linear``; a list of HF module names; a string is a regular
  expression full-matched against each module's name, ``model.layers.N.self_attn.q_proj``),
  ``lora_adapter_path`` (a PEFT folder to continue from: as in verl, it enables LoRA and its
  ``adapter_config.json`` gives rank, alpha, targets and dropout). PEFT's own defaults: no dropout, A
  kaiming-uniform, one adapter per HF module.
- Megatron (Megatron-Bridge): ``actor_rollout_ref.model.lora.{rank, alpha, dropout, type, target_modules,
  exclude_modules, lora_A_init_method, adapter_path, merge, ...}``. ``type=lora`` puts one adapter on each
  fused megatron layer (``linear_qkv``: q, k and v share A), ``canonical_lora`` one per HF module
  (``linear_q``, ..., ``linear_fc1_gate``, ``linear_fc1_up``). ``exclude_modules`` (with ``target_modules``
  empty) adapts every linear layer but those.

Targets are resolved to HF module names (``q_proj`` ... ``down_proj``); the embeddings and the output layer
are never adapted (PEFT's ``all-linear`` leaves ``lm_head`` out too).

How the engine gets the policy (``model.lora.merge``, read with either spelling, as verl reads it): False
(verl's default) sends only the adapters, served by vLLM's LoRA layers on the base weights it already holds
(``meshrl.rollout.lora_adapter``); True sends the merged weights ``W + (alpha/r)·B·A`` through the full weight
sync. The transformers engine (``rollout.name=hf``) has no adapter path: it always gets merged weights (a start-up note
says so when merge is False).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

HF_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The HF module path of each inside ``model.layers.N`` (PEFT's module names)
HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# A PEFT regular expression must select the same modules in every layer (per-layer adapters are not built);
# checked on this many layer indices, more than any model meshrl builds has.
LAYERS_CHECKED = 256
FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
         "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
CANONICAL = {"linear_q": ("q_proj",), "linear_k": ("k_proj",), "linear_v": ("v_proj",), "linear_proj": ("o_proj",),
             "linear_fc1_gate": ("gate_proj",), "linear_fc1_up": ("up_proj",), "linear_fc2": ("down_proj",)}
MEGATRON_TYPES = {"lora": FUSED, "canonical_lora": CANONICAL}
# A PEFT folder's ``target_parameters`` meshrl loads: the routed experts' (transformers 5's 3-D parameters) and the
# router's weight
EXPERT_PARAMETERS, ROUTER_PARAMETER = ("mlp.experts.down_proj", "mlp.experts.gate_up_proj"), "mlp.gate.weight"
# The largest of vLLM's MaxLoRARanks (vllm/config/lora.py, 0.32), as verl's validate_config checks it.
VLLM_MAX_LORA_RANK = 512


@dataclass(frozen=True)
class LoraPlan:
    """The policy's adapters: ``targets`` in HF module names, ``shared_a`` one A per fused megatron layer."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float
    shared_a: bool
    init_a: str  # kaiming (PEFT) | xavier (Megatron-Bridge's default)
    adapter_path: str | None  # a PEFT adapter folder the run starts from
    keys: str  # "FSDP" | "Megatron": which of verl's spellings set it
    merge: bool = False  # the engine gets merged weights (True) or the adapters (False: vLLM's adapter path)
    experts: bool = False  # the MLP targets also adapt an MoE layer's routed experts (``parallel.lora``)
    router: bool = False  # and its router (verl's "router" target, excluded by default as in verl)


def _names(value: Any) -> list[str]:
    return [] if value is None else [str(name) for name in value]


def _resolve(names: list[str], table: dict[str, tuple[str, ...]], key: str, problems: list[str]) -> set[str]:
    unknown = [name for name in names if name not in table]
    if unknown:
        problems.append(f"{key}: {unknown} are not linear layers meshrl adapts; choose among {sorted(table)} "
                        "(wildcards and regular expressions are not supported)")
    return {hf for name in names if name in table for hf in table[name]}


def _peft_names(value: Any, key: str, problems: list[str]) -> set[str]:
    """The HF modules PEFT selects with ``value``: names (a list), or a regular expression (a string)."""
    if not isinstance(value, str):
        return _resolve(_names(value), {name: (name,) for name in HF_LINEAR}, key, problems)
    try:
        regex = re.compile(value)
    except re.error as error:
        problems.append(f"{key}={value!r} is not a regular expression PEFT can read: {error}")
        return set()
    per_layer = {frozenset(name for name in HF_LINEAR
                           if regex.fullmatch(f"model.layers.{layer}.{HF_PARENT[name]}.{name}"))
                 for layer in range(LAYERS_CHECKED)}
    if len(per_layer) > 1:
        problems.append(f"{key}={value!r} selects different modules in different layers; per-layer LoRA is not "
                        "built: select module kinds (a list such as [q_proj,v_proj])")
    return set(next(iter(per_layer)))


def _ordered(targets: set[str]) -> tuple[str, ...]:
    return tuple(name for name in HF_LINEAR if name in targets)


def _adapter_plan(model: DictConfig, problems: list[str]) -> LoraPlan | None:
    """The LoRA of the PEFT folder ``model.lora_adapter_path`` (verl reads it with ``PeftModel.from_pretrained``)."""
    key = "actor_rollout_ref.model.lora_adapter_path"
    config_file = Path(model.lora_adapter_path) / "adapter_config.json"
    if not config_file.is_file():
        problems.append(f"{key}={model.lora_adapter_path}: no PEFT adapter there (adapter_config.json is missing)")
        return None
    config = json.loads(config_file.read_text())
    unbuilt = [name for name in ("use_dora", "use_rslora", "layers_to_transform", "rank_pattern", "alpha_pattern")
               if config.get(name)]
    if config.get("peft_type") != "LORA" or unbuilt:
        problems.append(f"{key}: the adapter is {config.get('peft_type')} with {unbuilt or 'nothing else'}; meshrl "
                        "builds plain LoRA (no DoRA, rsLoRA or per-layer ranks)")
    targets = _peft_names(config.get("target_modules"), f"{config_file}: target_modules", problems)
    if config.get("exclude_modules"):
        targets -= _peft_names(config["exclude_modules"], f"{config_file}: exclude_modules", problems)
    from meshrl.config.schema import ModelConfig

    overridden = [name for name in ("lora_alpha", "target_modules", "exclude_modules")
                  if _plain(model[name]) != getattr(ModelConfig, name)]
    if overridden:
        problems.append(f"{', '.join('actor_rollout_ref.model.' + name for name in overridden)}: the adapter at {key} "
                        "sets these (its adapter_config.json, as verl reads it); leave them at their defaults")
    if model.lora_rank > 0 and model.lora_rank != config.get("r"):
        problems.append(f"actor_rollout_ref.model.lora_rank={model.lora_rank}, but the adapter at {key} has rank "
                        f"{config.get('r')} (verl takes the adapter's): leave lora_rank at 0 or set it to that")
    parameters = set(config.get("target_parameters") or [])
    other = sorted(parameters - {*EXPERT_PARAMETERS, ROUTER_PARAMETER})
    if other:
        problems.append(f"{config_file}: target_parameters {other}: meshrl adapts the routed experts' parameters "
                        f"{list(EXPERT_PARAMETERS)} and the router's {ROUTER_PARAMETER}, no other parameter")
    return LoraPlan(rank=int(config.get("r", 8)), alpha=float(config.get("lora_alpha", 8)), targets=_ordered(targets),
                    dropout=float(config.get("lora_dropout", 0.0)), shared_a=False, init_a="kaiming",
                    adapter_path=model.lora_adapter_path, keys="FSDP", experts=bool(parameters & {*EXPERT_PARAMETERS}),
                    router=ROUTER_PARAMETER in parameters)


def _fsdp_plan(model: DictConfig, problems: list[str]) -> LoraPlan | None:
    if model.lora_adapter_path is not None:
        return _adapter_plan(model, problems)
    wanted, prefix = model.target_modules, "actor_rollout_ref.model"
    targets = set(HF_LINEAR) if wanted == "all-linear" else _peft_names(wanted, f"{prefix}.target_modules", problems)
    if model.exclude_modules is not None:
        targets -= _peft_names(model.exclude_modules, f"{prefix}.exclude_modules", problems)
    return LoraPlan(rank=int(model.lora_rank), alpha=float(model.lora_alpha), targets=_ordered(targets), dropout=0.0,
                    shared_a=False, init_a="kaiming", adapter_path=None, keys="FSDP")


def _megatron_plan(lora: DictConfig, problems: list[str]) -> LoraPlan | None:
    prefix = "actor_rollout_ref.model.lora"
    if lora.type not in MEGATRON_TYPES:
        problems.append(f"{prefix}.type={lora.type}: meshrl builds {sorted(MEGATRON_TYPES)} (DoRA and VLM LoRA are "
                        "not built)")
        return None
    table = MEGATRON_TYPES[lora.type]
    refused = {
        "dropout_position": (lora.dropout_position == "pre", "only 'pre' (dropout on the adapter's input, as PEFT) "
                                                              "is built"),
        "lora_A_init_method": (lora.lora_A_init_method in ("xavier", "kaiming"), "choose xavier or kaiming"),
        "lora_B_init_method": (lora.lora_B_init_method == "zero", "B starts at zero (step 1 equals the base model)"),
        "a2a_experimental": (not lora.a2a_experimental, "Megatron-Bridge's all-to-all adapter communication is not "
                                                        "built; set False"),
        "dtype": (lora.dtype is None, "the adapters take the model's dtype (megatron.dtype); leave it null"),
        "adapter_path": (lora.adapter_path is None, "meshrl starts from PEFT adapter folders: give it as "
                                                    "model.lora_adapter_path with verl's FSDP LoRA keys"),
    }
    problems += [f"{prefix}.{key}={lora[key]}: {why}" for key, (ok, why) in refused.items() if not ok]
    excluded = _names(lora.exclude_modules)
    wanted = _names(lora.target_modules)
    if excluded and wanted:
        problems.append(f"{prefix}.exclude_modules: set target_modules=[] with it (it adapts every linear layer "
                        "but those), as verl requires")
    router = "router" in wanted  # verl's MoE router, adapted only when named (Megatron-Bridge's LoRATopKRouter)
    wanted = [name for name in wanted if name != "router"]
    if wanted:
        targets = _resolve(wanted, table, f"{prefix}.target_modules", problems)
    else:  # none named: every linear layer (exclude_modules' form), or the router alone
        targets = set() if router else set(HF_LINEAR)
    targets -= _resolve(excluded, table, f"{prefix}.exclude_modules", problems)
    if not 0.0 <= lora.dropout < 1.0:
        problems.append(f"{prefix}.dropout={lora.dropout}: must be in [0, 1)")
    return LoraPlan(rank=int(lora.rank), alpha=float(lora.alpha), targets=_ordered(targets),
                    dropout=float(lora.dropout), shared_a=lora.type == "lora",
                    init_a=lora.lora_A_init_method, adapter_path=None, keys="Megatron", experts=True, router=router)


def lora_enabled(cfg: DictConfig) -> bool:
    model = cfg.actor_rollout_ref.model
    return model.lora_rank > 0 or model.lora_adapter_path is not None or model.lora.rank > 0


def lora_plan(cfg: DictConfig) -> tuple[LoraPlan | None, list[str], list[str]]:
    """(the policy's ``LoraPlan`` or None: every weight trains, problems, start-up notes)."""
    model = cfg.actor_rollout_ref.model
    if not lora_enabled(cfg):
        return None, [], []
    problems: list[str] = []
    fsdp = model.lora_rank > 0 or model.lora_adapter_path is not None
    if fsdp and model.lora.rank > 0:
        return None, ["actor_rollout_ref.model.lora_rank (or lora_adapter_path) and actor_rollout_ref.model.lora.rank "
                      "are both set: use "
                      "verl's FSDP LoRA keys (model.lora_rank, ...) or its Megatron ones (model.lora.*), not both"], []
    if min(model.lora_rank, model.lora.rank) < 0:
        problems.append("LoRA rank must be >= 0 (0: no LoRA)")
    plan = _fsdp_plan(model, problems) if fsdp else _megatron_plan(model.lora, problems)
    if plan is not None and not plan.targets and not plan.router:
        problems.append("the LoRA target_modules / exclude_modules leave no linear layer to adapt")
    problems += _other_spelling(model, "FSDP" if fsdp else "Megatron")
    notes = []
    merge = bool(model.lora.merge)
    engine = cfg.actor_rollout_ref.rollout.name
    if plan is not None and not merge and engine != "vllm":
        merge = True
        notes.append(f"actor_rollout_ref.model.lora.merge=False: rollout.name={engine} has no LoRA adapter path, so "
                     "the engine is sent the merged weights W + (alpha/rank)·B·A (the same policy)")
    if plan is not None and not merge and plan.rank > VLLM_MAX_LORA_RANK:
        problems.append(f"LoRA rank {plan.rank}: vLLM serves adapters of rank <= {VLLM_MAX_LORA_RANK}; set "
                        "actor_rollout_ref.model.lora.merge=True to send it the merged weights")
    if plan is not None:
        plan = replace(plan, merge=merge)
    return (None if problems else plan), problems, notes


def _other_spelling(model: DictConfig, used: str) -> list[str]:
    """The keys of verl's other LoRA spelling set away from their defaults: this run would not read them."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from meshrl.config.schema import LoraConfig, ModelConfig

    if used == "FSDP":  # verl reads model.lora.merge with both spellings
        defaults, section, prefix = asdict(LoraConfig()), OmegaConf.to_container(model.lora), "model.lora."
        section.pop("merge")
    else:
        defaults = {key: getattr(ModelConfig, key) for key in ("lora_alpha", "target_modules", "exclude_modules",
                                                              "lora_adapter_path")}
        section, prefix = {key: model[key] for key in defaults}, "model."
    unread = [f"actor_rollout_ref.{prefix}{key}" for key, value in section.items()
              if _plain(value) != defaults[key]]
    if not unread:
        return []
    other = "model.lora.*" if used == "FSDP" else "model.lora_rank, lora_alpha, target_modules, ..."
    return [f"{', '.join(unread)}: verl's {'Megatron' if used == 'FSDP' else 'FSDP'} LoRA key(s), while this run's "
            f"LoRA is set with the {used} keys; set the LoRA with one spelling (not {other})"]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, ListConfig) else value
