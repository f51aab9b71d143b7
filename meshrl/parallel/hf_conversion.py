"""Hugging Face safetensors <-> megatron model chunks, streamed tensor by tensor.

One table, ``meshrl.models.families.hf_layout(spec, critic)``, lists every HF tensor of the model's family
in a fixed global order with where it lives in megatron: embedding / layer / head, the megatron parameter,
the dimension TP splits it on, and which part of a fused megatron parameter it is. This module places each
entry on its pipeline stage and virtual chunk and TP shard; it knows no family by name. Both directions
use it:

- ``load_hf_weights(chunks, hf_dir)``: each rank reads, with safetensors' lazy ``safe_open`` /
  ``get_slice``, only the rows or columns of its own TP shard of the tensors its PP stage owns, and
  copies them into place. No rank ever materialises the whole model or even a whole sharded tensor.
- ``iter_hf_weights(chunks, hf_config)``: yields full HF tensors one at a time on every rank of the
  model-parallel group (used by ``save_hf_checkpoint`` and by the rollout weight sync).

Megatron layouts handled (local and Transformer Engine specs alike):

- ``linear_qkv`` rows are grouped per KV group, ``[q_g (nq/nkv heads); k_g; v_g]`` for g in groups,
  and TP gives each rank a contiguous run of whole groups; a QKV bias (Qwen2) follows the same layout.
- q/k layernorm weights (Qwen3's ``q_norm`` / ``k_norm``, one ``head_dim`` gamma for all heads) are
  replicated over TP, like the other norms.
- ``linear_fc1`` is ``[gate; up]`` *per TP rank*: each rank holds its slice of gate then its slice of up.
- ``linear_proj`` (``o_proj``) and ``linear_fc2`` (``down_proj``) are split on dim 1; embeddings and
  the vocabulary head on dim 0; norms are replicated.
- The TE spec fuses the pre-attention / pre-MLP norms into ``linear_qkv`` / ``linear_fc1``
  (``layer_norm_weight``); the local spec has ``input_layernorm`` / ``pre_mlp_layernorm``.
- Tied embeddings: the HF checkpoint has no ``lm_head``; with PP > 1 megatron keeps a copy of the
  embedding on the last stage (``output_layer.weight``), which is loaded from ``embed_tokens``.
- MoE layers (``Piece.expert``): the router is HF's ``gate`` (replicated); routed expert ``e`` lives on the
  expert-parallel rank ``e // (num_experts / EP)`` as local expert ``e % (num_experts / EP)`` of megatron's
  ``SequentialMLP`` (``experts.local_experts.{k}``), its ``linear_fc1`` / ``linear_fc2`` split over the expert-
  tensor-parallel group like a dense MLP over TP; the shared expert (Qwen2-MoE) is a dense TP-split MLP
  (``shared_experts``) with a replicated ``gate_weight``. The TE spec keeps an MoE layer's pre-MLP norm apart.
  DeepSeek-V3's ``e_score_correction_bias`` is the router's ``expert_bias``, a buffer (``Piece.buffer``: fp32,
  moved by megatron after each step, exported with the weights, absent from the gradients).
- Multi-latent attention (``families._mla_pieces``): each projection is split on its rows over TP, the down
  projections too (megatron's local ``MLASelfAttention`` gathers their outputs), ``o_proj`` on its columns.
- Fused HF tensors (``ModelSpec.hf_fused``: Phi-3's ``qkv_proj`` / ``gate_up_proj``): the table names the parts;
  ``FusedHFReader`` reads a part as its rows of the fused tensor (its TP shard of them only), and
  ``iter_hf_weights`` concatenates the parts back (``fused_hf_tensors``), so exports and the rollout sync carry
  the checkpoint's own names, the ones the engines load.
- A vision-language model's tower (``vision_language.vision_pieces``): the tower's tensors, held whole by the first
  stage's first chunk (``vision_tower.*``), follow the language model's in the table.
- A critic's ``ValueHead`` is HF's ``score`` (``*ForTokenClassification``, ``num_labels=1``); when the
  checkpoint is a causal LM without ``score.*``, the head starts at zero.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from meshrl.atomic_io import publish_dir
from meshrl.models.families import ModelSpec, Piece, family, hf_fusions, hf_layout, implicit_fields
from meshrl.parallel import model_builder, state
from meshrl.parallel.model_builder import unwrap
from meshrl.parallel.vision_language import vision_pieces

_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _owner(piece: Piece, spec: ModelSpec, parallel: state.ParallelConfig) -> tuple[int, int]:
    """(pipeline rank, virtual stage) holding ``piece``; megatron's standard interleaved assignment."""
    pp, vpp = parallel.pipeline_parallel, parallel.virtual_pipeline or 1
    if piece.stage == "embed":
        return 0, 0
    if piece.stage == "head":
        return pp - 1, vpp - 1
    chunk = piece.layer // (spec.num_layers // (pp * vpp))
    return chunk % pp, chunk // pp


def _local_layer(piece: Piece, spec: ModelSpec, parallel: state.ParallelConfig) -> int:
    pp, vpp = parallel.pipeline_parallel, parallel.virtual_pipeline or 1
    return piece.layer % (spec.num_layers // (pp * vpp))


def _expert_slot(piece: Piece, spec: ModelSpec, parallel: state.ParallelConfig) -> tuple[int, int]:
    """(expert-parallel rank holding ``piece``'s routed expert, its index among that rank's local experts)."""
    return divmod(piece.expert, spec.num_experts // parallel.expert_parallel)


def _param_name(piece: Piece, spec: ModelSpec, parallel: state.ParallelConfig, uses_te: bool) -> str:
    name = piece.mcore
    if uses_te:
        for local, te in _TE_NAMES.items():
            # An MoE layer's pre-MLP norm is a module of its own in the TE spec too (its MLP is no TE linear).
            if name.endswith(local) and not (spec.moe and local.startswith("pre_mlp")):
                name = name[: -len(local)] + te
    if piece.layer is not None:
        expert = None if piece.expert is None else _expert_slot(piece, spec, parallel)[1]
        name = name.format(j=_local_layer(piece, spec, parallel), k=expert)
    return name


def _tensor_split(piece: Piece):
    """(size, this rank's index, group) of the tensor-parallel group splitting ``piece``: the expert-tensor-
    parallel group for a routed expert's tensors, the TP group otherwise."""
    from megatron.core import parallel_state as ps

    if piece.expert is not None:
        return (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def _part_view(param: torch.Tensor, piece: Piece, spec: ModelSpec, tp: int) -> torch.Tensor:
    """View of this rank's ``param`` holding ``piece``; shaped so HF-layout shards ``.view`` onto it."""
    if piece.part in ("q", "k", "v"):
        groups, per_group = spec.num_kv_heads // tp, spec.num_attention_heads // spec.num_kv_heads
        grouped = param.view(groups, per_group + 2, spec.head_dim, *param.shape[1:])
        start, stop = {"q": (0, per_group), "k": (per_group, per_group + 1),
                       "v": (per_group + 1, per_group + 2)}[piece.part]
        return grouped[:, start:stop]
    if piece.part in ("gate", "up"):
        half = param.shape[0] // 2
        return param[:half] if piece.part == "gate" else param[half:]
    return param


def _shard_shape(piece: Piece, tp: int) -> tuple[int, ...]:
    shape = list(piece.shape)
    if piece.tp_dim is not None:
        shape[piece.tp_dim] //= tp
    return tuple(shape)


def _model_facts(chunks: list[torch.nn.Module], hf_config) -> tuple[ModelSpec, bool, bool]:
    """(spec, critic, uses TE) of ``chunks``; raises if ``hf_config`` describes another model."""
    gpt = unwrap(chunks[0])
    spec = model_builder.model_spec(hf_config)
    mismatches = gpt.meshrl_spec.mismatches(spec)
    if mismatches:
        raise ValueError("the HF config does not match the model (model vs config): " + "; ".join(mismatches))
    return spec, gpt.meshrl_critic, gpt.meshrl_uses_te


def _chunk_params(chunks: list[torch.nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Each chunk's parameters and buffers by name (``Piece.buffer``: the router's expert bias)."""
    return [{**dict(unwrap(chunk).named_parameters()), **dict(unwrap(chunk).named_buffers())} for chunk in chunks]


class HFCheckpointReader:
    """Lazy reader of an HF folder's safetensors (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = dict(json.loads(index.read_text())["weight_map"])
        elif (self.dir / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(self.dir / "model.safetensors", framework="pt") as handle:
                self.file_of = {name: "model.safetensors" for name in handle.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {self.dir}")
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def _handle(self, name: str):
        from safetensors import safe_open

        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.dir / file, framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def slice(self, name: str):
        """safetensors' lazy slice of ``name`` (index it to read only those elements)."""
        return self._handle(name).get_slice(name)

    def read(self, name: str, dim: int | None = None, index: int = 0, parts: int = 1) -> torch.Tensor:
        """Tensor ``name``, or its ``index``-th of ``parts`` equal slices along ``dim``, reading only that."""
        view = self.slice(name)
        if dim is None:
            return view[:]
        size = view.get_shape()[dim] // parts
        region = [slice(None)] * len(view.get_shape())
        region[dim] = slice(index * size, (index + 1) * size)
        return view[tuple(region)]


class FusedHFReader:
    """``HFCheckpointReader`` seen through the spec's fused HF tensors (``hf_fusions``): a part's name reads its
    rows of the fused tensor; other names read as they are.

    Raises ``ValueError`` at construction if a fused tensor's shape is not its parts' concatenation.
    """

    def __init__(self, reader: HFCheckpointReader, spec: ModelSpec, critic: bool = False) -> None:
        self.reader = reader
        shapes = {piece.hf_name: piece.shape for piece in hf_layout(spec, critic)}
        self.rows: dict[str, tuple[str, int, int]] = {}  # part -> (fused name, first row, rows)
        problems = []
        for fusion in hf_fusions(spec):
            first = 0
            for part in fusion.parts:
                self.rows[part] = (fusion.name, first, shapes[part][0])
                first += shapes[part][0]
            expected = (first, *shapes[fusion.parts[0]][1:])
            if fusion.name in reader and reader.shape(fusion.name) != expected:
                problems.append(f"{fusion.name} has shape {reader.shape(fusion.name)} "
                                f"but the config implies {expected} "
                                f"(its parts {', '.join(p.rsplit('.', 2)[-2] for p in fusion.parts)} stacked)")
        if problems:
            raise ValueError("HF checkpoint does not match its config: " + "; ".join(problems[:5]))

    def __contains__(self, name: str) -> bool:
        return name in self.rows and self.rows[name][0] in self.reader or name not in self.rows and name in self.reader

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.rows:
            return self.reader.shape(name)
        fused, _, rows = self.rows[name]
        return (rows, *self.reader.shape(fused)[1:])

    def read(self, name: str, dim: int | None = None, index: int = 0, parts: int = 1) -> torch.Tensor:
        if name not in self.rows:
            return self.reader.read(name, dim, index, parts)
        fused, first, rows = self.rows[name]
        view = self.reader.slice(fused)
        if dim is None:
            return view[first:first + rows]
        if dim == 0:
            size = rows // parts
            return view[first + index * size:first + (index + 1) * size]
        size = view.get_shape()[dim] // parts
        region = [slice(first, first + rows)] + [slice(None)] * (len(view.get_shape()) - 1)
        region[dim] = slice(index * size, (index + 1) * size)
        return view[tuple(region)]


def checkpoint_reader(hf_dir: str | os.PathLike, spec: ModelSpec, critic: bool = False):
    """The reader of ``hf_dir`` under the spec's table: through ``FusedHFReader`` when the family fuses tensors."""
    reader = HFCheckpointReader(hf_dir)
    return FusedHFReader(reader, spec, critic) if spec.hf_fused else reader


def fused_hf_tensors(weights: Iterator[tuple[str, torch.Tensor]], spec: ModelSpec
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (``iter_hf_weights``' pairs) with each fused HF tensor's parts concatenated under its name, as
    the family's checkpoints hold them; other tensors pass through in order."""
    fusion_of = {part: fusion for fusion in hf_fusions(spec) for part in fusion.parts}
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        fusion = fusion_of.get(name)
        if fusion is None:
            yield name, tensor
            continue
        pending[name] = tensor
        if all(part in pending for part in fusion.parts):
            yield fusion.name, torch.cat([pending.pop(part) for part in fusion.parts])


def model_layout(hf_config, spec: ModelSpec, critic: bool = False) -> list[Piece]:
    """Every HF tensor of the model: the family's table (``hf_layout``), then a vision-language model's tower."""
    return hf_layout(spec, critic) + (vision_pieces(hf_config) if spec.vision else [])


def check_hf_checkpoint(reader: HFCheckpointReader, pieces: list[Piece], critic: bool = False) -> None:
    """Raise ``ValueError`` if the checkpoint's tensors disagree with the table's ``pieces`` (naming the config
    fields)."""
    problems = []
    for piece in pieces:
        if piece.hf_name not in reader:
            if critic and piece.hf_name.startswith("score."):
                continue
            problems.append(f"{piece.hf_name} is missing")
        elif reader.shape(piece.hf_name) != piece.shape:
            problems.append(f"{piece.hf_name} has shape {reader.shape(piece.hf_name)} but the config implies "
                            f"{piece.shape} ({piece.fields})")
        if len(problems) >= 5:
            break
    if problems:
        raise ValueError("HF checkpoint does not match its config: " + "; ".join(problems))


@torch.no_grad()
def load_hf_weights(chunks: list[torch.nn.Module], hf_dir: str | os.PathLike, hf_config=None) -> None:
    """Copy this rank's shard of the HF checkpoint in ``hf_dir`` into ``chunks`` (streamed, sliced reads).

    ``hf_config`` defaults to the folder's ``config.json``; it must describe the model the chunks were
    built from. A critic whose checkpoint has no ``score.*`` gets a zero value head. Load before
    building the optimizer: a mixed-precision optimizer copies the parameters into its fp32 masters.
    """
    from megatron.core import parallel_state

    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(hf_dir)
    parallel = state.current()
    spec, critic, uses_te = _model_facts(chunks, hf_config)
    reader = checkpoint_reader(hf_dir, spec, critic)
    pieces = model_layout(hf_config, spec, critic)
    check_hf_checkpoint(reader, pieces, critic)
    my_pp = parallel_state.get_pipeline_model_parallel_rank()
    my_ep = parallel_state.get_expert_model_parallel_rank()
    params = _chunk_params(chunks)
    targets: list[tuple[Piece, torch.Tensor]] = []
    for piece in pieces:
        pp_rank, vp = _owner(piece, spec, parallel)
        mine = piece.expert is None or _expert_slot(piece, spec, parallel)[0] == my_ep
        if pp_rank == my_pp and mine:
            targets.append((piece, params[vp][_param_name(piece, spec, parallel, uses_te)]))
    last_stage = my_pp == parallel.pipeline_parallel - 1
    if spec.tie_word_embeddings and not critic and parallel.pipeline_parallel > 1 and last_stage:
        # The last stage's copy of the tied embedding.
        tied = Piece(f"{spec.lm_prefix}embed_tokens.weight", "head", None, "output_layer.weight", 0, None,
                     (spec.vocab_size, spec.hidden_size), "vocab_size, hidden_size")
        targets.append((tied, params[-1]["output_layer.weight"]))
    for piece, param in targets:
        tp, tp_rank, _ = _tensor_split(piece)
        view = _part_view(param.data, piece, spec, tp)
        if piece.hf_name not in reader:  # a critic's value head from a causal-LM checkpoint
            view.zero_()
            continue
        shard = reader.read(piece.hf_name, piece.tp_dim, tp_rank, tp)
        view.copy_(shard.view(view.shape))


def _gather_tp(local: torch.Tensor, dim: int, full_shape: tuple[int, ...], group) -> torch.Tensor:
    """Concatenate each TP rank's ``local`` along ``dim`` into one tensor; peak: full + one shard."""
    tp = dist.get_world_size(group)
    out = torch.empty(full_shape, dtype=local.dtype, device=local.device)
    if dim == 0:
        dist.all_gather(list(out.chunk(tp, dim=0)), local, group=group)
        return out
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    buffer = torch.empty_like(local)
    for index, chunk in enumerate(out.chunk(tp, dim=dim)):
        source = local if index == me else buffer
        dist.broadcast(source, src=ranks[index], group=group)
        chunk.copy_(source)
    return out


def iter_hf_weights(chunks: list[torch.nn.Module], hf_config,
                    grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every HF tensor of the model, one at a time, as the family's
    checkpoints hold them: ``hf_layout``'s pieces (``_iter_pieces``), a fused HF tensor's parts concatenated
    under its name (``fused_hf_tensors``: Phi-3's ``qkv_proj`` / ``gate_up_proj``). See ``_iter_pieces`` for the
    contract."""
    return fused_hf_tensors(_iter_pieces(chunks, hf_config, grads), model_builder.model_spec(hf_config))


@torch.no_grad()
def _iter_pieces(chunks: list[torch.nn.Module], hf_config,
                 grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every ``hf_layout`` piece of the model, one at a time.

    With ``grads=True`` the accumulated gradients (DDP ``main_grad``) are yielded instead of the
    weights, in the same layout (for checks against a reference implementation).

    Contract:
    - **Every rank of the model-parallel group (all TP x PP ranks of one replica) must iterate the
      generator to the end, in lockstep**: each step runs collectives (an all-gather over TP on the
      owning pipeline stage, then a broadcast from that stage over PP). Data-parallel replicas are
      independent; each may iterate or not — except with expert parallelism: a routed expert's tensor is
      then broadcast over the expert-parallel group from the rank holding it, so every rank of those
      groups (they span data-parallel replicas) must iterate too.
    - Tensors are full (TP-gathered) and in HF layout: fused QKV is split back into ``q_proj`` /
      ``k_proj`` / ``v_proj``, ``linear_fc1`` into ``gate_proj`` / ``up_proj``. Names follow the family's HF
      ``*ForCausalLM`` (critic: ``*ForTokenClassification`` with ``score``; Qwen3 adds ``q_norm`` / ``k_norm``);
      with tied embeddings there is no ``lm_head.weight``. Order is ``hf_layout``'s (embedding, layer by
      layer, final norm, head). dtype is the model's; device is the model's.
    - Buffers (``Piece.buffer``: DeepSeek-V3's ``e_score_correction_bias``) are yielded in fp32, and not at all
      with ``grads=True`` (they have no gradient).
    - A yielded tensor is a fresh buffer owned by the consumer; the generator keeps no reference to it,
      so peak extra memory is about one full tensor (plus one TP shard while gathering).
    """
    from megatron.core import parallel_state

    parallel = state.current()
    spec, critic, uses_te = _model_facts(chunks, hf_config)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    my_ep, ep_ranks = parallel_state.get_expert_model_parallel_rank(), dist.get_process_group_ranks(ep_group)
    my_pp = parallel_state.get_pipeline_model_parallel_rank()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    params = _chunk_params(chunks)
    device = next(iter(params[0].values())).device
    dtype = next(iter(params[0].values())).main_grad.dtype if grads else model_builder.model_config(chunks).params_dtype
    for piece in model_layout(hf_config, spec, critic):
        if grads and piece.buffer:
            continue
        owner_pp, vp = _owner(piece, spec, parallel)
        owner_ep = my_ep if piece.expert is None else _expert_slot(piece, spec, parallel)[0]
        if owner_pp == my_pp and owner_ep == my_ep:
            tp, _, tp_group = _tensor_split(piece)
            param = params[vp][_param_name(piece, spec, parallel, uses_te)]
            source = param.main_grad if grads else param.data
            local = _part_view(source, piece, spec, tp).reshape(_shard_shape(piece, tp))
            if piece.tp_dim is not None and tp > 1:
                tensor = _gather_tp(local.contiguous(), piece.tp_dim, piece.shape, tp_group)
            else:
                tensor = local.clone()
        else:
            tensor = torch.empty(piece.shape, dtype=torch.float32 if piece.buffer else dtype, device=device)
        if owner_pp == my_pp and piece.expert is not None and parallel.expert_parallel > 1:
            dist.broadcast(tensor, src=ep_ranks[owner_ep], group=ep_group)
        if parallel.pipeline_parallel > 1:
            dist.broadcast(tensor, src=pp_ranks[owner_pp], group=pp_group)
        yield piece.hf_name, tensor
        del tensor


def save_hf_checkpoint(chunks: list[torch.nn.Module], hf_config, out_dir: str | os.PathLike,
                       tokenizer_dir: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
                       max_shard_bytes: int = 2 * 1024**3,
                       weights: Iterator[tuple[str, torch.Tensor]] | None = None) -> Path | None:
    """Write an HF folder (config, safetensors shards + index, tokenizer and image-processor files) from ``chunks``.

    Collective over the model-parallel group (see ``iter_hf_weights``); its first rank writes. With
    DP > 1 let one replica call it (the replicas hold identical weights); with expert parallelism, the replicas
    of one expert-parallel group (the one whose expert-parallel rank 0 has model-parallel rank 0 writes). Shards are
    flushed as soon as they reach ``max_shard_bytes``, so the writer holds at most one shard. The folder appears
    atomically (written beside it, then ``meshrl.atomic_io.publish_dir``); an existing one is replaced.
    ``weights``: the HF-named stream to write (every rank iterates it, as ``iter_hf_weights(chunks, hf_config)``,
    the default); a LoRA policy passes ``peft_io.iter_merged_weights``'s, ``W + (alpha/r)·B·A`` for each adapted
    weight: a plain HF checkpoint of the model it computes, loadable without PEFT (the adapter itself is
    ``peft_io.save_adapter``'s).
    Returns the folder on the writing rank, None elsewhere.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    writer = dist.get_rank(_model_parallel_group()) == 0 and _expert_parallel_rank() == 0
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, files, weight_map = 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({key: name for key in shard})
        shard, shard_bytes = {}, 0

    for name, tensor in weights if weights is not None else iter_hf_weights(chunks, hf_config):
        if not writer:
            continue
        tensor = tensor.to(device="cpu", dtype=dtype or tensor.dtype)
        if shard and shard_bytes + tensor.nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += tensor.nbytes
    if not writer:
        return None
    if shard or not files:
        flush()
    if len(files) == 1:
        os.replace(tmp / files[0], tmp / "model.safetensors")
    else:
        total = sum((tmp / f).stat().st_size for f in files)
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf_config = _config_for_export(hf_config, critic=unwrap(chunks[0]).meshrl_critic,
                                   dtype=dtype or model_builder.model_config(chunks).params_dtype)
    hf_config.save_pretrained(tmp)
    if tokenizer_dir is not None:
        for file in Path(tokenizer_dir).iterdir():
            if file.is_file() and (file.name.startswith("tokenizer") or file.name in
                                   ("special_tokens_map.json", "chat_template.jinja", "generation_config.json",
                                    "vocab.json", "merges.txt", "preprocessor_config.json",
                                    "processor_config.json")):  # a vision-language model's image processor
                shutil.copy2(file, tmp / file.name)
    publish_dir(tmp, out, aside=out.with_name(f"{out.name}.tmp-{os.getpid()}-replaced"))
    return out


def _config_for_export(hf_config, critic: bool, dtype: torch.dtype):
    import copy

    config = copy.deepcopy(hf_config)
    config.dtype = dtype
    for key, value in implicit_fields(config).items():  # what the trainer computed, spelled out for every reader
        setattr(config, key, value)
    if critic:
        config.architectures = [family(config.model_type).critic_class]
        config.num_labels = 1
    return config


def _model_parallel_group():
    from megatron.core import parallel_state

    return parallel_state.get_model_parallel_group()


def _expert_parallel_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()
