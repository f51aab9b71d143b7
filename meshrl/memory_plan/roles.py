"""One trained or forward-only model's memory (``RoleMemory``): its layout, precision and offload flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshrl.memory_plan.activations import activation_bytes_per_token
from meshrl.memory_plan.units import PlanError
from meshrl.memory_plan.weights import expert_parameters, load_hf_config, lora_parameters, stage_parameters


@dataclass(frozen=True)
class RoleMemory:
    """One trained model (policy or critic): layout, precision and the flags that place its tensors."""

    spec: Any
    tp: int
    pp: int
    vpp: int
    dp: int
    distributed_optimizer: bool
    recompute: bool
    param_offload: bool
    grad_offload: bool
    optimizer_offload: bool
    critic: bool
    lora: Any = None  # the policy's LoRA adapters (RunPlan.lora), None: every weight trains
    ep: int = 1  # expert parallelism (MoE)
    etp: int | None = None  # expert TP, None: TP
    sequence_parallel: bool = False  # megatron.sequence_parallel at TP > 1 (off at TP 1, as the workers build it)
    cp: int = 1  # context parallelism: each micro-batch's tokens split over CP ranks, which also shard the optimizer
    vision_params: int = 0  # a vision-language policy's tower: whole on every TP rank of the first stage

    def params(self, stage: int) -> int:
        return stage_parameters(self.spec, tp=self.tp, pp=self.pp, stage=stage, critic=self.critic, ep=self.ep,
                                etp=self.etp) + (self.vision_params if stage == 0 else 0)

    def expert_params(self) -> int:
        """Routed-expert parameters of one rank (its ``num_experts / EP`` experts' ETP shards, ``num_layers / PP``)."""
        if not self.spec.moe:
            return 0
        etp = self.tp if self.etp is None else self.etp
        layers = self.spec.num_layers  # the last stage's: the dense_layers come first
        moe_layers = sum(self.spec.moe_layer(i) for i in range(layers - layers // self.pp, layers))
        return moe_layers * self.spec.num_experts // self.ep * expert_parameters(self.spec) // etp

    def static(self, stage: int, dtype: dict) -> dict[str, float]:
        n = self.params(stage)
        # with LoRA only the adapters have gradients and optimizer state; the frozen base keeps its parameters
        trained = n if self.lora is None else lora_parameters(self.spec, self.lora, self.tp, self.pp)
        # megatron's distributed optimizer shards over the data- and context-parallel ranks
        optim = trained * dtype["optim"] / (self.dp * self.cp if self.distributed_optimizer else 1)
        if self.distributed_optimizer and self.lora is None and self.spec.moe:
            # the experts' state is sharded over the expert-data-parallel ranks (world / (ETP x EP x PP)), not DP
            experts = self.expert_params()
            etp = self.tp if self.etp is None else self.etp
            expert_dp = self.dp * self.tp // (etp * self.ep)
            optim = (trained - experts) * dtype["optim"] / (self.dp * self.cp) + experts * dtype["optim"] / expert_dp
        return {"params": (n + (trained if self.lora is not None else 0)) * dtype["param"],
                "grads": trained * dtype["grad"], "optimizer": optim}

    def activations(self, stage: int, tokens: int, dtype: dict) -> float:
        """Saved activations of the backward on ``stage`` for micro-batches of ``tokens``."""
        layers = self.spec.num_layers // self.pp
        in_flight = self.pp - stage  # 1F1B: stage s holds PP - s micro-batches (meshrl runs >= PP of them)
        if stage == 0 and self.vpp > 1:
            in_flight *= 1 + (self.pp - 1) / (self.pp * self.vpp)
        per_layer = self.activation_bytes_per_token(dtype)
        if self.recompute:
            kept = self.spec.hidden_size // (self.tp if self.sequence_parallel else 1)  # each layer's input
            return in_flight * layers * kept * dtype["act"] * tokens + per_layer * tokens
        return in_flight * layers * per_layer * tokens

    def activation_bytes_per_token(self, dtype: dict) -> int:
        """One layer's, in this layout (:func:`activation_bytes_per_token`)."""
        return activation_bytes_per_token(self.spec, self.tp, dtype["act"], self.sequence_parallel, self.cp)


def runs_sequence_parallel(mg) -> bool:
    """Whether a role's model runs sequence-parallel: its key, at TP > 1 (``model_builder.transformer_config``)."""
    return bool(mg.sequence_parallel) and mg.tensor_model_parallel_size > 1


def any_flag(*sections, key: str) -> bool:
    return any(bool(section.get(key, False)) for section in sections)


def reward_model_memory(cfg, layout) -> RoleMemory:
    """The learned reward model's memory (``reward_model.enable``): forward-only, in its run-plan ``layout``
    (``RunPlan.reward_model_layout``, from ``reward_model.megatron``)."""
    from meshrl.parallel.model_builder import layout_problem_lines, model_spec

    rm, mg = cfg.reward_model, cfg.reward_model.megatron
    spec = model_spec(load_hf_config(rm.model.path))
    if problems := layout_problem_lines(spec, layout, "reward_model.megatron"):
        raise PlanError("; ".join(problems))
    return RoleMemory(spec=spec, tp=layout.tensor, pp=layout.pipeline, vpp=1, dp=layout.data, cp=layout.context,
                      distributed_optimizer=False, recompute=False,
                      param_offload=any_flag(mg, rm.model.fsdp_config, key="param_offload"),
                      grad_offload=False, optimizer_offload=False, critic=True,
                      sequence_parallel=runs_sequence_parallel(mg))
