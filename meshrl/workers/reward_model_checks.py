"""Whether a learned reward model (``reward_model.enable``) can score, checked at preflight before Ray starts: the
``model`` stage's rule ``learned_reward_model`` (``meshrl.config.refusals``). Apart from the worker
(``meshrl.workers.reward_model``) so that the driver's checks import none of the worker's libraries."""

from __future__ import annotations

from meshrl.config.refusals import Checked, refusal

SCORE = "score.weight"  # the head of a *ForSequenceClassification checkpoint


@refusal("model", "reward_model.model.path", "reward_model.megatron")
def learned_reward_model(c: Checked) -> list[str]:
    """A learned reward model must load and score: ``reward_model_problems``."""
    return reward_model_problems(c.cfg, c.plan.reward_model_layout) if c.plan.use_reward_model else []


def reward_model_problems(cfg, layout) -> list[str]:
    """What stops ``reward_model.model.path`` from scoring (empty: it can): a missing folder, an unsupported
    family, a checkpoint without a one-label ``score`` head, a tokenizer without a chat template, a run-plan
    ``layout`` (``RunPlan.reward_model_layout``) that does not shard the model (``model_builder.layout_problems``)."""
    from transformers import AutoConfig, AutoTokenizer

    from meshrl.models.families import model_spec
    from meshrl.models.resolve import resolve_model_path
    from meshrl.parallel.hf_conversion import HFCheckpointReader
    from meshrl.parallel.model_builder import layout_problem_lines

    rm = cfg.reward_model
    key = "reward_model.model.path"
    if not rm.model.path:
        return [f"{key}: reward_model.enable=True needs the reward model's folder (an HF *ForSequenceClassification "
                "checkpoint with one label)"]
    try:
        folder = resolve_model_path(rm.model.path)
        hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=rm.model.trust_remote_code)
        spec = model_spec(hf_config)
    except (OSError, ValueError) as exc:
        return [f"{key}={rm.model.path}: {exc}"]
    problems = []
    reader = HFCheckpointReader(folder)
    if SCORE not in reader:
        problems.append(f"{key}={rm.model.path}: the checkpoint has no {SCORE}: it is not a reward model (an HF "
                        f"*ForSequenceClassification checkpoint); a causal LM serves as a generative judge only to a "
                        f"custom_reward_function.path function (meshrl.rewards.judge)")
    elif reader.shape(SCORE) != (1, spec.hidden_size):
        problems.append(f"{key}={rm.model.path}: {SCORE} has shape {reader.shape(SCORE)}; a reward model has one "
                        f"label, shape (1, {spec.hidden_size})")
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=rm.model.trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        problems.append(f"{key}={rm.model.path}: its tokenizer has no chat template, which renders the conversation "
                        "it scores")
    return problems + [f"{line} (the reward model's)"
                       for line in layout_problem_lines(spec, layout, "reward_model.megatron")]
