"""Router replay's routes (``meshrl.parallel.router_replay``) between the RL batch and its micro-batches.

In the RL batch (``meshrl.workers.sequences``) ``routed_experts`` is ``(B, P + R, L, k)`` int16: each token's
experts per layer, in the layout of a micro-batch whose prompts are left-padded to ``P`` = the run's prompt
length (``RunPlan.prompt_length``) and whose responses start at column ``P`` (verl's ``input_ids`` layout);
``NATIVE`` where there is no token. A micro-batch's own layout (prompts left-padded to its longest prompt
``start``) is then the column window ``[P - start, P - start + s)`` of it.
"""

from __future__ import annotations

import torch

from meshrl.parallel.router_replay import NATIVE, ROUTES
from meshrl.protocol import Batch
from meshrl.workers.sequences import RESPONSE_START


def _window(micro: dict, prompt_width: int) -> slice:
    start, seq = micro[RESPONSE_START], micro["input_ids"].shape[1]
    if start > prompt_width:
        raise ValueError(f"a prompt of {start} tokens is longer than the run's prompt length {prompt_width} "
                         "(data.max_prompt_length / rollout.prompt_length): its routes have no column")
    return slice(prompt_width - start, prompt_width - start + seq)


def attach_routes(shard: Batch, micros: list[dict], rows: list[Batch]) -> None:
    """Give each micro-batch of ``shard`` (its ``rows``) the routes of its tokens as ``micro[ROUTES]``,
    ``[b, s, L, k]``; a placeholder micro-batch (no rows) routes natively."""
    routes = shard[ROUTES]
    prompt_width = routes.shape[1] - shard["responses"].shape[1]
    for micro, part in zip(micros, rows):
        if len(part):
            micro[ROUTES] = part[ROUTES][:, _window(micro, prompt_width)].long()
        else:
            micro[ROUTES] = torch.full((*micro["input_ids"].shape, *routes.shape[2:]), NATIVE, dtype=torch.long)


def routes_in_row_order(micro_routes: list[torch.Tensor], split, prompt_width: int, width: int) -> torch.Tensor:
    """Per-micro-batch ``[b, s, L, k]`` routes of a ``MiniBatchSplit`` -> ``(B, P + R, L, k)`` in the shard's row
    order (``P``: ``prompt_width``, ``R``: ``width``)."""
    parts = []
    for routes, micro, part in zip(micro_routes, split.micros, split.rows):
        if not len(part):
            continue
        out = torch.full((len(part), prompt_width + width, *routes.shape[2:]), NATIVE, dtype=torch.int16)
        out[:, _window(micro, prompt_width)] = routes.to(torch.int16)
        parts.append(out)
    return torch.cat(parts)[torch.from_numpy(split.plan.inverse_permutation)]
