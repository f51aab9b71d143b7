"""The learned reward model (``reward_model.enable``): a discriminative model, an HF ``*ForSequenceClassification``
checkpoint with one label, run forward-only as a Megatron role with its own layout (``reward_model.megatron``) and
micro-batching (``reward_model.micro_batch_size_per_gpu`` / ``use_dynamic_bsz`` + ``forward_max_token_len_per_gpu``),
colocated with the policy like the critic.

Score of a response (verl's reward loop, ``meshrl.rewards.reward_model_inputs``): the prompt's chat messages plus
the decoded response as the assistant's turn, rendered with the reward model's own chat template and tokenizer;
the ``score`` head at the last token of that sequence. The score becomes the response's reward at its last token
(``token_level_scores``), in place of the rule-based function's — or, with ``custom_reward_function.path``,
the function scores and reads it as ``extra_info["rm_score"]``. A causal LM with a custom function is a
generative judge instead (``meshrl.config.reward_model_kind``, ``meshrl.rewards.judge``).

The model is the critic's structure (a value head in place of the vocabulary projection; the checkpoint's
``score.weight``, no bias). meshrl's forward outputs at token t come from the hidden state before t
(``meshrl.parallel.forward``), so the sequence goes in as the "prompt" with one placeholder token after it as
the "response": the output at the placeholder is the head applied to the last real token, which causal
attention keeps independent of the placeholder.

``reward_model_checks.reward_model_problems(cfg)`` checks the checkpoint at preflight, before Ray starts.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from meshrl.protocol import Batch
from meshrl.workers.dispatch import DispatchGroup
from meshrl.workers.engine import NonFinitePolicy, TrainingEngine
from meshrl.workers.rank import RankWorker


class RewardModelWorker(RankWorker):
    SECTION = "reward_model"

    def setup(self, address: tuple[str, int]) -> dict[str, Any]:
        from transformers import AutoConfig, AutoTokenizer

        from meshrl.parallel.forward import OutputRequest
        from meshrl.parallel.hf_conversion import load_hf_weights
        from meshrl.parallel.model_builder import build_forward_only_model, packed_sequences, param_dtype

        rm = self.section
        megatron = rm.megatron
        self._init_distributed(address, self.plan.reward_model_layout, megatron.seed,
                               int(os.environ.get("MESHRL_THREADS", "1")))
        trust = {"trust_remote_code": rm.model.trust_remote_code}
        self.hf_config = AutoConfig.from_pretrained(self.model_dir, **trust)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir, **trust)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.model = build_forward_only_model(self.hf_config, critic=True, dtype=param_dtype(megatron.dtype),
                                              **dict(megatron.override_transformer_config),
                                              sequence_parallel=megatron.sequence_parallel)
        load_hf_weights(self.model, self.model_dir, self.hf_config)
        self.request = OutputRequest(remove_padding=packed_sequences(rm.model.use_remove_padding))
        self.engine = TrainingEngine("reward_model", self.model, None, None, self.pad_id,
                                     min_micro=megatron.pipeline_model_parallel_size,
                                     nonfinite=NonFinitePolicy.from_settings(self.plan.workers))
        self._init_offload()
        return {**self.layout_dict(), "num_replicas": self.layout.dp_size}

    def _init_offload(self) -> None:
        from meshrl.parallel.offload import HostBuffers

        rm = self.section
        self.offload_params = rm.megatron.param_offload or rm.model.fsdp_config.param_offload
        self.host_buffers = HostBuffers()
        self.offloaded = None
        self._offload()

    def _offload(self) -> None:
        from meshrl.parallel.offload import offload

        if self.offload_params:
            self.offloaded = offload(self.model, params=True, grads=False, optimizer_state=False,
                                     buffers=self.host_buffers)

    @contextlib.contextmanager
    def _on_device(self):
        if self.offloaded is not None:
            self.offloaded.restore()
            self.offloaded = None
        try:
            yield
        finally:
            self._offload()

    def compute_scores(self, shard: Batch) -> Batch | None:
        """``rm_scores`` (B,): the head at each sequence's last token (``prompt_ids``: the rendered sequences;
        ``responses``: one placeholder token each, see the module docstring)."""
        with self._on_device():
            values = self.engine.forward(shard, self.plan.micro_batching["reward_model"], self.request, "values", 1)
        return Batch(tensors={"rm_scores": values[:, 0].float()}) if self.layout.collect else None


class RewardModelGroup(DispatchGroup):
    """The driver's handle: renders the batch's conversations for the reward model and collects its scores."""

    def __init__(self, cfg, plan, model_dir) -> None:
        from transformers import AutoTokenizer

        super().__init__(RewardModelWorker, cfg, plan, model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir,
                                                       trust_remote_code=cfg.reward_model.model.trust_remote_code)
        self.max_length = cfg.reward_model.max_length

    def compute_scores(self, batch: Batch, policy_tokenizer) -> torch.Tensor:
        """The reward model's score of each row of ``batch`` (``raw_prompt`` chat messages + ``responses``), (B,)."""
        inputs = reward_model_batch(batch, policy_tokenizer, self.tokenizer, self.max_length)
        return self.dispatch("compute_scores", inputs)["rm_scores"]


def reward_model_batch(batch: Batch, policy_tokenizer, rm_tokenizer, max_length: int | None = None) -> Batch:
    """What ``RewardModelWorker.compute_scores`` takes for the rows of ``batch``: each conversation rendered for
    the reward model as ``prompt_ids``, one placeholder token as the response (module docstring)."""
    from meshrl.rewards.reward_model_inputs import reward_model_ids, strip_eos

    responses = [strip_eos(policy_tokenizer.decode(r[m.bool()].tolist()), policy_tokenizer.eos_token)
                 for r, m in zip(batch["responses"], batch["response_mask"])]
    ids = reward_model_ids([list(chat) for chat in batch["raw_prompt"]], responses, rm_tokenizer, max_length)
    placeholder = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else rm_tokenizer.eos_token_id
    rows = len(ids)
    return Batch(tensors={"responses": torch.full((rows, 1), placeholder, dtype=torch.long),
                          "response_mask": torch.ones(rows, 1, dtype=torch.long)},
                 non_tensors={"prompt_ids": ids})
