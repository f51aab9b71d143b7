"""Resume restores everything (weights, optimizer, LR schedule, data position, RNG, engine seeds, KL
controller): N steps straight == N/2 + resume + N/2, metric for metric, here at PP2 (``make test-extended``; the
same claim at TP2, after a ``kill -9`` of the driver mid-save, runs in ``make test``: ``test_reliability_e2e.py``,
which also covers a killed worker). A diverging step keeps finite, loadable checkpoints."""

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.usefixtures("ray_session")]

COMMON = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
          "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive", "trainer.save_freq=2",
          "trainer.test_freq=2", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1"]
# Everything a resumed run must reproduce (timings are the only metrics allowed to differ).
COMPARED = ("score/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/lr", "actor/ref_kl_k1",
            "actor/reward_kl_coef", "response_length/mean", "critic/advantages/mean", "val/score", "training/epoch")
PP2 = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
       "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2"]


@pytest.mark.extended  # the same claim at TP2, after a kill -9 mid-save: test_reliability_e2e.py
def test_resume_continues_exactly_at_pp2(train, tmp_path):
    _, straight = train(*COMMON, *PP2, "trainer.total_training_steps=4", run_dir=tmp_path / "straight")
    # One step, then the same run extended to four: step 1 is the short run's last, so it validates (and
    # saves) where the straight run does not; validating must not shift the training samples' seeds.
    train(*COMMON, *PP2, "trainer.total_training_steps=1", run_dir=tmp_path / "resumed")
    _, resumed = train(*COMMON, *PP2, "trainer.total_training_steps=4", run_dir=tmp_path / "resumed")
    assert sorted(resumed) == [0, 1, 2, 3, 4]  # no duplicated or missing step after the resume
    assert "val/score" in resumed[1] and "val/score" not in straight[1]
    for step in (2, 3, 4):
        for key in COMPARED:
            if key in straight[step]:  # val/* only on test_freq steps
                assert resumed[step][key] == straight[step][key], (step, key)
    assert "val/score" in resumed[4]
    assert straight[3]["actor/grad_norm"] > 0


def test_a_diverging_step_skips_updates_and_keeps_a_finite_loadable_checkpoint(train, tmp_path):
    """actor lr=1e30: the first update (step 1's first of two mini-batches) throws the weights to ~1e30, after
    which every gradient norm is NaN. Those updates are skipped and counted (they used to write NaN into the
    weights, and the NaN checkpoint was marked complete); the checkpoints hold finite weights, and a resume
    loads one and trains on."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "diverging"
    overrides = ["actor_rollout_ref.actor.optim.lr=1e30", "trainer.save_freq=1", "trainer.test_freq=-1",
                 "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"]
    _, steps = train(*overrides, "trainer.total_training_steps=2", run_dir=run_dir)
    assert steps[1]["actor/optimizer_steps"] == 2 and steps[1]["actor/skipped_updates"] == 1
    assert steps[2]["actor/skipped_updates"] == 2 and steps[2]["actor/nonfinite_losses"] == 0
    weights = load_file(str(run_dir / "global_step_2" / "actor" / "huggingface" / "model.safetensors"))
    assert all(bool(w.isfinite().all()) for w in weights.values())
    assert max(float(w.abs().max()) for w in weights.values()) > 1e20  # the first update did apply
    _, resumed = train(*overrides, "trainer.total_training_steps=3", run_dir=run_dir)
    assert sorted(resumed) == [0, 1, 2, 3] and resumed[3]["actor/skipped_updates"] == 2
