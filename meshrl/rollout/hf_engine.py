"""The transformers fallback engine (``rollout.name=hf``): same contract as the vLLM engine, slower.

For platforms without vLLM, and as an independent reference in tests. Prompts are left-padded into
micro-batches of ``hf_batch_size`` sequences (sorted by length to waste little padding) and decoded
with ``model.generate`` and its KV cache.

Log-probs: ``generate`` can return every step's raw logits, but that is steps x batch x vocab floats
(3 GB for 64 x 256 x 49k). Instead one logits processor, the only one in the list, sees the raw
logits of each step first and applies temperature, top-k and top-p itself, so ``generate`` samples
from exactly the distribution vLLM would. It keeps the ``log_softmax`` of the raw logits
(``raw_logprobs``) or of those processed ones (``processed_logprobs``: removed tokens are -inf, so it
renormalises over the kept ones, as vLLM does) until the next step reveals which token was chosen.
Memory: one batch x vocab matrix.

Seeding: ``generate`` samples with torch's global RNG, so each micro-batch runs inside a forked RNG
seeded from the call's per-prompt seeds; the global RNG is untouched. The same seed gives the same
tokens, but not the tokens vLLM draws with that seed (different samplers); greedy decoding agrees.

Configuration: ``load_format`` ``safetensors`` / ``pt`` read only that kind of weight file, ``auto`` /
``hf`` whichever the folder has; a dummy format builds the model from its config with random weights
(then ``generate`` waits for a sync). There is no prefix cache: every prompt is prefilled in full, which
gives the same outputs as vLLM's cache, only slower, so ``enable_prefix_caching=True`` (verl's default)
warns once that it has no effect here. vLLM's engine arguments (``vllm_kwargs``) are refused.

Vision-language models (a family with ``vision_language``): the family's own class
(``Qwen2_5_VLForConditionalGeneration``) is loaded, prompts come with their images (``generate(..., images=...)``:
each micro-batch hands ``generate`` its rows' ``pixel_values`` / ``image_grid_thw`` in row order and the image pads'
``mm_token_type_ids``, from which transformers positions the tokens), and the weights are addressed by the
checkpoint's names (transformers' in-memory names differ: ``model.language_model.*``), which the weight stream uses.

Weight syncs are addressed by the checkpoint's tensor names, which the weight stream sends. Where transformers 5
holds several checkpoint tensors in one parameter (a mixture-of-experts layer's experts fused into
``experts.gate_up_proj`` / ``experts.down_proj``, each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` in the
checkpoint), each checkpoint tensor is written into its place in the fused parameter: transformers' own reverse
conversion (``revert_weight_conversion``, what ``save_pretrained`` writes) is run once on a parameter holding each
element's index, which gives, for every checkpoint tensor, the elements of the parameter it occupies
(``_checkpoint_targets``).
"""

from __future__ import annotations

import os
import warnings
from typing import Mapping, Sequence

import torch

from meshrl.models.hf_config import apply_overrides
from meshrl.rollout.base import Completion, EngineConfig, RolloutEngine, SamplingConfig, default_dp_rank


class _LogprobsAndWarp:
    """A ``generate`` logits processor: records the chosen tokens' log-probs of ``logprobs_mode`` (see the
    module docstring), returns warped scores."""

    def __init__(self, sampling: SamplingConfig, logprobs_mode: str) -> None:
        self.sampling = sampling
        self.processed = logprobs_mode == "processed_logprobs"
        self.chosen_logprobs: list[torch.Tensor] = []
        self._previous: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._record(input_ids[:, -1])
        # Greedy scores are never processed: both modes report log softmax(logits) then, like vLLM.
        warped = scores if self.sampling.greedy else _warp(scores, self.sampling)
        self._previous = torch.log_softmax((warped if self.processed else scores).float(), dim=-1)
        return warped

    def _record(self, chosen: torch.Tensor) -> None:
        if self._previous is not None:
            self.chosen_logprobs.append(self._previous.gather(1, chosen[:, None])[:, 0])

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """(batch, steps) log-probs aligned with ``generated``, the tokens after the prompt."""
        if generated.shape[1] > len(self.chosen_logprobs):
            self._record(generated[:, len(self.chosen_logprobs)])
        self._previous = None
        if not self.chosen_logprobs:
            return generated.new_zeros(generated.shape, dtype=torch.float32)
        return torch.stack(self.chosen_logprobs, dim=1)


def _warp(scores: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (vLLM's order); removed tokens get -inf."""
    scores = scores / sampling.temperature
    if sampling.top_k != -1 and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


class HFEngine(RolloutEngine):
    """transformers ``generate`` behind the ``RolloutEngine`` contract (see the module docstring)."""

    name = "hf"
    takes_images = True

    def __init__(self, model_path: str | os.PathLike, config: EngineConfig | None = None, *,
                 dp_rank: int | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        config = config or EngineConfig(name="hf")
        super().__init__(model_path, config, default_dp_rank(1) if dp_rank is None else dp_rank)
        if config.enable_prefix_caching:
            warnings.warn("rollout.enable_prefix_caching=True has no effect with rollout.name=hf: the transformers "
                          "engine has no prefix cache and prefills every prompt in full (same outputs, slower); "
                          "set it to False to silence this", stacklevel=2)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = getattr(torch, config.dtype if config.dtype != "auto" else ("bfloat16" if cuda else "float32"))
        hf_config = apply_overrides(AutoConfig.from_pretrained(self.model_path), config.hf_overrides)
        model_class = _model_class(hf_config) or AutoModelForCausalLM
        if config.random_init:
            with torch.random.fork_rng(devices=[]):  # random weights without moving the caller's RNG
                model = model_class.from_config(hf_config, dtype=dtype) if model_class is AutoModelForCausalLM \
                    else model_class._from_config(hf_config, dtype=dtype)
        else:
            use_safetensors = {"safetensors": True, "pt": False}.get(config.load_format)
            model = model_class.from_pretrained(self.model_path, config=hf_config, dtype=dtype,
                                                use_safetensors=use_safetensors)
        self.model = model.to(self.device).eval().requires_grad_(False)
        # Only SamplingConfig decides how to sample: drop the checkpoint's generation defaults.
        self.model.generation_config = GenerationConfig()
        self.pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.image_token_id = getattr(hf_config, "image_token_id", None)
        self._targets = _checkpoint_targets(self.model)

    # --- generation -------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  seeds: list[int], max_tokens: list[int], images: list | None = None) -> list[Completion]:
        rows = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        order = sorted(range(len(rows)), key=lambda r: len(prompts[rows[r][0]]))
        results: dict[int, Completion] = {}
        size = self.config.hf_batch_size
        for batch_index, start in enumerate(range(0, len(order), size)):
            chunk = order[start:start + size]
            batch = [prompts[rows[r][0]] for r in chunk]
            # seeds[0] is already unique to this (replica, call); one RNG stream per micro-batch.
            caps = [max_tokens[rows[r][0]] for r in chunk]
            rows_images = None if images is None else [images[rows[r][0]] for r in chunk]
            tokens, logprobs = self._generate_batch(batch, sampling, seeds[0] + batch_index, max(caps), rows_images)
            for r, ids, lps, cap in zip(chunk, tokens, logprobs, caps):
                prompt_index, sample_index = rows[r]
                # A row decodes to its batch's longest cap; the tokens past its own were sampled after it ended.
                results[r] = self._completion(prompt_index, sample_index, ids[:cap], lps[:cap], sampling)
        return [results[r] for r in range(len(rows))]

    @torch.no_grad()
    def _generate_batch(self, batch: list[list[int]], sampling: SamplingConfig, seed: int,
                        max_new_tokens: int, images: list | None = None) -> tuple[list[list[int]], list[list[float]]]:
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        visual = self._image_inputs(input_ids, images) if images is not None and any(images) else {}
        recorder = _LogprobsAndWarp(sampling, self.config.logprobs_mode)
        stops = self.stop_token_ids(sampling)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(seed)
            # Neutral built-in warpers (temperature 1, no top-k/top-p): the recorder applies them.
            warpers = {} if sampling.greedy else dict(temperature=1.0, top_k=0, top_p=1.0)
            sequences = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                do_sample=not sampling.greedy, num_beams=1, max_new_tokens=max_new_tokens,
                eos_token_id=stops or None, pad_token_id=self.pad_token_id, logits_processor=[recorder],
                **visual, **warpers)
        generated = sequences[:, width:]
        return generated.tolist(), recorder.finish(generated).tolist()

    def _image_inputs(self, input_ids: torch.Tensor, images: list) -> dict[str, torch.Tensor]:
        """``generate``'s image arguments for a left-padded micro-batch: its rows' images in row order (transformers
        fills the image pads row by row) and the pads marked as images in ``mm_token_type_ids``."""
        rows = [row for row in images if row]
        return {"pixel_values": torch.cat([row["pixel_values"] for row in rows]).to(self.device, self.model.dtype),
                "image_grid_thw": torch.cat([torch.as_tensor(row["image_grid_thw"]).reshape(-1, 3)
                                             for row in rows]).to(self.device),
                "mm_token_type_ids": (input_ids == self.image_token_id).long().to(self.device)}

    def _completion(self, prompt_index: int, sample_index: int, ids: list[int], logprobs: list[float],
                    sampling: SamplingConfig) -> Completion:
        stops = set(self.stop_token_ids(sampling))
        for position, token in enumerate(ids):
            if token in stops:
                end = position + 1
                return Completion(prompt_index, sample_index, ids[:end], logprobs[:end], "stop")
        return Completion(prompt_index, sample_index, ids, logprobs, "length")

    # --- weights ----------------------------------------------------------------------------
    def expected_weights(self) -> Mapping[str, torch.Size]:
        return {name: param.shape if where is None else where.shape
                for name, (param, where) in self._targets.items()}

    def begin_weight_update(self) -> None:
        self._check_open()

    def load_weight_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in bucket:
                param, where = self._targets[name]
                if where is None:
                    param.copy_(tensor)
                else:  # a checkpoint tensor's elements in a fused parameter
                    param.view(-1).index_copy_(0, where.reshape(-1), tensor.reshape(-1).to(param.dtype))

    def _finish_weight_update(self) -> None:
        """Nothing to re-process: HF modules compute with their parameters directly."""

    def shutdown(self) -> None:
        if self._closed:
            return
        super().shutdown()
        del self.model, self._targets


def _model_class(hf_config):
    """The transformers class of a vision-language family's policy (its ``policy_class``), None for a text model
    (``AutoModelForCausalLM`` loads those, and models of no registered family)."""
    from meshrl.models.families import FAMILY_MODULES, family
    from meshrl.models.hf_classes import hf_class

    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILY_MODULES or not family(model_type).vision_language:
        return None
    return hf_class(family(model_type).policy_class)


def _checkpoint_targets(model) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Checkpoint tensor name -> (``model``'s parameter or saved buffer holding it, None when it is the whole tensor,
    else the indices into the flattened tensor of its elements, shaped as the checkpoint tensor). transformers renames
    some tensors in memory (a vision-language model's ``model.language_model.*`` is ``model.*`` in its checkpoint) and
    fuses others (module docstring); its reverse conversion says which."""
    from transformers.core_model_loading import revert_weight_conversion

    targets: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    saved_buffers = set(model.state_dict(keep_vars=True)) - {name for name, _ in model.named_parameters()}
    # the parameters, and the buffers a checkpoint holds (DeepSeek-V3's expert bias, which the policy's sync sends)
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in saved_buffers)]
    for name, param in tensors:
        saved = revert_weight_conversion(model, {name: param.detach().to("meta")})  # names and shapes, no copy
        if len(saved) == 1 and tuple(next(iter(saved.values())).shape) == tuple(param.shape):
            targets[next(iter(saved))] = (param, None)
            continue
        # float64 holds every index exactly (up to 2**53 elements)
        marker = torch.arange(param.numel(), dtype=torch.float64).view(param.shape)
        for key, tensor in revert_weight_conversion(model, {name: marker}).items():
            targets[key] = (param, tensor.to(param.device, torch.int64).contiguous())
    return targets
