"""Shared-prompt layout (verl's ``actor.use_prefix_grouper``): a group's prompt computed once for its responses.

GRPO-style batches hold ``n`` responses per prompt, each row a copy of the prompt followed by its response. Rows
whose tokens before column ``prefix_columns`` (the micro-batch's response start) are the same form a group, packed
as one prefix segment and one segment per response::

    [ P | R1 | R2 | ... | Rn ]   each segment in a slot padded to a multiple of pad_multiple (the packed layout's)

The prefix runs causal attention over itself; response ``Ri``'s queries attend to the prefix's real tokens and,
causally, to ``Ri`` (``prefix_mask``). Positions (RoPE) go on from the prefix: ``Ri``'s tokens sit at
``|P|, |P| + 1, ...``, as in the row they came from. Every token therefore sees exactly the keys and values, at
the positions, that it sees in its own row: the outputs are the unshared layout's up to the rounding of the
attention's sums, and the prefix's gradient is the sum of its responses' (autograd sums the n uses of its keys and
values). The prompt's layers run once per group instead of n times: prompts are about half the tokens of an RL
update with short responses.

Each source token maps to one packed position (a prompt token of a group: its prefix's, shared by the rows) and to
the position whose output predicts it (``predictor``: the previous token of its row, which for a response's first
token is the prefix's last token, shared by the group's responses, whose outputs are computed once per response).
Rows that share their prompt with no other row, and rows of a micro-batch packed without sharing, are plain slots.

The model sees the layout through ``shared_prefix_params_class`` (megatron's ``PackedSeqParams`` with the segments'
prefix spans, read by ``layers.sdpa_core_attention_class``) and per-token rotary frequencies (``rope_positions``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch

# The micro-batch key of the column where its prompts end (its responses start), set by the workers' micro-batches
PROMPT_END = "response_start"


@functools.cache
def shared_prefix_params_class() -> type:
    """megatron's ``PackedSeqParams`` with ``segments``: per slot of ``cu_seqlens_q_padded``, the ``(start, length)``
    of the real prefix tokens its queries also attend to (a response of a group), or None (a prefix or a plain
    sequence: causal attention inside the slot). Built on first use, after megatron's CPU patches."""
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclass
    class SharedPrefixParams(PackedSeqParams):
        segments: tuple[tuple[int, int] | None, ...] = ()

    return SharedPrefixParams


@dataclass(frozen=True)
class SharedLayout:
    """A micro-batch in the shared-prompt layout (module docstring).

    Attributes:
        input_ids, position_ids: ``(1, T)``; positions go on from a response's prefix.
        cu_seqlens_padded: ``(k+1,)`` int32 slot offsets; ``cu_seqlens``: real tokens per slot, cumulated.
        prefixes: per slot, the ``(start, length)`` of the prefix it attends to, or None.
        max_position: one more than the largest position.
        packed_index: ``(N,)`` packed position of each real source token (prompt tokens of a group: shared).
        source_index: ``(N,)`` flat ``[B, S]`` index of that token, row-major.
        predictor: ``(N,)`` packed position whose output predicts the token; -1 for a row's first token.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    prefixes: tuple[tuple[int, int] | None, ...]
    max_position: int
    packed_index: torch.Tensor
    source_index: torch.Tensor
    predictor: torch.Tensor

    def params(self) -> Any:
        """The ``shared_prefix_params_class`` instance the model runs with."""
        longest = int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max())
        # rotary tables are sized by max_seqlen: they must cover the largest position, not only the longest slot
        length = max(longest, self.max_position)
        return shared_prefix_params_class()(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=length, max_seqlen_kv=length, segments=self.prefixes)


def pack_shared_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix_columns: int,
                       pad_multiple: int = 1, pad_value: int = 0) -> SharedLayout:
    """The shared-prompt layout of a ``(B, S)`` micro-batch whose prompts end before column ``prefix_columns``
    (module docstring); slots padded to a multiple of ``pad_multiple``."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(f"pack_shared_prefix needs input_ids and attention_mask of the same (B, S) shape, got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    batch, seq = input_ids.shape
    mask = attention_mask.bool().cpu()
    ids = input_ids.cpu()
    columns = [mask[row].nonzero().squeeze(1) for row in range(batch)]
    prompt_len = [int((cols < prefix_columns).sum()) for cols in columns]
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, cols in enumerate(columns):
        groups.setdefault(tuple(ids[row, cols[:prompt_len[row]]].tolist()), []).append(row)
    tokens: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    real: list[int] = []
    prefixes: list[tuple[int, int] | None] = []
    where: list[torch.Tensor | None] = [None] * batch  # each row's packed positions, in its token order
    offset = 0

    def slot(values: torch.Tensor, first_position: int, prefix: tuple[int, int] | None) -> int:
        nonlocal offset
        start, length = offset, len(values)
        padded = -(-length // pad_multiple) * pad_multiple
        tokens.append(torch.cat([values, values.new_full((padded - length,), pad_value)]))
        positions.append(torch.arange(first_position, first_position + padded))
        real.append(length)
        prefixes.append(prefix)
        offset += padded
        return start

    for prompt, rows in groups.items():
        if len(rows) < 2 or not prompt:  # nothing to share: the row's own slot
            for row in rows:
                start = slot(ids[row, columns[row]], 0, None)
                where[row] = torch.arange(start, start + len(columns[row]))
            continue
        length = len(prompt)
        start = slot(torch.tensor(prompt, dtype=ids.dtype), 0, None)
        shared = torch.arange(start, start + length)
        for row in rows:
            response = ids[row, columns[row][length:]]
            own = torch.arange(0)
            if len(response):
                begin = slot(response, length, (start, length))
                own = torch.arange(begin, begin + len(response))
            where[row] = torch.cat([shared, own])
    packed_index = torch.cat(where)
    source_index = torch.cat([row * seq + columns[row] for row in range(batch)])
    predictor = torch.cat([torch.cat([torch.tensor([-1]), w[:-1]]) if len(w) else w for w in where])
    zero = torch.zeros(1, dtype=torch.int64)
    padded_lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
    position_ids = torch.cat(positions)
    device = input_ids.device
    return SharedLayout(
        input_ids=torch.cat(tokens).unsqueeze(0).to(device), position_ids=position_ids.unsqueeze(0).to(device),
        cu_seqlens=torch.cat([zero, torch.tensor(real).cumsum(0)]).to(torch.int32).to(device),
        cu_seqlens_padded=torch.cat([zero, padded_lengths.cumsum(0)]).to(torch.int32).to(device),
        prefixes=tuple(prefixes), max_position=int(position_ids.max()) + 1,
        packed_index=packed_index.to(device), source_index=source_index.to(device), predictor=predictor.to(device))


def prefix_mask(prefix: int, length: int, window: int | None, device) -> torch.Tensor:
    """``[length, prefix + length]`` bool, True where a response's query i (position ``prefix + i``) may see key j:
    the prefix's tokens (positions ``0..prefix-1``) and its own up to i, and with a sliding ``window`` (megatron's
    ``window_size[0]``) only keys at most ``window`` positions back."""
    query = prefix + torch.arange(length, device=device)
    key = torch.cat([torch.arange(prefix, device=device), query])
    distance = query[:, None] - key[None, :]
    allowed = distance >= 0
    return allowed if window is None else allowed & (distance <= window)


@contextlib.contextmanager
def rope_positions(model: torch.nn.Module, position_ids: torch.Tensor) -> Iterator[None]:
    """While ``model`` (megatron's GPTModel, unwrapped) runs, its rotary frequencies are per packed token, taken at
    ``position_ids``: megatron's THD rotary then applies token t's frequencies to token t (its ``freqs`` of the
    packed row's length), instead of restarting at 0 in every slot."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise ValueError("the shared-prompt layout needs the model's rotary embedding (position_embedding_type rope)")
    # layers with a rotary base of their own (layers.local_rope_self_attention_class) size it by the model's table
    tables = [rotary, *(m.local_rope for m in model.modules() if getattr(m, "local_rope", None) is not None)]
    flat = position_ids.reshape(-1)

    def per_token(module, args, output):
        return output[flat]

    handles = [table.register_forward_hook(per_token) for table in tables]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
