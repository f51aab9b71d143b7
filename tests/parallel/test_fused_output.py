"""The fused output layer (``meshrl.parallel.fused_output``) against the unfused path, in process at TP1.

Reference: the output layer's logits through ``forward.vocab_parallel_log_probs`` / ``vocab_parallel_entropy``
(what every pass runs without ``model.use_fused_kernels``). fp32: log-probs, entropy, loss and the fused
function's gradients within 1e-6 (relative to the tensor's scale when that exceeds 1). A model's parameter
gradients within 1e-5 (the bound of the parallel layer's gradient parity with HF, ``test_parallel_multiproc``):
BLAS picks its kernel by the number of rows, so a chunk's ``[rows, V] x [V, H]`` product rounds its 49k-term
sums otherwise than the whole micro-batch's, and the decoder's backward carries that rounding (measured
2.2e-6 to 2.4e-6 at gradient scales of 0.44 to 0.60, chunks of 4 tokens).
TP2 and PP2 run in ``test_fused_output_multiproc.py``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fused_output_worker import MODELS, compare

from meshrl.models.tiny import tiny_model_dir
from meshrl.parallel import state
from meshrl.parallel.forward import (OutputRequest, vocab_parallel_entropy, vocab_parallel_log_probs,
                                     vocab_parallel_sum_pi_squared)
from meshrl.parallel.fused_output import _FusedLogProbsEntropy, fused_log_probs_entropy

TOLERANCE = 1e-6
GRAD_TOLERANCE = 1e-5  # absolute, on a model's parameter gradients (the module docstring)
# The process group's device (NCCL on a GPU machine takes CUDA tensors only): the same checks run there.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within fp32 rounding: |a - b| <= 1e-6 x max(1, max |b|) (the chunks sum a weight's gradient over the
    tokens in another order than one product does)."""
    return float((a - b).abs().max()) <= TOLERANCE * max(1.0, float(b.abs().max()))




@pytest.fixture(scope="module")
def tp1():
    state.initialize(state.ParallelConfig())
    yield
    state.destroy()


def _unfused(hidden, weight, target, temperature, softcap):
    logits = hidden @ weight.t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float() / temperature
    return vocab_parallel_log_probs(logits.clone(), target), vocab_parallel_entropy(logits)


@pytest.mark.parametrize("temperature,softcap,chunk", [(1.0, None, 7), (0.6, None, 64), (1.3, 2.0, 5)])
def test_log_probs_entropy_and_gradients_match_the_unfused_path(tp1, temperature, softcap, chunk) -> None:
    g = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 23, 16, 97  # 23 tokens: the last chunk is a partial one
    hidden = torch.randn(tokens, hidden_size, generator=g).to(DEVICE)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.5).to(DEVICE)
    target = torch.randint(0, vocab, (tokens,), generator=g).to(DEVICE)
    g_lp, g_h = torch.randn(tokens, generator=g).to(DEVICE), torch.randn(tokens, generator=g).to(DEVICE)
    results = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            lp, ent, _ = fused_log_probs_entropy(h, w, target, temperature=temperature, softcap=softcap,
                                                 chunk_size=chunk, entropy=True)
        else:
            lp, ent = _unfused(h, w, target, temperature, softcap)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for name, a, b in zip(("log_probs", "entropy", "grad hidden", "grad weight"), *results):
        assert close(a, b), name
        assert float(b.abs().max()) > 1e-2, f"{name} is all but zero: the comparison would prove nothing"


def test_one_output_alone_and_its_gradient(tp1) -> None:
    """Only entropy (no targets), or only log-probs: the other comes back None, the gradient is the one
    output's."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 8, generator=g).to(DEVICE), torch.randn(31, 8, generator=g).to(DEVICE)
    target = torch.randint(0, 31, (9,), generator=g).to(DEVICE)
    for wants_log_probs in (True, False):
        h = hidden.clone().requires_grad_()
        lp, ent, squares = fused_log_probs_entropy(h, weight, target if wants_log_probs else None, temperature=1.0,
                                                   softcap=None, chunk_size=4, entropy=not wants_log_probs)
        assert squares is None  # not asked for
        assert (lp is None) != (ent is None)
        (lp if wants_log_probs else ent).sum().backward()
        r = hidden.clone().requires_grad_()
        ref_lp, ref_ent = _unfused(r, weight, target, 1.0, None)
        (ref_lp if wants_log_probs else ref_ent).sum().backward()
        assert close(h.grad, r.grad)


def test_no_selected_token_gives_empty_outputs_and_zero_gradients(tp1) -> None:
    """A placeholder micro-batch (all-zero output mask) selects no position: nothing to project, no error."""
    hidden = torch.zeros(1, 0, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(31, 8, device=DEVICE, requires_grad=True)
    lp, ent, squares = fused_log_probs_entropy(hidden, weight, torch.zeros(1, 0, dtype=torch.long, device=DEVICE),
                                               temperature=0.7, softcap=None, chunk_size=4, entropy=True,
                                               sum_pi_squared=True)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == ent.shape == squares.shape == (1, 0) and hidden.grad.shape == (1, 0, 8)
    assert not weight.grad.any()


def _plain_sum_pi_squared(hidden, weight, temperature, softcap) -> torch.Tensor:
    """Σ_v softmax(logits / T)_v² over the full vocabulary, in fp64: the reference of both paths."""
    logits = hidden.double() @ weight.double().t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.softmax(logits / temperature, dim=-1).square().sum(dim=-1)


@pytest.mark.parametrize("temperature,softcap,chunk", [(1.0, None, 7), (0.6, None, 64), (1.3, 2.0, 5)])
def test_sum_pi_squared_matches_a_plain_softmax(tp1, temperature, softcap, chunk) -> None:
    """verl's Σπ² (calculate_sum_pi_squared) of the unfused and the fused path against softmax over the full logits;
    asking for it changes neither path's log-probs nor entropy, and the unfused one leaves its logits as they were."""
    g = torch.Generator().manual_seed(4)
    tokens, hidden_size, vocab = 23, 16, 97
    hidden = torch.randn(tokens, hidden_size, generator=g).to(DEVICE)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.5).to(DEVICE)
    target = torch.randint(0, vocab, (tokens,), generator=g).to(DEVICE)
    expected = _plain_sum_pi_squared(hidden, weight, temperature, softcap)
    assert float(expected.max()) > 1.5 / vocab and float(expected.max() - expected.min()) > 1e-3, "Σπ² barely varies"
    logits = hidden @ weight.t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float() / temperature
    before = logits.clone()
    unfused = vocab_parallel_sum_pi_squared(logits)
    assert torch.equal(logits, before)
    lp, ent, fused = fused_log_probs_entropy(hidden, weight, target, temperature=temperature, softcap=softcap,
                                             chunk_size=chunk, entropy=True, sum_pi_squared=True)
    lp_off, ent_off, none = fused_log_probs_entropy(hidden, weight, target, temperature=temperature, softcap=softcap,
                                                    chunk_size=chunk, entropy=True)
    assert none is None and torch.equal(lp, lp_off) and torch.equal(ent, ent_off)
    for name, got in (("unfused", unfused), ("fused", fused)):
        assert got.dtype == torch.float32 and got.shape == (tokens,), name
        assert float((got.double() - expected).abs().max()) <= TOLERANCE, name


class _ThreadRanks:
    """A tensor-parallel group of threads in one process: thread r is rank r; ``all_reduce`` (sum or max) and
    ``get_rank`` stand in for ``torch.distributed``'s, so the functions run their TP code on vocabulary shards."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.local = size, [None] * size, threading.local()
        self.barrier = threading.Barrier(size, timeout=60)

    def all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        self.slots[self.local.rank] = tensor.clone()
        self.barrier.wait()
        stacked = torch.stack(self.slots)
        result = stacked.amax(dim=0) if op == torch.distributed.ReduceOp.MAX else stacked.sum(dim=0)
        self.barrier.wait()  # every rank has read the slots before any writes its next one
        tensor.copy_(result)

    def get_rank(self, group=None) -> int:
        return self.local.rank

    def run(self, fn) -> list:
        def rank_fn(rank):
            self.local.rank = rank
            with torch.no_grad():
                return fn(rank)

        with ThreadPoolExecutor(self.size) as pool:
            return [f.result() for f in [pool.submit(rank_fn, rank) for rank in range(self.size)]]


@pytest.mark.parametrize("tp", [2, 4])
def test_sum_pi_squared_reduces_over_the_tensor_parallel_shards(tp1, monkeypatch, tp) -> None:
    """At TP = 2 and 4 (threads standing in for the ranks, each holding V/TP of the vocabulary): every rank's Σπ²,
    from either path, is the full vocabulary's; the fused path's log-probs and entropy too."""
    group = _ThreadRanks(tp)
    monkeypatch.setattr(torch.distributed, "all_reduce", group.all_reduce)
    monkeypatch.setattr(torch.distributed, "get_rank", group.get_rank)
    g = torch.Generator().manual_seed(5)
    tokens, hidden_size, vocab, temperature = 11, 8, 4 * 24, 0.8
    hidden, weight = torch.randn(tokens, hidden_size, generator=g), torch.randn(vocab, hidden_size, generator=g) * 0.7
    target = torch.randint(0, vocab, (tokens,), generator=g)
    expected = _plain_sum_pi_squared(hidden, weight, temperature, None)
    full = (hidden @ weight.t()).double() / temperature
    shards = weight.chunk(tp)

    def rank_outputs(rank):
        unfused = vocab_parallel_sum_pi_squared((hidden @ shards[rank].t()).float() / temperature)
        lp, ent, fused = _FusedLogProbsEntropy.apply(hidden, shards[rank], target, temperature, None, 4, True, None,
                                                     True)
        return unfused, fused, lp, ent

    for unfused, fused, lp, ent in group.run(rank_outputs):
        assert float((unfused.double() - expected).abs().max()) <= TOLERANCE
        assert float((fused.double() - expected).abs().max()) <= TOLERANCE
        log_p = torch.log_softmax(full, dim=-1)
        assert float((lp.double() - log_p.gather(1, target[:, None]).squeeze(1)).abs().max()) <= 1e-5
        assert float((ent.double() + (log_p.exp() * log_p).sum(-1)).abs().max()) <= 1e-5


def test_a_chunk_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="fused_chunk_size must be >= 1"):
        OutputRequest(fused_chunk_size=0)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_model_pass_matches_the_unfused_pass(tp1, model: str) -> None:
    """Tied and untied embeddings, a soft-capped Gemma 2: through megatron's schedule, packed with response-only
    outputs and in rows, at T=0.7 (``fused_output_worker.compare``; TP2 and PP2 in the multi-process test)."""
    result = compare(Path(tiny_model_dir(MODELS[model])))
    assert result["outputs"] <= TOLERANCE and result["loss"] <= TOLERANCE, result
    assert result["grads"] <= GRAD_TOLERANCE, result
    assert result["head_grad"] > 1e-3, "the output weight got no gradient"
    assert 0 < result["squares"] <= 1, "Σπ² of the forward-only passes"


def test_the_run_plan_takes_the_chunk_from_verls_key_and_refuses_an_empty_chunk() -> None:
    from meshrl.config import ConfigError, load_config
    from meshrl.config.validate import validate_config

    assert validate_config(load_config([], recipe="cpu_tiny_grpo")).fused_chunk_size == 512
    plan = validate_config(load_config(["actor_rollout_ref.model.fused_kernel_options.chunk_size=64"],
                                       recipe="cpu_tiny_grpo"))
    assert plan.fused_chunk_size == 64
    off = load_config(["actor_rollout_ref.model.use_fused_kernels=False"], recipe="cpu_tiny_grpo")
    assert validate_config(off).fused_chunk_size is None
    with pytest.raises(ConfigError, match="fused_kernel_options.chunk_size: must be >= 1 token"):
        validate_config(load_config(["actor_rollout_ref.model.fused_kernel_options.chunk_size=0"],
                                    recipe="cpu_tiny_grpo"))


def test_the_planner_counts_one_chunk_of_logits_with_the_fused_layer() -> None:
    """``meshrl plan`` on the seed's ReMax 7B recipe: unfused, the update's logits grow with the token budget;
    fused, with the chunk only, and both the update's and the log-prob phase's totals drop by the difference."""
    from meshrl.config import load_config
    from meshrl.config.validate import validate_config
    from meshrl.memory_plan import estimate

    def phases(*overrides: str) -> dict:
        cfg = load_config(list(overrides), recipe="remax_qwen2.5-7b_seq_balance")
        validate_config(cfg)
        return {p.name: p for p in estimate(cfg).phases}

    unfused, budget = ("actor_rollout_ref.model.use_fused_kernels=False",
                       "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    before, after = phases(unfused), phases()
    half = phases(unfused, f"{budget}=12000")
    logits = {name: run["actor update"].items["actor logits"] for name, run in (("before", before), ("after", after),
                                                                                 ("half", half))}
    assert logits["half"] == pytest.approx(logits["before"] / 2)
    assert logits["after"] < logits["before"] / 5
    assert phases(f"{budget}=12000")["actor update"].items["actor logits"] == logits["after"]
    bigger_chunks = phases("actor_rollout_ref.model.fused_kernel_options.chunk_size=1024")
    assert bigger_chunks["actor update"].items["actor logits"] > logits["after"]
    for name, item in (("actor update", "actor logits"), ("log-prob", "forward logits")):
        saved = before[name].items[item] - after[name].items[item]
        assert saved > 0 and before[name].total - after[name].total == pytest.approx(saved)
