"""What a role's checkpoint holds: verl's ``checkpoint.save_contents`` / ``load_contents``, checked and read.

verl leaves ``optimizer`` or ``extra`` (or ``model``) out of a checkpoint, and its resume then starts the optimizer,
LR schedule or RNG afresh. meshrl's checkpoints resume exactly, so those values are refused, as are names verl does
not know; ``hf_model`` in ``save_contents`` also exports the role's weights as an HF checkpoint (``HF_EXPORT_DIR``),
and in ``load_contents`` has no effect, as in verl.
"""

from __future__ import annotations

from typing import Any

from meshrl.config.refusals import Checked, refusal
from meshrl.config.run_plan import check_run_plan

HF_EXPORT_DIR = "huggingface"
# verl's checkpoint.save_contents / load_contents values; meshrl's checkpoints always hold the first three.
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
RESUME_CONTENTS = ("model", "optimizer", "extra")
# The checkpoint parts, with the trainer key that bounds how many of each are kept.
KEEP_KEYS = {"actor": "trainer.max_actor_ckpt_to_keep", "critic": "trainer.max_critic_ckpt_to_keep"}


def _sections(cfg: Any, with_critic: bool) -> dict[str, tuple[str, Any]]:
    sections = {"actor": ("actor_rollout_ref.actor.checkpoint", cfg.actor_rollout_ref.actor.checkpoint)}
    if with_critic:
        sections["critic"] = ("critic.checkpoint", cfg.critic.checkpoint)
    return sections


def hf_export_roles(cfg: Any, with_critic: bool) -> list[str]:
    """The roles (``actor``, ``critic`` when ``with_critic``) whose saves also export HF weights (``hf_model`` in
    their ``checkpoint.save_contents``)."""
    return [role for role, (_, section) in _sections(cfg, with_critic).items() if "hf_model" in section.save_contents]


@refusal("config", "actor_rollout_ref.actor.checkpoint", "critic.checkpoint")
def checkpoint_contents_problems(c: Checked) -> list[str]:
    """Checkpoint contents meshrl cannot save or resume exactly (module docstring): a value verl does not know, or
    ``save_contents`` / ``load_contents`` leaving out the model, the optimizer or the extra state."""
    plan = c.once(check_run_plan)[0]
    problems = []
    for role, (prefix, section) in _sections(c.cfg, plan is not None and plan.use_critic).items():
        for name in ("save_contents", "load_contents"):
            values = list(section[name])
            if unknown := [v for v in values if v not in CHECKPOINT_CONTENTS]:
                problems.append(f"{prefix}.{name}: {unknown} not among verl's {list(CHECKPOINT_CONTENTS)}")
            if missing := [v for v in RESUME_CONTENTS if v not in values]:
                problems.append(
                    f"{prefix}.{name}={values} leaves out {missing}: meshrl checkpoints always hold the model, "
                    f"the optimizer with its LR schedule, and the extra state (RNG, engine seeds), so that a resume "
                    f"continues exactly; keep {list(RESUME_CONTENTS)}. To bound the disk used, set "
                    f"{KEEP_KEYS[role]}; to start a new run from trained weights, add hf_model to save_contents "
                    f"and point the model path at global_step_N/{role}/{HF_EXPORT_DIR}.")
    return problems
