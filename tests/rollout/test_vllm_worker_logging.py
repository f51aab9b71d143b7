"""The weight-update session drops vLLM's "Failed to load weights" warning only for layers that receive
no tensor by design (rotary cache, tied LM head); any other layer's warning still shows."""

import logging

from meshrl.rollout.vllm_worker import _DropExpectedEmptyLayers


def _record(layer: str) -> logging.LogRecord:
    return logging.LogRecord("vllm", logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None)


def test_drops_rotary_and_the_tied_head_only():
    tied = _DropExpectedEmptyLayers("ParallelLMHead")
    assert not tied.filter(_record("RotaryEmbedding"))
    assert not tied.filter(_record("Llama3RotaryEmbedding"))
    assert not tied.filter(_record("ParallelLMHead"))
    assert tied.filter(_record("QKVParallelLinear"))
    assert tied.filter(logging.LogRecord("vllm", logging.WARNING, __file__, 1, "other %s", ("x",), None))
    untied = _DropExpectedEmptyLayers(None)
    assert untied.filter(_record("ParallelLMHead"))  # an untied head must receive its weight
