"""Mixture-of-experts models under expert parallelism on CPU/gloo: one 4-rank torchrun launch of
``moe_worker.py`` (EP2, EP2 x TP2, EP2 x PP2: Qwen2-MoE and DeepSeek-V3 (multi-latent attention, a dense first
layer, sigmoid grouped routing with the expert bias) at each; EP4 loads the checkpoint, EP1 is refused its optimizer
state; Qwen3-MoE and Mixtral at
EP2 x TP2 in ``make test-extended``), and the
same checks in process at TP1 / EP1 for every MoE family. Against each family's transformers class in fp32:
log-probs and entropies (row and packed layouts), the loss and every gradient of a packed forward-backward
(HF runs all micro-batches in one process, so the gradients equal a single-rank run's), and the weights read
back out of the megatron layout bit for bit; with verl's load-balancing and z-loss keys (at EP2 and in process)
the gradients against HF's plus those losses written out; a distributed checkpoint saved at EP2 resumed at other
expert layouts; router replay (``meshrl.parallel.router_replay``): recorded routes are HF's own choices, and
forced routes give HF's outputs, loss and gradients under the same forcing (with and without full activation
recompute), Qwen2-MoE in the launch (TP shares, pipeline stages), every family in process. ~90 s for the
launch on 2 quiet cores (144 s at load 40).
"""

from __future__ import annotations

import pytest
from moe_worker import EXTENDED_PHASES, MOE_FAMILIES, PHASES, REPLAY_FAMILY, SOFTMAX_FAMILIES, SP_FAMILY, check_family
from torchrun_launch import launch

from meshrl.models.tiny import tiny_model_dir, tiny_spec
from meshrl.parallel import state

# Entropies are ~10 nats, where fp32 spacing is 9.5e-7 (see test_parallel_multiproc's EXPECT).
LIMITS = {"log_probs": 1e-5, "entropy": 1.5e-5, "packed_log_probs": 1e-5, "packed_entropy": 1.5e-5, "loss": 1e-6,
          "grads": 1e-5, "grad_names_mismatch": 0, "export_mismatches": 0,
          "planned_parameters": 0}  # meshrl plan's count of the rank's parameters: its stage, its experts' shards
# With verl's load-balancing and z-loss keys: gradients against HF plus the losses written out; the losses must
# move some gradient well beyond that tolerance, or the check would pass with them ignored.
AUX_LIMITS = {"aux_loss": 1e-6, "aux_grads": 1e-5, "aux_grad_names_mismatch": 0}
AUX_EFFECT = 1e-3
# Router replay (moe_worker.check_replay): recorded routes are HF's choices; forced routes give HF-forced outputs,
# loss and gradients; the forcing must move some log-prob well beyond those tolerances.
REPLAY_LIMITS = {"replay_recorded_mismatches": 0, "replay_log_probs": 1e-5, "replay_entropy": 1.5e-5,
                 "replay_packed_log_probs": 1e-5, "replay_packed_entropy": 1.5e-5, "replay_loss": 1e-6,
                 "replay_grads": 1e-5, "replay_grad_names_mismatch": 0, "replay_recompute_loss": 1e-6,
                 "replay_recompute_grads": 1e-5, "replay_recompute_grad_names_mismatch": 0}
REPLAY_EFFECT = 1e-2


# DeepSeek-V3's expert bias: after the training pass megatron moved it by its update rate, and the export holds it
BIAS_LIMITS = {"expert_bias_step": 1e-7}


def _failures(values: dict, model_type: str, aux: bool, replay: bool = True) -> list[str]:
    limits = {**LIMITS, **(REPLAY_LIMITS if replay else {}), **(AUX_LIMITS if aux else {}),
              **(BIAS_LIMITS if model_type == "deepseek_v3" else {})}
    found = {key: values.get(f"{model_type}.{key}") for key in limits}
    errors = [values[key] for key in values if key.startswith(f"{model_type}.error")]
    errors += [f"{key} = {value} (limit {limits[key]})" for key, value in found.items()
               if value is None or value > limits[key]]
    effect, replayed = values.get(f"{model_type}.aux_effect"), values.get(f"{model_type}.replay_effect")
    errors += [f"replay_effect = {replayed} (must exceed {REPLAY_EFFECT})"] \
        if replay and (replayed is None or replayed < REPLAY_EFFECT) else []
    return errors + ([f"aux_effect = {effect} (must exceed {AUX_EFFECT})"]
                     if aux and (effect is None or effect < AUX_EFFECT) else [])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("moe-mp")
    # 133 s beside another test file (`make test`: -n 2) on a machine about twice as fast as CI's slow ones
    return launch("moe_worker.py", 4, workdir, "moe", 800, "--workdir", str(workdir))


CASES = [(phase, model_type, aux and model_type in SOFTMAX_FAMILIES) for phase, _, families, aux, _ in PHASES
         for model_type in families]
LOADS = [phase for phase, *_, ckpt in PHASES if ckpt == "load"]
SP_PHASES = [phase for phase, layout, *_ in PHASES if layout.get("tensor_parallel", 1) > 1]


@pytest.mark.multiproc
@pytest.mark.timeout(1000)  # the first to run also waits for the launch (module fixture)
@pytest.mark.parametrize("phase,model_type,aux", CASES, ids=[f"{p}-{m}" for p, m, _ in CASES])
def test_expert_parallel_layouts_match_hf(results: dict, phase: str, model_type: str, aux: bool) -> None:
    assert phase in results, results["_log"]
    failures = _failures(results[phase], model_type, aux, replay=model_type == REPLAY_FAMILY)
    assert not failures, failures


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_qwen3_moe_and_mixtral_match_hf_at_ep2_tp2(tmp_path) -> None:
    """``moe_worker.EXTENDED_PHASES``: the softmax-routed families without a shared expert at EP2 x TP2."""
    results = launch("moe_worker.py", 4, tmp_path, "moe-x", 800, "--workdir", str(tmp_path), "--extended")
    for phase, _, families, aux, _ in EXTENDED_PHASES:
        assert phase in results, results["_log"]
        for model_type in families:
            failures = _failures(results[phase], model_type, aux, replay=model_type == REPLAY_FAMILY)
            assert not failures, (model_type, failures)


@pytest.mark.multiproc
@pytest.mark.timeout(1000)  # the first to run also waits for the launch (module fixture)
@pytest.mark.parametrize("phase", SP_PHASES)
def test_sequence_parallel_moe_matches_hf(results: dict, phase: str) -> None:
    """megatron's sequence parallelism at EP2 x TP2: its MoE layer routes each TP rank's sequence shard (meshrl's
    TP-split layer stands aside), the norms' and router's gradients summed over TP; outputs, loss and gradients
    against HF within the bounds of the other layouts, and router replay (its TP shares are the sequence shards)."""
    assert phase in results, results["_log"]
    values = results[phase]
    assert values.get(f"{SP_FAMILY}_sp.sequence_parallel") == 1, values
    failures = _failures(values, f"{SP_FAMILY}_sp", aux=False, replay=True)
    assert not failures, failures


@pytest.mark.multiproc
@pytest.mark.timeout(1000)  # the first to run also waits for the launch (module fixture)
@pytest.mark.parametrize("phase", LOADS)
def test_a_checkpoint_saved_at_ep2_resumes_at_other_expert_layouts(results: dict, phase: str) -> None:
    """Model, optimizer and schedule saved after two updates at EP2 (DP4), loaded at EP2 x TP2 (experts split over
    expert TP), EP2 x PP2 and EP4: the third update gives EP2's weights."""
    saved, loaded = results.get("ep2", {}), results.get(phase, {})
    assert "checkpoint.error" not in saved and "checkpoint.error" not in loaded, results["_log"]
    assert saved["checkpoint.moved"] > 1e-4  # the updates moved the weights away from the HF folder's
    assert loaded["checkpoint.step"] == 2 and loaded["checkpoint.weights"] <= 1e-6, loaded


@pytest.mark.multiproc
@pytest.mark.timeout(1000)  # the first to run also waits for the launch (module fixture)
def test_an_ep2_optimizer_state_offered_to_ep1_is_refused_naming_both_sizes(results: dict) -> None:
    """At EP > 1 megatron chains an optimizer for the experts; a checkpoint of that state offered to EP1's single
    optimizer is refused before anything loads, naming both expert-parallel sizes; its weights alone still load."""
    values = results.get("ep1", {})
    assert "checkpoint.error" not in values, results["_log"]
    assert values["checkpoint.refused"] == 1 and values["checkpoint.weights_step"] == 2, values


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepseek_yarn_matches_hf(tmp_path) -> None:
    """DeepSeek-V3's YaRN (its released rope_parameters' mscale = mscale_all_dim = 1, factor 4 over 8 original
    positions so that the micro-batches' 7-13 tokens reach the interpolated frequencies): megatron's MLA YaRN gives
    transformers' outputs, loss and gradients at TP1, and the scaling moves the log-probs (so the check bites)."""
    import json
    import shutil

    from moe_worker import hf_reference, make_micro_batches

    plain = tiny_model_dir(tiny_spec("deepseek_v3"))
    yarn = shutil.copytree(plain, tmp_path / "yarn")
    config = json.loads((yarn / "config.json").read_text())
    config["rope_parameters"] = dict(rope_type="yarn", rope_theta=config["rope_parameters"]["rope_theta"], factor=4.0,
                                     original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                     mscale_all_dim=1.0)
    (yarn / "config.json").write_text(json.dumps(config))
    batches = make_micro_batches()
    moved = max(float((a["log_probs"] - b["log_probs"]).abs().max())
                for a, b in zip(hf_reference(yarn, batches)[0], hf_reference(plain, batches)[0]))
    assert moved > 1e-2, moved
    state.initialize(state.ParallelConfig())
    try:
        values = {f"deepseek_v3.{k}": v for k, v in check_family(yarn, aux=False, replay=False).items()}
    finally:
        state.destroy()
    failures = _failures(values, "deepseek_v3", aux=False, replay=False)
    assert not failures, failures


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_single_rank_matches_hf() -> None:
    state.initialize(state.ParallelConfig())
    try:
        for model_type in MOE_FAMILIES:
            softmax = model_type in SOFTMAX_FAMILIES  # the router-loss reference's routers
            found = check_family(tiny_model_dir(tiny_spec(model_type)), aux=softmax)
            values = {f"{model_type}.{k}": v for k, v in found.items()}
            failures = _failures(values, model_type, aux=softmax)
            assert not failures, failures
    finally:
        state.destroy()
