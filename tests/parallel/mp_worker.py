"""Multi-process checks of meshrl.parallel, run under torchrun; one launch runs several layouts.

    torchrun --nproc-per-node 2 tests/parallel/mp_worker.py --suite w2 --workdir DIR --out DIR/w2.json

Each phase initialises one layout (TP/PP/VPP/DP), runs every check for it against Hugging Face
transformers references computed in-process, records raw measurements (max abs differences, counts),
and tears the megatron groups down; the default process group lives for the whole launch. Rank 0
writes the merged results (numbers: max over ranks) after every phase, so a later hang keeps earlier
results. ``tests/parallel/test_parallel_multiproc.py`` launches the suites and asserts thresholds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from meshrl.models import hf_classes  # noqa: E402,F401  (registers Gemma3TextForTokenClassification)
from meshrl.models.families import model_spec, text_model_types  # noqa: E402
from meshrl.models.tiny import TinySpec, tiny_config, tiny_model_dir, tiny_spec  # noqa: E402
from meshrl.parallel import checkpoint, hf_conversion, model_builder, offload, optimizer, schedule, state  # noqa: E402
from meshrl.parallel.forward import OutputRequest  # noqa: E402
from meshrl.models.tiny_vision import tiny_vl_model_dir  # noqa: E402
from vl_checks import check_vision_language  # noqa: E402

# The tiny model of every registered dense family (``tiny:<model_type>``); parity and export run on each. The
# mixture-of-experts families run under expert parallelism in moe_worker.py.
FAMILIES = {model_type: tiny_spec(model_type) for model_type in text_model_types()
            if not model_spec(tiny_config(tiny_spec(model_type))).moe}
LLAMA, QWEN2 = FAMILIES["llama"], FAMILIES["qwen2"]
LLAMA4 = TinySpec(num_hidden_layers=4)
# The policy's rollout temperature per family: 1 and != 1 both run at every layout.
TEMPERATURE = {"llama": 1.0, "qwen2": 0.7, "qwen3": 0.7, "mistral": 1.0, "gemma": 0.7, "gemma2": 1.0,
               "gemma3_text": 0.7, "phi3": 1.0, "glm4": 0.7}
TIMEOUT_S = 120.0

# The families whose policy runs at PP2 in `make test`. Splitting into stages is the same for every family except
# where a family depends on a layer's global index or on what sits at a stage's ends: Gemma's scaled embedding and
# (1 + w) final norm, Gemma 2's alternating sliding windows and final soft-capping, Gemma 3's local/global layer
# pattern and rotary bases; Llama and Qwen2 bring the tied and untied output layers. The Llama-like rest (Qwen3's
# q/k norms, Mistral, Phi-3's fused projections, GLM-4's extra norms) differ only inside a layer, which their TP2
# parity checks, and run at PP2 in `make test-extended` (the "pp2_families" phase of suite "w2x").
PP2_FAMILIES = ("llama", "qwen2", "gemma", "gemma2", "gemma3_text")
# The families whose critics (the family's decoder under a value head) run at every layout in `make test`; the
# other families' decoders are their policies' parity, and their critics run at TP2 in `make test-extended` (the
# "tp2_critics" phase of suite "w2x").
REPRESENTATIVE = ("llama", "qwen2")
OTHER_CRITICS = tuple(tag for tag in FAMILIES if tag not in REPRESENTATIVE)
# The vision-language families against transformers on image prompts (vl_checks.py) at TP1, TP2 (+SP) and PP2:
# Qwen2.5-VL's window-attention tower and M-RoPE; Qwen3-VL's interleaved M-RoPE, q/k norms and deepstack features
# (its deepstack layer on the first stage at PP2).
VL_TYPES = ("qwen2_5_vl", "qwen3_vl")
SUITES = {
    "w1": [("tp1", {})],
    "w2": [("tp2", dict(tensor_parallel=2)), ("pp2", dict(pipeline_parallel=2)),
           ("vpp2", dict(pipeline_parallel=2, virtual_pipeline=2)), ("dp2", {}), ("cp2", dict(context_parallel=2))],
    "w2x": [("pp2_families", dict(pipeline_parallel=2)), ("tp2_critics", dict(tensor_parallel=2))],
    "w4": [("tp2pp2", dict(tensor_parallel=2, pipeline_parallel=2)),
           ("cp2tp2", dict(context_parallel=2, tensor_parallel=2))],
}
# Adam's update g / (sqrt(v) + eps) turns fp32 rounding of near-zero gradients into O(lr) differences
# when eps is tiny; eps=1e-3 keeps the comparison well conditioned. The gradient norm (~7) exceeds
# clip_grad, so clipping is exercised.
OPT = optimizer.OptimizerConfig(lr=1e-3, min_lr=1e-4, weight_decay=0.1, eps=1e-3, clip_grad=1.0,
                                schedule="cosine", decay_steps=10)


# ---------------------------------------------------------------- data and references

def make_micro_batches(seed: int = 0) -> list[dict]:
    """Three micro-batches of different sizes and lengths (2 to 14 tokens): right padding, left padding,
    a hole."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 10), (3, 7), (2, 16)]
    batches = []
    for b, s in shapes:
        ids = torch.randint(0, 49152, (b, s), generator=g)
        mask = torch.ones(b, s, dtype=torch.long)
        batches.append({"input_ids": ids, "attention_mask": mask})
    batches[0]["attention_mask"][1, 6:] = 0  # right padding
    batches[1]["attention_mask"][0, :2] = 0  # left padding
    batches[1]["attention_mask"][2, :4] = 0
    batches[2]["attention_mask"][0, 5:7] = 0  # a hole between prompt and response
    batches[2]["attention_mask"][1, :14] = 0  # 2 tokens beside 14
    total = 0.0
    for mb in batches:
        mb["loss_mask"] = _loss_mask(mb["attention_mask"])
        mb["adv"] = torch.randn(mb["input_ids"].shape, generator=g)
        mb["returns"] = torch.randn(mb["input_ids"].shape, generator=g)
        total += float(mb["loss_mask"].sum())
    for mb in batches:
        mb["n_global"] = total
    return batches


def resplit(batches: list[dict]) -> list[dict]:
    """The same rows regrouped into three different micro-batches (and, at DP=2, a different DP split),
    with different padding widths."""
    rows = []
    for mb in batches:
        for i in range(mb["input_ids"].shape[0]):
            rows.append({k: (v[i] if isinstance(v, torch.Tensor) else v) for k, v in mb.items()})
    groups = [rows[:3], rows[3:4], rows[4:]]
    out = []
    for group in groups:
        width = max(r["input_ids"].shape[0] for r in group) + 2
        mb = {"n_global": group[0]["n_global"]}
        for key in ("input_ids", "attention_mask", "loss_mask", "adv", "returns"):
            padded = torch.zeros(len(group), width, dtype=group[0][key].dtype)
            for i, r in enumerate(group):
                padded[i, : r[key].shape[0]] = r[key]
            mb[key] = padded
        out.append(mb)
    return out


def _loss_mask(mask: torch.Tensor) -> torch.Tensor:
    first = torch.zeros_like(mask, dtype=torch.bool)
    first.scatter_(1, mask.argmax(dim=1, keepdim=True), True)
    return (mask.bool() & ~first).float()


def policy_loss(outputs: dict, mb: dict):
    m = mb["loss_mask"]
    loss = ((outputs["log_probs"] * mb["adv"] + 0.01 * outputs["entropy"]) * m).sum() / mb["n_global"]
    return loss, {"tokens": m.sum()}


def critic_loss(outputs: dict, mb: dict):
    m = mb["loss_mask"]
    return (((outputs["values"] - mb["returns"]) ** 2) * m).sum() / mb["n_global"], {}


def _hf_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HF's ``[b, s, out]`` logits of the padded batch (positions from the mask). With sliding-window layers
    each row's tokens run alone: HF's window counts a padded row's positions, padding included, where
    meshrl's (and vLLM's) counts the sequence's tokens."""
    from meshrl.models.families import model_spec

    if not model_spec(model.config).sliding_layers:
        return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    rows = []
    for row_ids, row_mask in zip(ids, mask.bool()):
        logits = model(input_ids=row_ids[row_mask][None]).logits[0]
        rows.append(logits.new_zeros(row_ids.shape[0], logits.shape[-1]).index_put((row_mask.nonzero()[:, 0],),
                                                                                    logits))
    return torch.stack(rows)


def hf_outputs(model, mb: dict, critic: bool, temperature: float = 1.0) -> dict:
    """HF outputs in meshrl's alignment: position t from the previous valid position; the policy's from
    ``log_softmax(logits / temperature)``."""
    ids, mask = mb["input_ids"], mb["attention_mask"]
    logits = _hf_logits(model, ids, mask)
    index = torch.arange(ids.shape[1]).expand_as(ids)
    last_valid = torch.cummax(torch.where(mask.bool(), index, torch.full_like(index, -1)), dim=1).values
    prev = torch.cat([torch.full_like(last_valid[:, :1], -1), last_valid[:, :-1]], dim=1)
    has_prev = (prev >= 0) & mask.bool()
    src = prev.clamp(min=0)
    if critic:
        values = logits.squeeze(-1).gather(1, src)
        return {"values": torch.where(has_prev, values, torch.zeros_like(values))}
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    rows = logp.gather(1, src.unsqueeze(-1).expand(-1, -1, logp.shape[-1]))
    lp = rows.gather(2, ids.unsqueeze(-1)).squeeze(-1)
    ent = -(rows.exp() * rows).sum(-1)
    zero = torch.zeros_like(lp)
    return {"log_probs": torch.where(has_prev, lp, zero), "entropy": torch.where(has_prev, ent, zero)}


def hf_model(path: Path, critic: bool):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    kwargs = {"num_labels": 1} if critic else {}
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kwargs)


def hf_reference(path: Path, batches: list[dict], critic: bool, temperature: float = 1.0):
    """(per-micro-batch outputs, loss, grads by HF name) of the HF model on ``batches``."""
    model = hf_model(path, critic)
    loss_fn = critic_loss if critic else policy_loss
    outputs, total = [], 0.0
    for mb in batches:
        out = hf_outputs(model, mb, critic, temperature)
        loss, _ = loss_fn(out, mb)
        loss.backward()
        total += float(loss)
        outputs.append({k: v.detach() for k, v in out.items()})
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return outputs, total, grads


# check_parity's HF references by (model, critic, temperature): computed once per process, read by every phase
REFERENCES: dict[tuple, tuple] = {}


def max_diff(a: dict | list, b: dict | list) -> float:
    if isinstance(a, list):
        return max(max_diff(x, y) for x, y in zip(a, b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def hf_tensors(chunks, path: Path, grads: bool = False) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig

    return {name: t.cpu() for name, t in hf_conversion.iter_hf_weights(chunks, AutoConfig.from_pretrained(path),
                                                                       grads=grads)}


# ---------------------------------------------------------------- checks

class Recorder:
    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def run(self, name: str, fn) -> None:
        start = time.monotonic()
        try:
            result = fn()
            if isinstance(result, dict):
                self.values.update({f"{name}.{k}": v for k, v in result.items()})
            else:
                self.values[name] = result
        except Exception:  # recorded, reported by pytest; printed too, for a launch that dies before reporting
            self.values[f"{name}.error"] = f"rank {dist.get_rank()}: {traceback.format_exc()}"
            print(self.values[f"{name}.error"], file=sys.stderr, flush=True)
        print(f"[rank {dist.get_rank()}] {name}: {time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)


def build(path: Path, critic: bool = False, **kwargs):
    from transformers import AutoConfig

    chunks = model_builder.build_model(AutoConfig.from_pretrained(path), critic=critic, **kwargs)
    hf_conversion.load_hf_weights(chunks, path)
    return chunks


def my_batches(items: list) -> list:
    """This DP rank's share: with DP=2, rank 0 takes the first two micro-batches, rank 1 the rest."""
    if state.dp_size() == 1:
        return items
    assert state.dp_size() == 2
    return items[:2] if state.dp_rank() == 0 else items[2:]


def check_parity(path: Path, critic: bool, temperature: float = 1.0, packed_only: bool = False,
                 **build_kwargs) -> dict:
    """Outputs, loss and grads against HF, in the row layout and packed (THD, ``packed.*`` keys), and the
    packed outputs against the row layout's (``packed_vs_rows``); the policy's at ``temperature``. ``packed_only``:
    the packed layout alone (context parallelism packs whatever is asked)."""
    batches = make_micro_batches()
    key = (str(path), critic, temperature)
    if key not in REFERENCES:
        REFERENCES[key] = hf_reference(path, batches, critic, temperature)
    ref_out, ref_loss, ref_grads = REFERENCES[key]
    mine, mine_ref = my_batches(batches), my_batches(ref_out)
    chunks = build(path, critic, **build_kwargs)
    result, rows_out = {}, None
    for remove_padding in (True,) if packed_only else (False, True):
        prefix = "packed." if remove_padding else ""
        request = OutputRequest(entropy=not critic, temperature=temperature, remove_padding=remove_padding)
        out = schedule.forward_only(chunks, mine, request)
        for key in mine_ref[0]:
            result[prefix + key] = max(float((o[key] - r[key]).abs().max()) for o, r in zip(out, mine_ref))
        if remove_padding and rows_out is not None:
            result["packed_vs_rows"] = max_diff(out, rows_out)
        rows_out = out
        for chunk in chunks:
            chunk.zero_grad_buffer()
        passed = schedule.forward_backward(chunks, mine, critic_loss if critic else policy_loss, request)
        result[prefix + "loss"] = abs(passed.loss - ref_loss)
        grads = hf_tensors(chunks, path, grads=True)
        result[prefix + "grad_names_mismatch"] = len(set(ref_grads) ^ set(grads))
        result[prefix + "grads"] = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads if k in grads)
        result.update({prefix + key: value
                       for key, value in check_selected(chunks, path, mine, critic, request).items()})
    result["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())
    return result


def check_selected(chunks, path: Path, batches: list[dict], critic: bool, request: OutputRequest) -> dict:
    """``output_mask`` (the second half of each row's loss tokens, like responses after a prompt; none at
    all in the last micro-batch, like a placeholder): outputs equal the unselected run's there and are 0
    elsewhere; a loss on those tokens has the same gradient."""
    selected, unselected = [], []
    for i, mb in enumerate(batches):
        keep = mb["loss_mask"] * (mb["loss_mask"].cumsum(1) > mb["loss_mask"].sum(1, keepdim=True) / 2)
        if i == len(batches) - 1:
            keep = torch.zeros_like(keep)
        selected.append({**mb, "loss_mask": keep, "output_mask": keep})
        unselected.append({**mb, "loss_mask": keep})
    outputs = [schedule.forward_only(chunks, mbs, request) for mbs in (selected, unselected)]
    result = {"selected_outputs": max(float((a[key] - b[key] * mb["output_mask"]).abs().max())
                                      for a, b, mb in zip(*outputs, selected) for key in a)}
    runs = []
    for mbs in (selected, unselected):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        passed = schedule.forward_backward(chunks, mbs, critic_loss if critic else policy_loss, request)
        runs.append((passed.loss, hf_tensors(chunks, path, grads=True)))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    result["selected_loss"] = abs(loss_a - loss_b)
    result["selected_grads"] = max(float((grads_a[k] - grads_b[k]).abs().max()) for k in grads_a)
    return result


def check_sequence_parallel(path: Path, critic_path: Path) -> dict:
    """Megatron sequence parallelism on vs off at this layout (TP2): per-token outputs of ``forward_only`` and the
    loss and every gradient of one ``forward_backward``, for the policy in rows (every position) and packed with
    the fused output layer on response positions (``output_mask``, the workers' layout), and the critic in rows
    on response positions and packed. ``outputs_widened``: row micro-batches whose longest row is not a multiple
    of TP, which run one padding column wider with sequence parallelism (``forward.trim_rows``)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    batches = my_batches(make_micro_batches())
    responses = []
    for mb in batches:  # the second half of each row's loss tokens, as responses after a prompt
        keep = mb["loss_mask"] * (mb["loss_mask"].cumsum(1) > mb["loss_mask"].sum(1, keepdim=True) / 2)
        responses.append({**mb, "loss_mask": keep, "output_mask": keep})
    runs = {"policy_rows": (path, False, OutputRequest(entropy=True, temperature=0.7), batches),
            "policy_packed_fused_responses": (path, False, OutputRequest(
                entropy=True, temperature=0.7, remove_padding=True, fused_chunk_size=4), responses),
            "critic_rows_responses": (critic_path, True, OutputRequest(), responses),
            "critic_packed": (critic_path, True, OutputRequest(remove_padding=True), batches)}
    result = {"widened_micro_batches": 0}  # the rows runs must have some, or their looser bound was never used
    for name, (model, critic, request, mbs) in runs.items():
        passes = []
        for sequence_parallel in (False, True):
            chunks = build(model, critic, sequence_parallel=sequence_parallel)
            result[f"{name}.enabled_as_asked"] = result.get(f"{name}.enabled_as_asked", 1) * int(
                model_builder.model_config(chunks).sequence_parallel == sequence_parallel)
            outputs = schedule.forward_only(chunks, mbs, request)
            passed = schedule.forward_backward(chunks, mbs, critic_loss if critic else policy_loss, request)
            passes.append((outputs, passed.loss, hf_tensors(chunks, model, grads=True)))
        (out_off, loss_off, grads_off), (out_on, loss_on, grads_on) = passes
        widened = [not request.remove_padding and int(mb["attention_mask"].sum(1).max()) % tp != 0 for mb in mbs]
        result["widened_micro_batches"] += sum(widened)
        for tag, wanted in (("outputs", False), ("outputs_widened", True)):
            result[f"{name}.{tag}"] = max([max_diff(a, b) for a, b, w in zip(out_off, out_on, widened) if w == wanted],
                                          default=0.0)
        result[f"{name}.loss"] = abs(loss_on - loss_off)
        result[f"{name}.grads"] = max(float((grads_on[k] - grads_off[k]).abs().max()) for k in grads_off)
        result[f"{name}.grad_names_mismatch"] = len(set(grads_on) ^ set(grads_off))
    return result


def shared_prompt_batches(seed: int = 3) -> list[dict]:
    """RL micro-batches of groups of responses to one prompt (left-padded prompts up to column ``PROMPT_END``,
    right-padded responses of different lengths, an empty one), beside rows whose prompt no other row has."""
    from meshrl.parallel.shared_prefix import PROMPT_END

    g = torch.Generator().manual_seed(seed)
    # per micro-batch: prompt columns, then per prompt (its length, its responses' lengths)
    shapes = [(6, [(5, [4, 7, 2]), (3, [5])]), (4, [(4, [3, 3]), (2, [6, 0, 1]), (3, [2])]), (7, [(7, [5, 8, 3, 6])])]
    batches, total = [], 0.0
    for width, prompts in shapes:
        longest = max(max(lengths) for _, lengths in prompts)
        rows = sum(len(lengths) for _, lengths in prompts)
        ids = torch.zeros(rows, width + longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        row = 0
        for length, responses in prompts:
            prompt = torch.randint(0, 49152, (length,), generator=g)
            for response in responses:
                ids[row, width - length:width] = prompt
                ids[row, width:width + response] = torch.randint(0, 49152, (response,), generator=g)
                mask[row, width - length:width + response] = 1
                row += 1
        out = torch.zeros_like(mask)
        out[:, width:] = mask[:, width:]
        batches.append({"input_ids": ids, "attention_mask": mask, "output_mask": out, PROMPT_END: width,
                        "loss_mask": out.float(), "adv": torch.randn(ids.shape, generator=g),
                        "returns": torch.randn(ids.shape, generator=g)})
        total += float(out.sum())
    for mb in batches:
        mb["n_global"] = total
    return batches


def check_shared_prompts(path: Path, critic: bool = False, temperature: float = 1.0, **build_kwargs) -> dict:
    """The shared-prompt layout against each row with its own copy of the prompt, rows and packed: outputs of
    ``forward_only`` (the old-log-prob and reference passes), loss and every gradient of ``forward_backward`` (the
    update); ``tokens_saved``: the model ran fewer tokens."""
    from meshrl.parallel import forward

    batches = my_batches(shared_prompt_batches())
    chunks = build(path, critic, **build_kwargs)
    result = {"unsupported": int(model_builder.shared_prompts_unsupported(chunks) is not None)}
    loss_fn = critic_loss if critic else policy_loss
    runs = {}
    for name, remove_padding, shared in (("rows", False, False), ("packed", True, False), ("shared", False, True),
                                          ("shared_packed", True, True)):
        request = OutputRequest(entropy=not critic, temperature=temperature, remove_padding=remove_padding,
                                shared_prompts=shared)
        outputs = schedule.forward_only(chunks, batches, request)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        passed = schedule.forward_backward(chunks, batches, loss_fn, request)
        runs[name] = (outputs, passed.loss, hf_tensors(chunks, path, grads=True))
    for shared, plain in (("shared", "rows"), ("shared_packed", "packed")):
        (out_a, loss_a, grads_a), (out_b, loss_b, grads_b) = runs[shared], runs[plain]
        for key in out_b[0]:
            result[f"{shared}.{key}"] = max(float((a[key] - b[key]).abs().max()) for a, b in zip(out_a, out_b))
        result[f"{shared}.loss"] = abs(loss_a - loss_b)
        result[f"{shared}.grads"] = max(float((grads_a[k] - grads_b[k]).abs().max()) for k in grads_b)
    packed = sum(forward.pack_thd(mb["input_ids"], mb["attention_mask"], 1).input_ids.shape[1] for mb in batches)
    shared = sum(forward.pack_shared(mb["input_ids"], mb["attention_mask"], mb["response_start"], 1).input_ids.shape[1]
                 for mb in batches)
    result["tokens_saved"] = packed - shared
    return result


def check_context_split(path: Path) -> dict:
    """Under context parallelism each rank runs its 1/CP of every packed micro-batch (``forward.model_inputs``), and
    the ranks' selected outputs together are every wanted output once."""
    from megatron.core import parallel_state

    from meshrl.parallel import forward

    cp = parallel_state.get_context_parallel_world_size()
    uneven, outputs = 0, 0
    for mb in make_micro_batches():
        whole = forward.pack_thd(mb["input_ids"], mb["attention_mask"], forward.pad_multiple_for(
            parallel_state.get_tensor_model_parallel_world_size(), cp))
        mine = forward.model_inputs(mb["input_ids"], mb["attention_mask"], True)
        uneven += int(mine.input_ids.shape[1] * cp != whole.input_ids.shape[1])
        counts = torch.tensor([len(mine.selected)])
        dist.all_reduce(counts, group=parallel_state.get_context_parallel_group())
        outputs += abs(int(counts) - int((mb["attention_mask"].sum(1) - 1).clamp(min=0).sum()))
    # rows of 4 tokens at CP2 (TP1): chunks of one token, and the only output (the last token's, predicted by
    # position 2) on one rank: the other runs its output layer on nothing, fused or not, and the sum is HF's
    lonely = 0.0
    if cp == 2 and parallel_state.get_tensor_model_parallel_world_size() == 1:
        ids = torch.randint(0, 1000, (2, 4), generator=torch.Generator().manual_seed(5))
        wanted = torch.zeros_like(ids)
        wanted[:, 3] = 1
        mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "output_mask": wanted}
        reference = hf_outputs(hf_model(path, critic=False), mb, critic=False)["log_probs"][:, 3]
        chunks = build(path)
        for fused in (None, 4):
            (got,) = schedule.forward_only(chunks, [mb], OutputRequest(remove_padding=True, fused_chunk_size=fused))
            lonely = max(lonely, float((got["log_probs"][:, 3] - reference).abs().max()))
    return {"uneven_shards": uneven, "outputs_missing_or_doubled": outputs, "cp": cp, "lonely_rank_log_probs": lonely}


def check_forward_only_model(path: Path) -> dict:
    """``build_forward_only_model`` (RL's reference): the trainable build's outputs bit for bit, also after a
    host offload round trip; no DDP wrapper, grad buffer or gradient; the parameter bytes ``meshrl plan``
    counts for it."""
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from meshrl.memory_plan import stage_parameters

    batches, request = my_batches(make_micro_batches()), OutputRequest(entropy=True)
    trainable = build(path)
    model = model_builder.build_forward_only_model(AutoConfig.from_pretrained(path))
    hf_conversion.load_hf_weights(model, path)
    params = [p for chunk in model for p in chunk.parameters()]
    result = {
        "training": sum(chunk.training for chunk in model),
        # megatron DDP keeps its buffers in an instance attribute named like nn.Module.buffers().
        "wrapped_or_grad_buffers": sum(chunk is not model_builder.unwrap(chunk) or "buffers" in vars(chunk)
                                       for chunk in model) + sum(hasattr(p, "main_grad") for p in params),
        "trainable_grad_buffer_bytes": sum(buffer.grad_data.nbytes for chunk in trainable
                                           for buffer in vars(chunk)["buffers"]),
    }
    expected = schedule.forward_only(trainable, batches, request)
    result["outputs"] = max_diff(expected, schedule.forward_only(model, batches, request))
    offload.offload(model, params=True, grads=False, optimizer_state=False, include_host_tensors=True).restore()
    result["outputs_after_offload"] = max_diff(expected, schedule.forward_only(model, batches, request))
    result["grads"] = sum(p.grad is not None for p in params)
    spec, parallel = model_builder.model_spec(AutoConfig.from_pretrained(path)), state.current()
    planned = stage_parameters(spec, tp=parallel.tensor_parallel, pp=parallel.pipeline_parallel,
                               stage=parallel_state.get_pipeline_model_parallel_rank())
    result["plan_bytes_diff"] = abs(planned * model_builder.model_config(model).params_dtype.itemsize
                                    - sum(p.nbytes for p in params))
    return result


def check_invariance(path: Path) -> dict:
    """Loss and grads with two different micro-batch splits (and DP splits) are the same, in the row
    layout and packed (``packed_*`` keys)."""
    batches = make_micro_batches()
    chunks = build(path)
    result = {}
    for remove_padding in (False, True):
        runs = []
        for split in (batches, resplit(batches)):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            passed = schedule.forward_backward(chunks, my_batches(split), policy_loss,
                                               OutputRequest(entropy=True, remove_padding=remove_padding))
            runs.append((passed.loss, hf_tensors(chunks, path, grads=True)))
        (loss_a, grads_a), (loss_b, grads_b) = runs
        prefix = "packed_" if remove_padding else ""
        result[prefix + "loss"] = abs(loss_a - loss_b)
        result[prefix + "grads"] = max(float((grads_a[k] - grads_b[k]).abs().max()) for k in grads_a)
    return result


def check_roundtrip(path: Path, workdir: Path, tag: str, critic: bool = False) -> dict:
    from safetensors import safe_open
    from transformers import AutoConfig

    chunks = build(path, critic)
    params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    shares = sum(t.untyped_storage().data_ptr() in params
                 for _, t in hf_conversion.iter_hf_weights(chunks, AutoConfig.from_pretrained(path)))
    out = workdir / f"roundtrip-{tag}-dp{state.dp_rank()}"  # each DP replica writes its own copy
    hf_conversion.save_hf_checkpoint(chunks, AutoConfig.from_pretrained(path), out, tokenizer_dir=path)
    dist.barrier()
    mismatches = 0
    if dist.get_rank() == 0:
        original = hf_conversion.HFCheckpointReader(path)
        exported = hf_conversion.HFCheckpointReader(out)
        names = set(original.file_of)
        mismatches += len(names ^ set(exported.file_of))
        for name in names & set(exported.file_of):
            mismatches += not torch.equal(original.read(name), exported.read(name))
        mismatches += (path / "tokenizer.json").is_file() != (out / "tokenizer.json").is_file()
        with safe_open(out / "model.safetensors", framework="pt"):
            pass
    return {"mismatches": mismatches, "yielded_views_of_params": shares}


def reference_adam(path: Path, batches: list[dict], steps: int) -> dict[str, torch.Tensor]:
    """HF model + torch AdamW (megatron's wd groups, clip, cosine LR) after ``steps`` updates."""
    model = hf_model(path, critic=False)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPT.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=OPT.lr, betas=OPT.betas, eps=OPT.eps)
    for step in range(steps):
        lr = OPT.min_lr + 0.5 * (OPT.lr - OPT.min_lr) * (1 + math.cos(math.pi * step / OPT.decay_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        for mb in batches:
            loss, _ = policy_loss(hf_outputs(model, mb, False), mb)
            loss.backward()
        if OPT.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.clip_grad)
        opt.step()
    return {name: p.detach().clone() for name, p in model.state_dict().items() if name != "lm_head.weight"
            or not model.config.tie_word_embeddings}


def check_optimizer(path: Path, distributed_optimizer: bool = False) -> dict:
    batches = make_micro_batches()
    chunks = build(path, use_distributed_optimizer=distributed_optimizer)
    opt, sched = optimizer.build_optimizer(chunks, optimizer.OptimizerConfig(
        **{**vars(OPT), "use_distributed_optimizer": distributed_optimizer}))
    stats = [optimizer.train_step(chunks, opt, sched, my_batches(batches), policy_loss, OutputRequest(entropy=True))
             for _ in range(2)]
    weights = hf_tensors(chunks, path)
    reference = reference_adam(path, batches, 2)
    original = hf_conversion.HFCheckpointReader(path)
    lr1 = OPT.min_lr + 0.5 * (OPT.lr - OPT.min_lr) * (1 + math.cos(math.pi / OPT.decay_steps))
    return {"weights": max(float((weights[k] - reference[k]).abs().max()) for k in reference),
            "moved": max(float((weights[k] - original.read(k)).abs().max()) for k in reference),
            "lr": abs(stats[1]["lr"] - lr1) + abs(stats[0]["lr"] - OPT.lr),
            "clipped": float(stats[0]["grad_norm"] > OPT.clip_grad)}


def check_checkpoint_save(path: Path, workdir: Path) -> dict:
    """TP2: two updates, save at step 2 (with a simulated crash of a later save), then update 3."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    batches = make_micro_batches()
    chunks = build(path)
    opt, sched = optimizer.build_optimizer(chunks, OPT)
    for _ in range(2):
        optimizer.train_step(chunks, opt, sched, batches, policy_loss, OutputRequest(entropy=True))
    root = workdir / "ckpt"
    checkpoint.save_checkpoint(root, 2, chunks, opt, sched, extra={"data_position": 7})

    real_save = dist_checkpointing.save

    def crashing_save(*args, **kwargs):
        real_save(*args, **kwargs)
        raise RuntimeError("simulated crash after writing shards, before the rename")

    dist_checkpointing.save = crashing_save
    crashed = 0
    try:
        checkpoint.save_checkpoint(root, 3, chunks, opt, sched)
    except RuntimeError:
        crashed = 1
    finally:
        dist_checkpointing.save = real_save
    dist.barrier()
    latest = checkpoint.latest_checkpoint(root)
    after_crash_ok = int(crashed == 1 and latest is not None and latest.name == "step_00000002"
                         and (root / ".step_00000003.tmp").exists() and not (root / "step_00000003").exists())
    # Offload round trip on the trained state (CPU storages, the same cycle as on GPU).
    snapshot = [t.detach().clone() for t in offload._model_tensors(chunks, True, True)]
    snapshot += [t.detach().clone() for t in offload._optimizer_tensors(opt)]
    handle = offload.offload(chunks, opt, include_host_tensors=True)
    freed = int(all(p.untyped_storage().nbytes() == 0 for c in chunks for p in c.parameters()))
    handle.restore()
    restored = list(offload._model_tensors(chunks, True, True)) + list(offload._optimizer_tensors(opt))
    offload_exact = int(len(restored) == len(snapshot) and all(torch.equal(a, b) for a, b in zip(snapshot, restored)))

    optimizer.train_step(chunks, opt, sched, batches, policy_loss, OutputRequest(entropy=True))
    weights = hf_tensors(chunks, path)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(workdir / "ckpt_step3_reference.safetensors"))
    dist.barrier()
    return {"atomic": after_crash_ok, "offload_freed": freed, "offload_exact": offload_exact}


def check_checkpoint_load(path: Path, workdir: Path) -> dict:
    """Load the TP2 checkpoint at this layout, run update 3, compare with TP2's update 3."""
    from safetensors.torch import load_file

    batches = make_micro_batches()
    chunks = build(path)
    opt, sched = optimizer.build_optimizer(chunks, OPT)
    loaded = checkpoint.load_checkpoint(workdir / "ckpt", chunks, opt, sched)
    stats = optimizer.train_step(chunks, opt, sched, my_batches(batches), policy_loss, OutputRequest(entropy=True))
    reference = load_file(str(workdir / "ckpt_step3_reference.safetensors"))
    weights = hf_tensors(chunks, path)
    lr2 = OPT.min_lr + 0.5 * (OPT.lr - OPT.min_lr) * (1 + math.cos(math.pi * 2 / OPT.decay_steps))
    return {"weights": max(float((weights[k] - reference[k]).abs().max()) for k in reference),
            "step": loaded["step"], "extra_ok": int(loaded["extra"] == {"data_position": 7}),
            "lr": abs(stats["lr"] - lr2)}


def check_checkpoint_roundtrip(path: Path, workdir: Path, tag: str, distributed_optimizer: bool) -> dict:
    """Save after one update, load into a fresh model + optimizer, both take update 2: same weights."""
    batches = make_micro_batches()
    config = optimizer.OptimizerConfig(**{**vars(OPT), "use_distributed_optimizer": distributed_optimizer})
    runs = []
    for load in (False, True):
        chunks = build(path, use_distributed_optimizer=distributed_optimizer)
        opt, sched = optimizer.build_optimizer(chunks, config)
        if load:
            checkpoint.load_checkpoint(workdir / f"ckpt-{tag}", chunks, opt, sched)
        else:
            optimizer.train_step(chunks, opt, sched, my_batches(batches), policy_loss, OutputRequest(entropy=True))
            checkpoint.save_checkpoint(workdir / f"ckpt-{tag}", 1, chunks, opt, sched)
        optimizer.train_step(chunks, opt, sched, my_batches(batches), policy_loss, OutputRequest(entropy=True))
        runs.append(hf_tensors(chunks, path))
    return {"weights": max(float((runs[0][k] - runs[1][k]).abs().max()) for k in runs[0])}


def check_smollm2() -> dict:
    """The real SmolLM2-135M (30 layers, 9 heads / 3 KV heads, tied) against HF at TP1.

    The reference is HF's default attention (sdpa); HF's eager attention is recorded too, as the
    noise floor: HF's two implementations of the same model disagree by about as much.
    """
    from transformers import AutoModelForCausalLM

    from meshrl.models.embedded import smollm2_hf_dir

    path = smollm2_hf_dir()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 49152, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mb = {"input_ids": ids, "attention_mask": mask}
    sdpa = hf_outputs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mb, critic=False)
    eager = hf_outputs(hf_model(path, critic=False), mb, critic=False)
    out = schedule.forward_only(build(path), [mb], OutputRequest(entropy=True))[0]
    result = {key: float((out[key] - sdpa[key]).abs().max()) for key in sdpa}
    result.update({f"hf_eager_vs_sdpa_{key}": float((eager[key] - sdpa[key]).abs().max()) for key in sdpa})
    return result


def check_convert_cli(workdir: Path) -> dict:
    """hf-to-mcore then mcore-to-hf (bit-exact), and refusals that name the mismatching field."""
    from transformers import AutoConfig

    from meshrl.parallel import convert_cli

    source = tiny_model_dir(QWEN2)
    state.destroy()  # the CLI initialises its own layout
    codes = [convert_cli.main(["hf-to-mcore", "--hf", str(source), "--out", str(workdir / "cli-ckpt")]),
             convert_cli.main(["mcore-to-hf", "--ckpt", str(workdir / "cli-ckpt"), "--hf-config", str(source),
                               "--out", str(workdir / "cli-hf")])]
    original, exported = hf_conversion.HFCheckpointReader(source), hf_conversion.HFCheckpointReader(workdir / "cli-hf")
    mismatches = len(set(original.file_of) ^ set(exported.file_of)) + sum(
        not torch.equal(original.read(n), exported.read(n)) for n in original.file_of)
    wrong = workdir / "cli-wrong-config"
    config = AutoConfig.from_pretrained(source)
    config.num_key_value_heads = 4
    config.save_pretrained(wrong)
    import contextlib
    import io

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        refused_export = convert_cli.main(["mcore-to-hf", "--ckpt", str(workdir / "cli-ckpt"), "--hf-config",
                                           str(wrong), "--out", str(workdir / "cli-never")])
        (wrong / "model.safetensors").symlink_to(source / "model.safetensors")
        refused_import = convert_cli.main(["hf-to-mcore", "--hf", str(wrong), "--out", str(workdir / "cli-never")])
    message = stderr.getvalue()
    state.initialize(state.ParallelConfig(timeout_s=TIMEOUT_S))
    return {"exit_codes": max(codes), "mismatches": mismatches,
            "refused_export": int(refused_export == 2 and "num_key_value_heads" in message.split("\n")[0]),
            "refused_import": int(refused_import == 2 and "num_key_value_heads*head_dim" in message),
            "nothing_written": int(not (workdir / "cli-never").exists())}


def run_phase(name: str, layout: dict, workdir: Path) -> dict:
    state.initialize(state.ParallelConfig(timeout_s=TIMEOUT_S, **layout))
    rec = Recorder()
    llama, qwen2, llama4 = (tiny_model_dir(s) for s in (LLAMA, QWEN2, LLAMA4))
    if name == "tp1":
        rec.run("smollm2", check_smollm2)
        rec.run("convert_cli", lambda: check_convert_cli(workdir))
        for vl_type in VL_TYPES:
            rec.run(f"vision_language.{vl_type}", lambda: check_vision_language(tiny_vl_model_dir(vl_type)))
    elif name == "pp2_families":
        for tag in (tag for tag in FAMILIES if tag not in PP2_FAMILIES):
            path, temperature = tiny_model_dir(FAMILIES[tag]), TEMPERATURE[tag]
            rec.run(f"parity.{tag}", lambda: check_parity(path, False, temperature=temperature))
            rec.run(f"roundtrip.{tag}", lambda: check_roundtrip(path, workdir, f"{name}-{tag}"))
    elif name == "tp2_critics":
        for tag in OTHER_CRITICS:
            critic = workdir / f"critic-{tag}"
            rec.run(f"parity.{tag}_critic", lambda: check_parity(critic, True))
            rec.run(f"roundtrip.{tag}_critic", lambda: check_roundtrip(critic, workdir, f"{name}-{tag}c", True))
    elif name in ("cp2", "cp2tp2"):
        # Context parallelism: each packed sequence in 2·CP chunks over the CP ranks. At CP2 the families whose
        # attention differs (Qwen2's untied output layer and QKV bias, Gemma 2's soft-capping and sliding windows,
        # Gemma 3's local rotary bases), Llama's critic and the optimizer's step (gradients summed over CP); at
        # CP2 x TP2 Llama's policy and critic with sequence parallelism.
        tags = ("llama", "qwen2", "gemma2", "gemma3_text") if name == "cp2" else ("llama",)
        options = {"sequence_parallel": True} if name == "cp2tp2" else {}
        rec.run("context_split", lambda: check_context_split(llama))
        for tag in tags:
            path, temperature = tiny_model_dir(FAMILIES[tag]), TEMPERATURE[tag]
            rec.run(f"parity.{tag}", lambda: check_parity(path, False, temperature, packed_only=True, **options))
        rec.run("parity.llama_critic",
                lambda: check_parity(workdir / "critic-llama", True, packed_only=True, **options))
        rec.run("optimizer", lambda: check_optimizer(llama))
        if name == "cp2":  # the optimizer state sharded over the data- and context-parallel ranks; TP2's checkpoint
            rec.run("optimizer_distributed", lambda: check_optimizer(llama, distributed_optimizer=True))
            rec.run("checkpoint_load", lambda: check_checkpoint_load(llama, workdir))
    elif name == "vpp2":
        rec.run("parity.llama4", lambda: check_parity(llama4, False))
        rec.run("parity.llama4_critic", lambda: check_parity(workdir / "critic-llama4", True))
        rec.run("roundtrip.llama4", lambda: check_roundtrip(llama4, workdir, f"{name}-llama4"))
        rec.run("invariance", lambda: check_invariance(llama4))
        rec.run("checkpoint_roundtrip", lambda: check_checkpoint_roundtrip(llama4, workdir, name, False))
        rec.run("forward_only_model", lambda: check_forward_only_model(llama4))
    else:
        # Every family's policy at TP2 (its layers sharded), PP2_FAMILIES' policies at PP2. What the other
        # layouts add does not depend on the family: Llama and Qwen2 (tied and untied output layers, with and
        # without QKV bias) cover TP2xPP2 (both at once; world 4, two processes per core on 2 cores), DP2 (TP1
        # replicas) and the critic's value head at TP2 and on the last PP2 stage (REPRESENTATIVE).
        tags = tuple(FAMILIES) if name == "tp2" else PP2_FAMILIES if name == "pp2" else REPRESENTATIVE
        for tag in tags:
            path, critic, temperature = tiny_model_dir(FAMILIES[tag]), workdir / f"critic-{tag}", TEMPERATURE[tag]
            rec.run(f"parity.{tag}", lambda: check_parity(path, False, temperature=temperature))
            rec.run(f"roundtrip.{tag}", lambda: check_roundtrip(path, workdir, f"{name}-{tag}"))
            if tag in REPRESENTATIVE:
                rec.run(f"parity.{tag}_critic", lambda: check_parity(critic, True))  # values ignore the temperature
                rec.run(f"roundtrip.{tag}_critic", lambda: check_roundtrip(critic, workdir, f"{name}-{tag}c", True))
        rec.run("invariance", lambda: check_invariance(llama))
        rec.run("forward_only_model", lambda: check_forward_only_model(qwen2 if name == "pp2" else llama))
        if name in ("tp2", "pp2", "dp2"):  # the shared-prompt layout at TP2 (and with sequence parallelism), PP2, TP1
            rec.run("shared_prompts.llama", lambda: check_shared_prompts(llama, temperature=0.7))
            if name != "dp2":  # Gemma 3's local rotary bases and sliding windows; a critic's values
                gemma3 = tiny_model_dir(FAMILIES["gemma3_text"])
                rec.run("shared_prompts.gemma3_text", lambda: check_shared_prompts(gemma3))
                rec.run("shared_prompts.llama_critic", lambda: check_shared_prompts(workdir / "critic-llama", True))
            if name == "tp2":
                rec.run("shared_prompts.llama_sequence_parallel",
                        lambda: check_shared_prompts(llama, temperature=0.7, sequence_parallel=True))
        if name in ("tp2", "tp2pp2"):
            rec.run("sequence_parallel", lambda: check_sequence_parallel(llama, workdir / "critic-llama"))
        if name in ("tp2", "pp2"):  # Qwen2.5-VL and Qwen3-VL on image prompts; at TP2 with sequence parallelism too
            for vl_type in VL_TYPES:
                vl = tiny_vl_model_dir(vl_type)
                rec.run(f"vision_language.{vl_type}", lambda: check_vision_language(vl))
                if name == "tp2":
                    rec.run(f"vision_language.{vl_type}_sequence_parallel",
                            lambda: check_vision_language(vl, sequence_parallel=True))
            # Qwen3-VL's deepstack layers under full recompute (their features as checkpoint arguments), at PP2 and at
            # TP2 with sequence parallelism
            recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                             sequence_parallel=name == "tp2")
            rec.run("vision_language.qwen3_vl_recompute",
                    lambda: check_vision_language(tiny_vl_model_dir("qwen3_vl"), **recompute))
        if name == "tp2":
            rec.run("optimizer", lambda: check_optimizer(llama))
            rec.run("checkpoint_save", lambda: check_checkpoint_save(llama, workdir))
        else:
            rec.run("optimizer", lambda: check_optimizer(qwen2 if name == "pp2" else llama))
            rec.run("checkpoint_load", lambda: check_checkpoint_load(llama, workdir))
        if name == "dp2":
            rec.run("optimizer_distributed", lambda: check_optimizer(llama, distributed_optimizer=True))
            rec.run("checkpoint_roundtrip", lambda: check_checkpoint_roundtrip(llama, workdir, name, True))
    state.destroy()
    return rec.values


def merge(per_rank: list[dict]) -> dict:
    merged: dict[str, object] = {}
    for values in per_rank:
        for key, value in values.items():
            if isinstance(value, str):
                merged[key] = (merged.get(key, "") + "\n" + value).strip()
            elif isinstance(value, (int, float)):
                previous = merged.get(key)
                merged[key] = value if previous is None else max(previous, value)
    return merged


def make_critic_dirs(workdir: Path, tags=(*FAMILIES, "llama4")) -> None:
    """HF token-classification critics (random ``score`` head) built from the tiny causal LMs of ``tags``
    (``critic-<tag>``)."""
    from transformers import AutoModelForTokenClassification

    for tag, spec in {tag: LLAMA4 if tag == "llama4" else FAMILIES[tag] for tag in tags}.items():
        target = workdir / f"critic-{tag}"
        if (target / "model.safetensors").is_file():
            continue
        torch.manual_seed(1)
        model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir(spec), num_labels=1,
                                                                dtype=torch.float32)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 0.05)
            model.score.bias.fill_(0.1)
        model.save_pretrained(target)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", required=True, choices=sorted(SUITES))
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--phases", default=None, help="comma-separated subset of the suite's phases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    if dist.get_rank() == 0:
        args.workdir.mkdir(parents=True, exist_ok=True)
        for spec in (*FAMILIES.values(), LLAMA4):  # transformers saves a model only on rank 0: the cache, built here
            tiny_model_dir(spec)
        if args.suite in ("w2", "w4", "w2x"):  # the suites with critics
            make_critic_dirs(args.workdir, OTHER_CRITICS if args.suite == "w2x" else (*REPRESENTATIVE, "llama4"))
    dist.barrier()
    wanted = set(args.phases.split(",")) if args.phases else None
    results: dict[str, dict] = {}
    for name, layout in SUITES[args.suite]:
        if wanted and name not in wanted:
            continue
        values = run_phase(name, layout, args.workdir)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, values)
        results[name] = merge(gathered)
        if dist.get_rank() == 0:
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1))
            os.replace(tmp, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
