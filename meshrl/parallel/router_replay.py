"""Router replay for mixture-of-experts policies (issue 21; verl's ``actor.megatron.router_replay.mode``).

An MoE policy's log-probability is discontinuous in its weights: a token whose two best router logits are
near a tie goes to other experts after an optimizer step, or in another precision, and its log-prob jumps.
Replay removes that jump by forcing the experts a token was sent to in an earlier pass. verl's modes:

- ``R2``: the old-log-prob pass records each token's top-k experts per layer; every update pass (all
  mini-batches and epochs) routes the token to those experts. Built here.
- ``R3``: the rollout engine's routing is replayed in the old-log-prob and update passes. Not built: vLLM
  reports routing only through its aux-output connector (``enable_return_routed_experts``), which vLLM 0.32
  wires to Model Runner V2 only, and V2 requires Triton, which the CPU build lacks
  (``meshrl.config.validate`` refuses the mode with that reason).

What replay forces is the *choice* of experts; the gating weights are recomputed from this pass's own router
logits, as verl and megatron do: with scores ``s`` (softmax probabilities, or the logits when top-k comes
before the softmax) and replayed indices ``I``, the probabilities are ``s.gather(I)`` (then the softmax over
them, for Mixtral / Qwen3-MoE's ``norm_topk_prob``). The router weight keeps its gradient through them.

Routing tensors (``ROUTES``) hold expert ids, ``[..., L, k]`` per token (L: the model's layers, k: top-k);
``NATIVE`` (-1) marks a token that routes as usual (padding, layers without routing).

Mechanics (megatron-core 0.16.1): each ``TopKRouter`` calls ``router_replay.get_replay_topk(scores, topk, ...,
default_compute_topk)`` when its ``router_replay`` attribute is set; ``install`` sets it to a
``LayerRouting``. The pipeline schedule's forward step enters ``routing(model, micro_batch, inputs)`` around
each model call: it hands every router of the chunk the micro-batch's targets (``micro_batch[ROUTES]``,
``[b, s, L, k]`` in the micro-batch's token layout) converted to the order the routers see tokens, or, inside
``recording``, collects what they chose. Routers see megatron's ``[n, r]`` (sequence-major) flattening of the
model's ``[r, n]`` input (rows or packed THD, ``meshrl.parallel.forward``); with meshrl's TP-split MoE layer
(``layers.tp_split_moe_layer_class``) each TP rank routes a contiguous share of those tokens, so targets are
sliced to it and recorded shares are all-gathered.

Activation recompute: a training forward inside a checkpoint (recompute_granularity full, or selective over
the MoE layer) runs without autograd, and the backward runs the layer again outside the schedule's forward
step; each router queues the targets of its checkpointed forwards and the recompute takes them in order (the
schedules run each stage's backwards in the order of its forwards).
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from meshrl.parallel.layers import _all_gather_rows, _token_shares
from meshrl.parallel.model_builder import model_config, unwrap

ROUTES = "routed_experts"
NATIVE = -1
_ATTR = "meshrl_router_replay"


@dataclass
class _MicroRouting:
    """One micro-batch's routing as one chunk's routers see it: ``tokens`` rows in router order, the targets
    ``[tokens, L, k]`` (None: route natively) and, when recording, layer index -> chosen ``[tokens, k]``."""

    tokens: int
    targets: torch.Tensor | None
    recorded: dict[int, torch.Tensor] | None


class LayerRouting:
    """One router's replay hook (megatron's ``RouterReplay.get_replay_topk`` contract)."""

    def __init__(self, router: torch.nn.Module) -> None:
        if router.layer_number is None:
            raise ValueError("router replay needs the routers' layer numbers (set when megatron builds the layer)")
        self.router = router
        self.layer = router.layer_number - 1  # global over pipeline stages, 1-based in megatron
        self.micro: _MicroRouting | None = None
        # Targets of checkpointed training forwards, oldest first: the backward recomputes them in that order.
        self.pending: collections.deque[torch.Tensor] = collections.deque()
        # Token routes replayed, and how many of them differ from the experts this pass would have chosen.
        self.replayed = self.changed = 0

    def _share(self, tokens: int, seen: int) -> tuple[list[int], int, Any] | None:
        """(shares, this rank's index, group) when the router sees a TP rank's share of the tokens, else None."""
        if seen == tokens:
            return None
        group = self.router.tp_cp_group
        shares = _token_shares(tokens, group.size())
        if shares[group.rank()] != seen:
            raise RuntimeError(f"router replay: layer {self.layer} routes {seen} tokens, expected {tokens} or "
                               f"a TP share of them ({shares})")
        return shares, group.rank(), group

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk=None):
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        micro = self.micro
        if micro is None:
            if self.pending and torch.is_grad_enabled():  # the backward recomputing a checkpointed forward
                return self._force(scores, indices, self.pending.popleft(), topk)
            return probs, indices
        share = self._share(micro.tokens, scores.shape[0])
        if micro.recorded is not None:
            chosen = indices.detach()
            micro.recorded[self.layer] = chosen if share is None else _all_gather_rows(chosen.contiguous(), *share[::2])
            return probs, indices
        target = micro.targets[:, self.layer]
        if share is not None:
            shares, rank, _ = share
            start = sum(shares[:rank])
            target = target[start:start + shares[rank]]
        target = target.to(indices.device)
        if self.router.training and not torch.is_grad_enabled():  # inside an activation checkpoint (recompute)
            self.pending.append(target)
        probs, forced = self._force(scores, indices, target, topk)
        replayed = (target >= 0).all(dim=1)
        self.replayed += int(replayed.sum())
        self.changed += int((replayed & (forced.sort(dim=1).values != indices.sort(dim=1).values).any(dim=1)).sum())
        return probs, forced

    def _force(self, scores: torch.Tensor, indices: torch.Tensor, target: torch.Tensor, topk: int):
        """The replayed experts (``target`` where not ``NATIVE``) and their scores, as megatron's replay."""
        if target.shape != indices.shape:
            raise RuntimeError(f"router replay: layer {self.layer} has {tuple(target.shape)} targets for top-{topk} "
                               f"routing of {scores.shape[0]} tokens")
        forced = torch.where((target >= 0).all(dim=1, keepdim=True), target, indices)
        return scores.gather(1, forced), forced


@dataclass
class _ChunkRouting:
    """A model chunk's routers, and while ``recording`` the per-micro-batch recordings (in call order)."""

    layers: list[LayerRouting]
    num_layers: int
    topk: int
    records: list[dict[int, torch.Tensor]] | None = None


def install(chunks: list[torch.nn.Module]) -> None:
    """Give every MoE router of ``chunks`` its replay hook; ``routing`` does nothing for chunks without."""
    from megatron.core.transformer.moe.router import TopKRouter

    config = model_config(chunks)
    if not config.num_moe_experts:
        raise ValueError("router replay needs a mixture-of-experts model")
    for chunk in chunks:
        model = unwrap(chunk)
        layers = [LayerRouting(module) for module in model.modules() if isinstance(module, TopKRouter)]
        for layer in layers:
            layer.router.router_replay = layer
        setattr(model, _ATTR, _ChunkRouting(layers, config.num_layers, config.moe_router_topk))


def take_replay_counts(chunks: list[torch.nn.Module]) -> tuple[int, int]:
    """(token routes replayed, how many of them differ from the routers' own choice) by this rank's routers since
    the last call; a rank routes each of its tokens once per layer (its TP share), so sums over ranks add up."""
    replayed = changed = 0
    for chunk in chunks:
        for layer in getattr(unwrap(chunk), _ATTR).layers:
            replayed, changed = replayed + layer.replayed, changed + layer.changed
            layer.replayed = layer.changed = 0
    return replayed, changed


def to_router_order(routes: torch.Tensor, inputs) -> torch.Tensor:
    """``[b, s, L, k]`` routes in the micro-batch's token layout -> ``[n·r, L, k]`` in the routers' order for the
    model input ``inputs`` (``forward.ModelInputs``: ``[r, n]`` rows or packed, ``source_index`` -> ``packed_index``);
    positions without a token (padding) are ``NATIVE``."""
    rows, width = inputs.input_ids.shape
    flat = routes.new_full((rows * width, *routes.shape[2:]), NATIVE)
    flat[inputs.packed_index] = routes.reshape(-1, *routes.shape[2:])[inputs.source_index]
    return flat.view(rows, width, *routes.shape[2:]).transpose(0, 1).reshape(rows * width, *routes.shape[2:])


def from_router_order(chosen: torch.Tensor, inputs) -> torch.Tensor:
    """Inverse of ``to_router_order`` for one layer: ``[n·r, k]`` -> ``[b, s, k]`` (``NATIVE`` off the tokens)."""
    rows, width = inputs.input_ids.shape
    batch, seq = inputs.shape
    model_order = chosen.view(width, rows, -1).transpose(0, 1).reshape(rows * width, -1)
    out = chosen.new_full((batch * seq, chosen.shape[-1]), NATIVE)
    out[inputs.source_index] = model_order[inputs.packed_index]
    return out.view(batch, seq, -1)


@contextlib.contextmanager
def routing(model: torch.nn.Module, micro_batch: dict[str, Any], inputs) -> Iterator[None]:
    """Around one model call of the schedule: replay ``micro_batch[ROUTES]`` or record (see module docstring)."""
    chunk = getattr(unwrap(model), _ATTR, None)
    targets = micro_batch.get(ROUTES)
    if chunk is None or (targets is None and chunk.records is None):
        if targets is not None:
            raise ValueError(f"the micro-batch carries {ROUTES} but the model has no router replay hooks (install)")
        yield
        return
    rows, width = inputs.input_ids.shape
    micro = _MicroRouting(tokens=rows * width, targets=None if targets is None else to_router_order(targets, inputs),
                          recorded={} if targets is None else None)
    for layer in chunk.layers:
        layer.micro = micro
    try:
        yield
    finally:
        for layer in chunk.layers:
            layer.micro = None
    if micro.recorded is not None:
        chunk.records.append({layer: from_router_order(chosen, inputs).cpu()
                              for layer, chosen in micro.recorded.items()})


@dataclass
class Recording:
    """What ``recording`` collects: per micro-batch, layer -> ``[b, s, k]`` for the layers of this rank's chunks.
    ``gather`` reads it inside the ``recording`` block."""

    chunks: list[_ChunkRouting]

    def gather(self, micro_batches: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Every layer's routes of each micro-batch, ``[b, s, L, k]`` (all pipeline stages' layers, gathered over
        the pipeline group: every rank of it must call this)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        mine: list[dict[int, torch.Tensor]] = [{} for _ in micro_batches]
        for chunk in self.chunks:
            if len(chunk.records) != len(micro_batches):
                raise RuntimeError(f"router replay recorded {len(chunk.records)} micro-batches of "
                                   f"{len(micro_batches)}")
            for merged, record in zip(mine, chunk.records):
                merged.update(record)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            stages: list[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
            mine = [{k: v for stage in stages for k, v in stage[index].items()} for index in range(len(mine))]
        num_layers, topk = self.chunks[0].num_layers, self.chunks[0].topk
        out = []
        for micro, layers in zip(micro_batches, mine):
            batch, seq = micro["input_ids"].shape
            routes = torch.full((batch, seq, num_layers, topk), NATIVE, dtype=torch.int16)
            for layer, chosen in layers.items():
                routes[:, :, layer] = chosen.to(torch.int16)
            out.append(routes)
        return out


@contextlib.contextmanager
def recording(chunks: list[torch.nn.Module]) -> Iterator[Recording]:
    """Record the experts every router of ``chunks`` chooses in the passes run inside (``Recording.gather``)."""
    holders = [getattr(unwrap(chunk), _ATTR, None) for chunk in chunks]
    if any(holder is None for holder in holders):
        raise ValueError("recording routes needs router replay hooks on every chunk (install)")
    for holder in holders:
        holder.records = []
    try:
        yield Recording(holders)
    finally:
        for holder in holders:
            holder.records = None
