"""Between the RL batch layout and the parallel layer's micro-batches.

RL layout (a ``Batch``): ragged ``prompt_ids`` (object array of token lists), ``responses`` (B, R) and
``response_mask`` (B, R), right-padded, R = ``data.max_response_length``; per-token quantities
(log-probs, advantages, ...) are (B, R) aligned with ``responses``. ``response_mask`` is 1 on the tokens
the policy sampled, the ones trained on. A multi-turn rollout (``meshrl.rollout.agent_loop``) also has
tool-output tokens inside the response: 0 in ``response_mask``, yet read by the model like any other, so
its batch carries ``response_attention_mask`` (B, R), 1 on every response token; without that field the
two masks are one (``attended``).

Micro-batch layout (``meshrl.parallel.schedule``): ``input_ids`` / ``attention_mask`` (b, P + R_mb) with
prompts left-padded to the micro-batch's longest prompt P and responses trimmed to its longest
response R_mb, so every response starts at column P. The parallel layer's output ``out[:, t]``
concerns token t, hence the response part of any output is ``out[:, P:P + R_mb]``; its
``output_mask`` asks for the sampled response tokens' outputs only (prompt and tool tokens' are 0).

Micro-batches are formed by token budget (``meshrl.data.dynamic_batching.plan_micro_batches``:
Karmarkar–Karp balanced, a strict cap per micro-batch) or, without dynamic batching, by count
(``plan_fixed_micro_batches``), as ``meshrl.config.micro_batching`` says for the phase; either way the
same count on every data-parallel rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from meshrl.config.micro_batching import MicroBatching
from meshrl.data.mrope_positions import PROMPT_POSITIONS, continue_positions
from meshrl.data.dynamic_batching import MicroBatchPlan, plan_fixed_micro_batches, plan_micro_batches
from meshrl.parallel.shared_prefix import PROMPT_END
from meshrl.parallel.vision_language import MROPE_POSITIONS, MULTI_MODAL_INPUTS
from meshrl.protocol import Batch

# the micro-batch key of the column where responses start: where the shared-prompt layout takes the prompts to end
RESPONSE_START = PROMPT_END
ATTENTION_MASK = "response_attention_mask"
# The response mask before rejection sampling removed tokens from it (algorithm.rollout_correction.rollout_rs,
# meshrl.trainer.rollout_correction): every token the policy sampled; absent when nothing was rejected.
SAMPLED_MASK = "sampled_mask"
SEQUENCE_FIELDS = ("prompt_ids", "responses", "response_mask")
# (B, R) int64: the policy version that sampled each response token (meshrl.rollout.partial_rollout: a sample
# resumed across a weight sync spans several), -1 on padding and on tokens no version was recorded for; present
# only when the completions carry versions.
POLICY_VERSION = "rollout_policy_version"


def attended(batch: Batch) -> torch.Tensor:
    """(B, R) 1 on every response token the model reads: ``response_attention_mask``, else ``response_mask``."""
    return batch[ATTENTION_MASK] if ATTENTION_MASK in batch else batch["response_mask"]


def sampled(batch: Batch) -> torch.Tensor:
    """(B, R) 1 on every token the policy sampled: ``response_mask`` before any rejection (``SAMPLED_MASK``)."""
    return batch[SAMPLED_MASK] if SAMPLED_MASK in batch else batch["response_mask"]


def sequence_fields(batch: Batch) -> list[str]:
    """The fields a forward pass over ``batch``'s sequences needs (the attention mask when it has one, a
    vision-language model's images)."""
    return [*SEQUENCE_FIELDS, *(name for name in (ATTENTION_MASK, MULTI_MODAL_INPUTS) if name in batch)]


def sequence_lengths(batch: Batch) -> np.ndarray:
    """Tokens per sample: prompt + response tokens (tool outputs included)."""
    prompt = np.fromiter((len(p) for p in batch["prompt_ids"]), dtype=np.int64, count=len(batch))
    return prompt + attended(batch).sum(-1).long().numpy()


def build_micro_batch(batch: Batch, pad_id: int, response_fields: tuple[str, ...] = ()) -> dict[str, Any]:
    """One micro-batch dict from ``batch`` (see the module docstring); ``response_fields`` are trimmed to R_mb."""
    prompts = list(batch["prompt_ids"])
    mask = attended(batch)
    width = max(int(mask.sum(-1).max()), 1)
    start = max(len(p) for p in prompts)
    b = len(prompts)
    input_ids = torch.full((b, start + width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, start + width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, start - len(p):start] = torch.as_tensor(p, dtype=torch.long)
        attention[i, start - len(p):start] = 1
    input_ids[:, start:] = torch.where(mask[:, :width].bool(), batch["responses"][:, :width], pad_id)
    attention[:, start:] = mask[:, :width].long()
    # Outputs for the sampled response tokens only: the last stage skips the prompts' (and tools') output layer.
    output_mask = torch.zeros_like(attention)
    output_mask[:, start:] = batch["response_mask"][:, :width].long()
    micro = {"input_ids": input_ids, "attention_mask": attention, "output_mask": output_mask, RESPONSE_START: start}
    for name in ("response_mask", *response_fields):
        micro[name] = batch[name][:, :width]
    if MULTI_MODAL_INPUTS in batch:  # a vision-language model's rows: their images and 3-D positions
        rows = list(batch[MULTI_MODAL_INPUTS])
        micro[MULTI_MODAL_INPUTS] = rows
        micro[MROPE_POSITIONS] = mrope_columns(prompts, rows, start, width)
    return micro


def mrope_columns(prompts: list, images: list, start: int, width: int) -> torch.Tensor:
    """(b, 3, start + width) 3-D positions of a micro-batch's columns: each prompt's (its images' entry's
    ``PROMPT_POSITIONS``; a prompt without images is text, the same position on all three axes) ending at column
    ``start``, then the response's, one past the largest so far per token as generation continues them (tool tokens
    of a multi-turn response are text alike); 0 on padding, whose outputs nobody reads."""
    out = torch.zeros((len(prompts), 3, start + width), dtype=torch.long)
    for row, (prompt, entry) in enumerate(zip(prompts, images, strict=True)):
        given = entry.get(PROMPT_POSITIONS) if entry else None
        positions = torch.arange(len(prompt)).expand(3, -1) if given is None else torch.as_tensor(given)
        out[row, :, start - len(prompt):] = continue_positions(positions, width)
    return out


def responses_batch(prompts: Batch, completions, n: int, width: int, pad_id: int) -> Batch:
    """The RL batch of ``n`` completions per prompt, prompt-major (row = prompt · n + sample): the prompts'
    fields repeated, ``responses`` (pad-filled), ``response_mask`` (a completion's ``loss_mask`` where it has
    one), ``rollout_log_probs`` (B, ``width``) and ``finish_reason``; when the completions carry loss masks
    (multi-turn), also ``response_attention_mask``; when they carry policy versions (a partial rollout), also
    ``rollout_policy_version`` (``POLICY_VERSION``). Engines return completions in any order (vLLM: as they
    finish); each lands in its row."""
    out = prompts.repeat_interleave(n) if n > 1 else prompts.take(np.arange(len(prompts)))
    responses = torch.full((len(out), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(out), width), dtype=torch.float32)
    attention = torch.zeros((len(out), width), dtype=torch.float32)
    log_probs = torch.zeros((len(out), width), dtype=torch.float32)
    versions = torch.full((len(out), width), -1, dtype=torch.long)
    finish_reasons = [""] * len(out)
    for c in completions:
        row, length = c.prompt_index * n + c.sample_index, len(c.token_ids)
        responses[row, :length] = torch.as_tensor(c.token_ids)
        attention[row, :length] = 1.0
        mask[row, :length] = 1.0 if c.loss_mask is None else torch.as_tensor(c.loss_mask, dtype=torch.float32)
        log_probs[row, :length] = torch.as_tensor(c.logprobs)
        if c.policy_versions is not None:
            versions[row, :length] = torch.as_tensor(c.policy_versions, dtype=torch.long)
        finish_reasons[row] = c.finish_reason
    out.set("responses", responses)
    out.set("response_mask", mask)
    if any(c.loss_mask is not None for c in completions):
        out.set(ATTENTION_MASK, attention)
    out.set("rollout_log_probs", log_probs)
    if any(c.policy_versions is not None for c in completions):
        out.set(POLICY_VERSION, versions)
    out.set("finish_reason", finish_reasons)
    return out


def response_part(output: torch.Tensor, micro: dict[str, Any]) -> torch.Tensor:
    """The (b, R_mb) response columns of a (b, P + R_mb) parallel-layer output."""
    return output[:, micro[RESPONSE_START]:]


def prompt_groups(batch: Batch, max_token_len: int) -> tuple[list[list[int]], np.ndarray]:
    """The rows of each prompt (first appearance first), in runs whose shared-prompt layout (the prompt once, then
    each response) fits ``max_token_len`` tokens where the rows do one by one; (the runs' rows, their tokens)."""
    responses = attended(batch).sum(-1).long().numpy()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(batch["prompt_ids"]):
        groups.setdefault(tuple(prompt), []).append(row)
    runs, tokens = [], []
    for prompt, rows in groups.items():
        run, cost = [], len(prompt)
        for row in rows:
            if run and cost + responses[row] > max_token_len:
                runs.append(run)
                tokens.append(cost)
                run, cost = [], len(prompt)
            run.append(row)
            cost += int(responses[row])
        runs.append(run)
        tokens.append(cost)
    return runs, np.asarray(tokens, dtype=np.int64)


def plan_shared_prompts(batch: Batch, max_token_len: int, **counts: Any) -> MicroBatchPlan:
    """``plan_micro_batches`` over :func:`prompt_groups`' runs, each kept in one micro-batch so its prompt is shared
    there (``meshrl.parallel.shared_prefix``); the budget caps the tokens the micro-batches compute."""
    runs, tokens = prompt_groups(batch, max_token_len)
    by_run = plan_micro_batches(tokens, max_token_len, **counts)
    return MicroBatchPlan([[row for run in part for row in runs[run]] for part in by_run.micro_batches],
                          sequence_lengths(batch), max_token_len,
                          [row for run in by_run.oversized for row in runs[run]],
                          computed_tokens=by_run.tokens_per_micro_batch)


def split_micro_batches(batch: Batch, batching: MicroBatching, group: Any, pad_id: int,
                        response_fields: tuple[str, ...] = (), min_micro: int = 1,
                        multiple_of: int = 1, shared_prompts: bool = False
                        ) -> tuple[MicroBatchPlan, list[Batch], list[dict[str, Any]]]:
    """Micro-batches of ``batch`` by ``batching``'s token budget or count: (plan, rows of each, micro-batch dicts).
    With ``shared_prompts`` (the passes run the shared-prompt layout) a token budget keeps a prompt's rows together
    (:func:`plan_shared_prompts`); micro-batches by count are consecutive rows, which keeps them together already.

    Every data-parallel rank gets the same number of micro-batches; a rank with fewer sequences than
    micro-batches runs its surplus ones on a placeholder row whose response mask is all zero, which
    adds nothing to any loss or gradient.
    """
    counts = dict(group=group, min_num_micro_batches=min_micro, num_micro_batches_multiple_of=multiple_of)
    if batching.dynamic and shared_prompts:
        plan_ = plan_shared_prompts(batch, batching.max_token_len, **counts)
    elif batching.dynamic:
        plan_ = plan_micro_batches(sequence_lengths(batch), batching.max_token_len, **counts)
    else:
        plan_ = plan_fixed_micro_batches(sequence_lengths(batch), batching.micro_batch_size, **counts)
    rows, micros = [], []
    for indices in plan_.micro_batches:
        part = batch.take(indices)
        if not indices:
            placeholder = batch.take([0])
            for name in ("response_mask", ATTENTION_MASK):
                if name in placeholder:
                    placeholder.set(name, torch.zeros_like(placeholder[name]))
            micros.append(build_micro_batch(placeholder, pad_id, response_fields))
        else:
            micros.append(build_micro_batch(part, pad_id, response_fields))
        rows.append(part)
    return plan_, rows, micros


def gather_response_outputs(outputs: list[torch.Tensor], plan_: MicroBatchPlan, micro_rows: list[Batch],
                            width: int) -> torch.Tensor:
    """Per-micro-batch (b, R_mb) outputs → one (B, R) tensor in the batch's original row order."""
    rows = []
    for out, rows_batch in zip(outputs, micro_rows):
        if len(rows_batch) == 0:
            continue
        padded = torch.zeros((len(rows_batch), width), dtype=torch.float32)
        padded[:, :out.shape[1]] = out.float() * rows_batch["response_mask"][:, :out.shape[1]]
        rows.append(padded)
    stacked = torch.cat(rows)
    return stacked[torch.from_numpy(plan_.inverse_permutation)]
