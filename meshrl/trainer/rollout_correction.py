"""The trainer's side of verl's ``algorithm.rollout_correction``; the tensors' side is
``meshrl.algorithms.rollout_correction``.

**Decoupled mode** (``bypass_mode=False``, three policies: π_rollout, π_old, π_θ). ``apply_rollout_correction`` runs
where verl's trainer calls ``compute_rollout_correction_and_add_to_batch``: after the trainer's old log-probs and
the KL in the reward, before the advantages; over the whole RL batch, with δ = old_log_probs − rollout_log_probs:

- ``rollout_is``: ``rollout_is_weights`` (B, R) join the batch; they travel to the actor's micro-batches and
  multiply its policy loss token by token (``meshrl.workers.objectives``), and the estimators that read them
  (the optimal token baselines) get them.
- ``rollout_rs``: the rejected tokens leave ``response_mask``, so every loss (actor and critic) and its global
  normaliser skip them, as in verl. The model still reads them (``response_attention_mask`` keeps every
  response token), and the advantage estimators still see them (``SAMPLED_MASK``): verl's outcome estimators
  sum every token's reward (a rejected response's score still counts in its group's mean and std), meshrl's
  read the tokens of the mask they are given, so they are given the sampled ones; grpo, rloo, remax, gpg then
  give verl's advantages on the kept tokens (gae and reinforce++ also see the rejected tokens in their
  recurrence and whitening, which verl's skip). The train/rollout alarm and ``rollout/log_prob_*`` read the
  sampled tokens too.
- the IS and RS metrics ``rollout_corr/*``, verl's names. verl's off-policy diagnostics (``rollout_corr/kl``,
  ``*_ppl``, ``chi2_*``) need no setting: they come with every step's batch metrics whenever the batch has both
  log-probs (``off_policy_metrics``), as verl logs them whenever its batch has ``rollout_log_probs``.

These settings need the old log-probs before the update, so they rule out the on-policy update
(``run_plan.on_policy_update``): the trainer recomputes them, as verl always does.

**Bypass mode** (``bypass_mode=True``, two policies: π_old = π_rollout). ``use_rollout_log_probs`` takes the
engine's log-probs as ``old_log_probs`` instead of the recompute (verl's ``apply_bypass_mode``); the actor's loss is
``bypass_mode`` (``loss_type``: ppo_clip / reinforce), which computes the weights and the rejection itself, per
micro-batch, from the policy being trained (verl's). Nothing is computed here.
"""

from __future__ import annotations

from meshrl.algorithms.rollout_correction import RolloutCorrectionSettings, rollout_correction
from meshrl.protocol import Batch
from meshrl.workers.sequences import ATTENTION_MASK, SAMPLED_MASK

WEIGHTS = "rollout_is_weights"


def use_rollout_log_probs(batch: Batch) -> None:
    """Bypass mode: logπ_old := logπ_rollout, the engine's log-probs of its sampled tokens."""
    batch.set("old_log_probs", batch["rollout_log_probs"])


def apply_rollout_correction(batch: Batch, settings: RolloutCorrectionSettings) -> dict[str, float]:
    """Decoupled mode's IS weights and rejection, into the batch (module doc); their ``rollout_corr/*`` metrics.
    Nothing (and {}) without ``rollout_is`` / ``rollout_rs``, or in bypass mode."""
    if settings.bypass or not settings.corrects:
        return {}
    mask = batch["response_mask"]
    out = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"], mask, settings)
    if out.weights is not None:
        batch.set(WEIGHTS, out.weights.float())
    if settings.rejection:
        if not out.response_mask.any():
            raise ValueError(f"algorithm.rollout_correction.rollout_rs rejects every token of the batch (metrics: "
                             f"{ {k: round(v, 6) for k, v in out.metrics.items() if 'masked_fraction' in k} }); "
                             "widen rollout_rs_threshold")
        if ATTENTION_MASK not in batch:  # the model still reads the rejected tokens
            batch.set(ATTENTION_MASK, mask)
        batch.set(SAMPLED_MASK, mask)
        batch.set("response_mask", out.response_mask)
    return out.metrics
