"""What the trainer does with a multi-turn batch: tool tokens are read (attention) but never trained on
(zero loss and zero gradient), scores land on the last sampled token, and the estimators skip the gaps."""

import pytest
import torch

from meshrl.algorithms import ADVANTAGE_ESTIMATORS, GlobalNorm
from meshrl.protocol import Batch
from meshrl.rollout.base import Completion
from meshrl.trainer.advantage import outcome_to_token_scores
from meshrl.workers.objectives import ActorObjective
from meshrl.workers.sequences import ATTENTION_MASK, build_micro_batch, response_part, responses_batch, sequence_lengths

PAD = 2
#            turn 1 (sampled)  tool output   turn 2 (sampled)
TOKENS = [11, 12, 13, 14, 15, 90, 91, 92, 93, 16, 17, 18]
MASK = [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
TOOL = slice(5, 9)


def multi_turn_batch(width: int = 16) -> Batch:
    prompts = Batch(tensors={"uid": torch.arange(2)}, non_tensors={"prompt_ids": [[5, 6, 7], [8, 9]]})
    completions = [Completion(0, 0, TOKENS, [-0.5 if m else 0.0 for m in MASK], "stop", loss_mask=MASK),
                   Completion(1, 0, [21, 22, 23], [-0.7] * 3, "stop", loss_mask=[1, 1, 1])]
    return responses_batch(prompts, completions, n=1, width=width, pad_id=PAD)


def test_the_batch_masks_tool_tokens_out_of_the_loss_but_not_out_of_the_sequence():
    batch = multi_turn_batch()
    assert batch["responses"][0, :len(TOKENS)].tolist() == TOKENS
    assert batch["response_mask"][0, :len(TOKENS)].tolist() == MASK
    assert batch[ATTENTION_MASK][0].tolist() == [1] * len(TOKENS) + [0] * 4
    assert sequence_lengths(batch).tolist() == [3 + len(TOKENS), 2 + 3]
    micro = build_micro_batch(batch, PAD)
    start = micro["response_start"]
    assert micro["input_ids"][0, start:].tolist() == TOKENS  # the model reads the tool output
    assert micro["attention_mask"][0, start:].tolist() == [1] * len(TOKENS)
    assert micro["output_mask"][0, start:].tolist() == MASK  # and is scored on its own tokens only
    assert micro["response_mask"].shape[1] == len(TOKENS)


def test_the_score_lands_on_the_last_sampled_token():
    mask = torch.tensor([MASK + [0] * 4, [1, 1, 1] + [0] * 13], dtype=torch.float32)
    mask[0, 11] = 0  # the response now ends on a gap: the score goes to the last sampled token before it
    scores = outcome_to_token_scores(torch.tensor([3.0, -1.0]), mask)
    assert torch.nonzero(scores).tolist() == [[0, 10], [1, 2]]
    assert scores[0, 10] == 3.0 and scores[1, 2] == -1.0


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_gae_and_reinforce_pp_skip_the_gaps(estimator):
    """On a gapped response, the estimator's advantages at sampled tokens equal those of the same response with
    the tool tokens cut out (so the gap carries no reward, value or discount)."""
    torch.manual_seed(0)
    gapped_mask = torch.tensor([MASK, [1] * 7 + [0] * 5], dtype=torch.float32)
    keep = torch.tensor(MASK, dtype=torch.bool)
    rewards = torch.randn(2, 12)
    values = torch.randn(2, 12)
    options = dict(gamma=0.9) if estimator == "reinforce_plus_plus" else dict(values=values, gamma=0.9, lam=0.8)
    gapped = ADVANTAGE_ESTIMATORS.get(estimator)(rewards * gapped_mask, gapped_mask, **options).advantages
    compact_mask = torch.tensor([[1] * 8 + [0] * 4, [1] * 7 + [0] * 5], dtype=torch.float32)
    compact_rewards = torch.zeros(2, 12)
    compact_rewards[0, :8], compact_rewards[1] = rewards[0, keep], rewards[1]
    if estimator == "gae":
        compact_values = torch.zeros(2, 12)
        compact_values[0, :8], compact_values[1] = values[0, keep], values[1]
        options = dict(options, values=compact_values)
    compact = ADVANTAGE_ESTIMATORS.get(estimator)(compact_rewards * compact_mask, compact_mask, **options).advantages
    assert torch.allclose(gapped[0, keep], compact[0, :8], atol=1e-6)
    assert torch.allclose(gapped[1], compact[1], atol=1e-6)
    assert (gapped[0, TOOL] == 0).all()


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_tool_tokens_get_zero_loss_and_zero_gradient(tiny_llama_dir, loss_agg_mode):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    batch = multi_turn_batch()
    micro = build_micro_batch(batch, PAD, ())
    start, width = micro["response_start"], micro["response_mask"].shape[1]
    objective = ActorObjective(loss_mode="vanilla", loss_agg_mode=loss_agg_mode, clip_ratio_low=0.2,
                               clip_ratio_high=0.2, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False,
                               kl_loss_coef=0.0, kl_loss_type="low_var_kl")
    norm = GlobalNorm.from_mask(batch["response_mask"], max_len=16)

    def loss_and_logit_grad(advantages, old_log_probs):
        logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
        logits.retain_grad()
        # The log-prob of token t comes from the logits at t - 1.
        token_log_probs = torch.log_softmax(logits[:, :-1], -1).gather(-1, micro["input_ids"][:, 1:, None])[..., 0]
        log_probs = response_part(torch.nn.functional.pad(token_log_probs, (1, 0)), micro)
        mb = {"response_mask": micro["response_mask"], "advantages": advantages, "old_log_probs": old_log_probs}
        loss, _ = objective(log_probs, None, mb, norm)
        loss.backward()
        return loss.detach(), logits.grad[0, start - 1:start - 1 + width]

    advantages = torch.randn(2, width)
    old = torch.full((2, width), -0.5)
    loss, grad = loss_and_logit_grad(advantages, old)
    assert grad[TOOL].abs().max() == 0  # no token of the tool output is pushed up or down
    assert grad[:5].abs().max() > 0 and grad[9:].abs().max() > 0
    # Whatever the advantages and old log-probs hold at tool tokens, the loss and its gradient are the same.
    poisoned_adv, poisoned_old = advantages.clone(), old.clone()
    poisoned_adv[0, TOOL], poisoned_old[0, TOOL] = 1e6, 5.0
    model.zero_grad()
    loss2, grad2 = loss_and_logit_grad(poisoned_adv, poisoned_old)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    # The tool tokens are context: changing them changes the second turn's log-probs (and the loss).
    batch["responses"][0, TOOL] = torch.tensor([300, 301, 302, 303])
    micro = build_micro_batch(batch, PAD, ())
    model.zero_grad()
    loss3, _ = loss_and_logit_grad(advantages, old)
    assert not torch.equal(loss, loss3)
