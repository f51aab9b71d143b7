"""The pure arithmetic and bookkeeping of bench/vs_trl.py and bench/limits.py (the runs themselves are
benchmarks, never tests)."""

import math

import pytest

from bench import limits, vs_trl
from bench.machine import ModelShape, best_rate, peak_between, transformer_flops

SHAPE = ModelShape(params=1000, layers=2, hidden=8, kv_heads=1, head_dim=4, vocab=50)


def meshrl_record(step=1, step_s=10.0, gen_s=4.0, old=1.0, update=3.0, sync=0.5, reward=0.25):
    return {"step": step, "timing/step_s": step_s, "timing/gen_s": gen_s, "timing/reward_s": 0.2,
            "timing/old_log_prob_s": old, "timing/adv_s": 0.01, "timing/update_actor_s": update,
            "timing/sync_s": sync, "prompt_length/mean": 100.0, "response_length/mean": 50.0,
            "response_length/max": 64.0, "score/mean": reward}


def test_meshrl_step_training_is_the_model_phases_and_tokens_come_from_row_means():
    st = vs_trl.meshrl_step(meshrl_record(), rows=8, t_end=1000.0)
    assert st["train_s"] == pytest.approx(1.0 + 3.0 + 0.5)
    assert st["other_s"] == pytest.approx(10.0 - 4.0 - 4.5)
    assert (st["prompt_tokens"], st["response_tokens"]) == (800.0, 400.0)
    assert st["gen_tokens_per_s"] == pytest.approx(400 / 4.0)
    assert st["train_tokens_per_s"] == pytest.approx(1200 / 4.5)
    assert (st["t_begin"], st["t_end"]) == (990.0, 1000.0)
    assert st["mean_reward"] == 0.25 and st["response_length_max"] == 64.0


def test_trl_step_training_is_the_step_minus_generation_and_scoring():
    st = vs_trl.trl_step({"step": 2, "t_begin": 5.0, "t_end": 25.0, "wall_s": 20.0, "gen_s": 6.0,
                          "gen_and_score_s": 7.0, "forward_s": 4.0, "prompt_tokens": 800, "response_tokens": 300,
                          "response_length_max": 64, "mean_reward": 0.5, "cpu_s": 39.0})
    assert st["train_s"] == 13.0 and st["other_s"] == 1.0
    assert st["gen_tokens_per_s"] == 50.0 and st["train_tokens_per_s"] == pytest.approx(1100 / 13)


def steps_of(walls, gens=None):
    out = []
    for i, wall in enumerate(walls, start=1):
        gen = (gens or [wall / 2] * len(walls))[i - 1]
        st = vs_trl.step_record(step=i, wall_s=wall, gen_s=gen, train_s=wall / 4, prompt_tokens=100,
                                response_tokens=50, response_length_max=16, mean_reward=float(i), phases={})
        st["peak_rss_bytes"] = i * 2**30
        out.append(st)
    return out


def test_summarize_drops_the_warmup_step_and_divides_totals():
    summary = vs_trl.summarize(steps_of([100.0, 10.0, 20.0, 30.0], gens=[50.0, 5.0, 5.0, 15.0]))
    assert summary["steps_used"] == [2, 3, 4]
    assert summary["step_s"] == 20.0
    assert summary["gen_tokens_per_s"] == pytest.approx(150 / 25.0)  # totals over totals, not a mean of rates
    assert summary["peak_rss_gib"] == 4.0
    assert summary["mean_reward"] == pytest.approx(2.5)  # every step's reward, warm-up included


def test_summarize_of_a_single_step_uses_it():
    assert vs_trl.summarize(steps_of([7.0]))["steps_used"] == [1]
    with pytest.raises(ValueError):
        vs_trl.summarize([])


def test_ratios_are_meshrl_over_trl_and_the_target_is_a_speedup():
    m = {"step_s": 50.0, "gen_s": 10.0, "train_s": 30.0, "gen_tokens_per_s": 300.0, "train_tokens_per_s": 200.0,
         "peak_rss_gib": 6.0, "mean_reward": 0.0}
    t = {"step_s": 100.0, "gen_s": 30.0, "train_s": 66.0, "gen_tokens_per_s": 125.0, "train_tokens_per_s": 100.0,
         "peak_rss_gib": 9.5, "mean_reward": 0.0}
    r = vs_trl.ratios(m, t)
    assert r["step_s"] == 0.5 and r["speedup"] == 2.0 and r["meets_target"]
    assert r["gen_tokens_per_s"] == pytest.approx(2.4)
    assert r["mean_reward"] is None  # TRL's is 0: no ratio
    assert not vs_trl.ratios({**m, "step_s": 70.0}, t)["meets_target"]  # 1.43x < 1.6x


def full_result():
    side = {"status": "ok", "command": ["x"], "versions": {}, "precision": {}, "load_average_before_after": [1, 1],
            "cpu_seconds": 1.0, "wall_s_total": 1.0, "startup_s": 1.0, "peak_rss_gib_run": 1.0,
            "steps": steps_of([1.0])}
    return {"schema_version": 1, "benchmark": "vs_trl", "dtype": "fp32", "settings": {}, "machine": {},
            "sides": {"meshrl": side, "trl": dict(side)}, "summary": {}, "ratios": None, "command": "c"}


def test_check_result_accepts_the_schema_and_names_what_is_missing():
    result = full_result()
    assert vs_trl.check_result(result) == []
    del result["sides"]["trl"]["steps"][0]["gen_s"]
    del result["machine"]
    problems = vs_trl.check_result(result)
    assert "missing top-level key 'machine'" in problems
    assert "trl step 1: missing 'gen_s'" in problems
    result = full_result()
    result["sides"]["trl"] = {"status": "failed", "error": "exit 1"}
    assert vs_trl.check_result(result) == []


def test_select_prompts_keeps_file_order_and_skips_what_does_not_fit():
    rows = [{"n": n} for n in (10, 300, 20, 30)]
    picked = vs_trl.select_prompts(rows, 3, lambda r: r["n"] if r["n"] <= 256 else None)
    assert [r["n"] for r in picked] == [10, 20, 30]
    with pytest.raises(ValueError, match="only 3 prompts fit"):
        vs_trl.select_prompts(rows, 4, lambda r: r["n"] if r["n"] <= 256 else None)


def test_meshrl_overrides_load_as_a_valid_config(tmp_path):
    from meshrl.config import load_config
    from meshrl.config.validate import validate_config

    s = vs_trl.Settings(prompts=8, n=4, response_length=128, steps=3)
    cfg = load_config(vs_trl.meshrl_overrides(s, tmp_path / "p.jsonl", tmp_path / "run", 2048),
                      recipe="cpu_smollm2_grpo")
    validate_config(cfg)
    actor = cfg.actor_rollout_ref.actor
    assert (actor.ppo_mini_batch_size, actor.ppo_epochs, actor.use_kl_loss) == (8, 1, False)
    assert cfg.algorithm.use_kl_in_reward is False and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.val_files is None and cfg.data.shuffle is False
    assert (cfg.actor_rollout_ref.rollout.n, cfg.data.max_response_length) == (4, 128)
    assert actor.optim.weight_decay == 0.01 and actor.loss_agg_mode == "token-mean"
    assert actor.megatron.dtype == cfg.actor_rollout_ref.rollout.dtype == "float32"


def test_bf16_reaches_the_actor_and_the_engine(tmp_path):
    from meshrl.config import load_config

    s = vs_trl.Settings(prompts=8, n=4, response_length=128, steps=3, dtype="bf16")
    cfg = load_config(vs_trl.meshrl_overrides(s, tmp_path / "p.jsonl", tmp_path / "run", 2048),
                      recipe="cpu_smollm2_grpo")
    assert cfg.actor_rollout_ref.actor.megatron.dtype == cfg.actor_rollout_ref.rollout.dtype == "bfloat16"


def test_transformer_flops_is_palms_convention():
    n, layers, hidden, seq = SHAPE.params, SHAPE.layers, SHAPE.hidden, 16
    assert transformer_flops([seq] * 3, SHAPE, backward=True) == 3 * seq * (6 * n + 12 * layers * hidden * seq)
    assert transformer_flops([seq], SHAPE, backward=False) == seq * (2 * n + 4 * layers * hidden * seq)
    # outputs for 5 of the 48 tokens: the other 43 skip the 50x8 vocabulary projection
    skipped = 3 * 2 * SHAPE.vocab * hidden * 43
    assert transformer_flops([seq] * 3, SHAPE, backward=True, output_tokens=5) == (
        transformer_flops([seq] * 3, SHAPE, backward=True) - skipped)


def test_peak_between_and_best_rate():
    samples = [(1.0, 5), (2.0, 9), (3.0, 7)]
    assert peak_between(samples) == 9
    assert peak_between(samples, 2.5, 3.0) == 7
    assert peak_between(samples, 4.0, 5.0) is None
    assert best_rate(1.0, None, 3.0) == 3.0


def test_step_limits_floor_is_training_flops_over_flops_plus_weight_bytes_over_bandwidth():
    st = vs_trl.meshrl_step(meshrl_record(), rows=8)
    out = limits.step_limits(st, SHAPE, rows=8, n=4, flops_per_s=1e6, read_bytes_per_s=1e5, weight_dtype_bytes=4)
    train_flops = transformer_flops([150.0] * 8, SHAPE, backward=True, output_tokens=st["response_tokens"])
    decode_bytes = SHAPE.params * 4 * 64  # weights read once per decode step, 64 steps (the longest response)
    assert out["training_flops"] == pytest.approx(train_flops)
    assert out["floor_s"] == pytest.approx(train_flops / 1e6 + decode_bytes / 1e5)
    assert out["step_over_floor"] == pytest.approx(10.0 / out["floor_s"])
    assert out["update_fraction_of_matmul_flops"] == pytest.approx(train_flops / 3.0 / 1e6)
    assert out["decode_fraction_of_bandwidth"] == pytest.approx(decode_bytes / 4.0 / 1e5)
    assert out["roofline_floor_s"] >= out["floor_s"]
    parts = out["above_floor_s"]
    assert parts["old_log_prob"] == 1.0 and parts["sync"] == 0.5
    assert math.isclose(sum(parts.values()) + out["floor_s"], 10.0)


def test_limits_summary_checks_the_target():
    st = vs_trl.meshrl_step(meshrl_record(), rows=8)
    per_step = [limits.step_limits(st, SHAPE, rows=8, n=4, flops_per_s=1e6, read_bytes_per_s=1e5,
                                   weight_dtype_bytes=4)] * 3
    summary = limits.summarize_limits(per_step)
    assert summary["steps_used"] == [1, 1]
    assert summary["meets_target"] == (summary["step_over_floor"] <= 1.25)


def test_the_ceiling_over_trl_is_trls_step_over_the_matmul_floor():
    """The matmul floor adds the decode's measured weight-product time to the update's FLOP floor; the ceiling
    divides TRL's step by it (absent without a TRL step or a decode measurement)."""
    st = vs_trl.meshrl_step(meshrl_record(), rows=8)
    step = limits.step_limits(st, SHAPE, rows=8, n=4, flops_per_s=1e6, read_bytes_per_s=1e5, weight_dtype_bytes=4,
                              decode_step_matmul_s=0.01)
    assert step["matmul_floor_s"] == pytest.approx(step["floor_train_s"] + 64 * 0.01)
    summary = limits.summarize_limits([step] * 3, trl_step_s=30.0)
    assert summary["ceiling_speedup_vs_trl"] == pytest.approx(30.0 / step["matmul_floor_s"])
    assert summary["speedup_vs_trl"] == pytest.approx(30.0 / 10.0)
    assert "ceiling_speedup_vs_trl" not in limits.summarize_limits([step] * 3)
    bare = limits.step_limits(st, SHAPE, rows=8, n=4, flops_per_s=1e6, read_bytes_per_s=1e5, weight_dtype_bytes=4)
    assert "ceiling_speedup_vs_trl" not in limits.summarize_limits([bare] * 3, trl_step_s=30.0)


def test_corrected_flops_count_each_prompt_once_causal_attention_and_response_outputs_only():
    """Against a token-by-token count: 2 prompts of 10 tokens with 4 responses of 6 each."""
    weights, vocab, per_key = 2 * SHAPE.params, 2 * SHAPE.vocab * SHAPE.hidden, 4 * SHAPE.layers * SHAPE.hidden
    p, r, groups, n = 10, 6, 2, 4
    prompt = sum(weights - vocab + per_key * i for i in range(1, p + 1))  # no outputs for prompt tokens
    response = sum(weights + per_key * (p + j) for j in range(1, r + 1))  # after the prompt's p keys
    train, decode, prefill = limits.corrected_flops(SHAPE, rows=groups * n, n=n, prompt_mean=p, response_mean=r)
    assert train == pytest.approx(3 * groups * (prompt + n * response))
    assert decode == pytest.approx(groups * n * response)
    assert prefill == pytest.approx(groups * (prompt + vocab))  # the last prompt position's outputs


def test_the_corrected_floor_is_in_the_step_and_beside_the_speedup_over_trl():
    st = vs_trl.meshrl_step(meshrl_record(), rows=8)
    step = limits.step_limits(st, SHAPE, rows=8, n=4, flops_per_s=1e6, read_bytes_per_s=1e5, weight_dtype_bytes=4)
    assert step["corrected_floor_s"] == pytest.approx(
        step["corrected_floor_train_s"] + step["corrected_floor_decode_s"]
        + limits.corrected_flops(SHAPE, rows=8, n=4, prompt_mean=st["prompt_tokens"] / 8,
                                 response_mean=st["response_tokens"] / 8)[2] / 1e6)
    summary = limits.summarize_limits([step] * 3, trl_step_s=30.0)
    assert summary["corrected_ceiling_speedup_vs_trl"] == pytest.approx(30.0 / step["corrected_floor_s"])
    assert summary["step_over_corrected_floor"] == pytest.approx(10.0 / step["corrected_floor_s"])


def test_consistency_compares_prompt_tokens_step_by_step():
    m, t = steps_of([1.0, 2.0]), steps_of([1.0, 2.0])
    assert vs_trl.consistency(m, t)["prompt_tokens_equal"]
    t[1]["prompt_tokens"] += 3
    out = vs_trl.consistency(m, t)
    assert not out["prompt_tokens_equal"] and out["prompt_tokens_per_step_meshrl_trl"][1] == (2, 100, 103)


def test_cpu_between_differences_the_cumulative_cpu_of_the_samples_at_each_end():
    from bench.machine import cpu_between

    samples = [(1.0, 0, 3, 10.0), (2.0, 0, 3, 12.5), (3.0, 0, 3, 20.0)]
    assert cpu_between(samples, 1.5, 3.2) == 10.0
    assert cpu_between(samples, 0.5, 3.0) is None


def test_bf16_comparison_refused_where_bf16_matmul_is_emulated(monkeypatch):
    import bench.machine

    rates = {"bf16": 1.3e9, "fp32": 173e9}
    monkeypatch.setattr(bench.machine, "matmul_flops",
                        lambda n=2048, repeats=3, dtype=None: rates["bf16" if "bfloat16" in str(dtype) else "fp32"])
    with pytest.raises(SystemExit, match="emulated"):
        vs_trl.refuse_emulated_bf16(threads=1)
    rates["bf16"] = 425e9
    vs_trl.refuse_emulated_bf16(threads=1)  # a native bf16 unit passes


def test_measure_rates_skips_the_large_bf16_product_where_bf16_is_emulated(monkeypatch):
    import bench.machine

    calls = []

    def fake_matmul(n=2048, repeats=3, dtype=None):
        calls.append((n, "bfloat16" in str(dtype)))
        return rates["bf16"] if "bfloat16" in str(dtype) else 173e9

    monkeypatch.setattr(bench.machine, "matmul_flops", fake_matmul)
    monkeypatch.setattr(bench.machine, "memory_bandwidth", lambda: {"read_bytes_per_s": 1.0})
    rates = {"bf16": 1.3e9}
    measured = bench.machine.measure_rates(threads=1)
    assert measured["bf16_emulated"] and measured["matmul_flops_bf16"] == 1.3e9
    assert (2048, True) not in calls
    rates["bf16"], calls[:] = 425e9, []
    measured = bench.machine.measure_rates(threads=1)
    assert not measured["bf16_emulated"] and (2048, True) in calls


def test_decode_matmuls_cover_every_linear_weight_of_the_model(tiny_llama_dir):
    from safetensors import safe_open

    from bench.machine import decode_matmuls

    decode = decode_matmuls(tiny_llama_dir, rows=4, threads=1, repeats=1)
    timed_weights = sum(s["out"] * s["in"] * s["count"] for s in decode["by_shape"].values())
    with safe_open(next(iter(sorted(tiny_llama_dir.glob("*.safetensors")))), framework="pt") as handle:
        # every matrix: the projections of each layer and the (tied) embedding, the vocabulary projection
        matrices = sum(handle.get_slice(k).get_shape()[0] * handle.get_slice(k).get_shape()[1]
                       for k in handle.keys() if len(handle.get_slice(k).get_shape()) == 2)
    assert timed_weights == matrices
    assert decode["seconds_per_step"] > 0 and decode["rows"] == 4
