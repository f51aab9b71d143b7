"""The policy's chat template: the tokenizer's own, or verl's ``actor_rollout_ref.model.custom_chat_template``.

verl puts ``custom_chat_template`` on the policy's tokenizer (and processor) wherever conversations are rendered;
meshrl does the same in the two places that render them: the driver, which renders the prompts
(``meshrl.data.dataset``; a vision-language model's processor is built from the tokenizer and takes its template),
and the rollout workers, whose multi-turn loop renders the tool and user turns
(``meshrl.rollout.agent_loop.MessageTokens``). verl's Geometry3K multi-turn configs set one (Qwen2.5-VL's template
with tool calls and image items). A template that cannot render a one-message conversation is refused when the run
loads, naming the key.
"""

from __future__ import annotations

from typing import Any

CUSTOM_CHAT_TEMPLATE_KEY = "actor_rollout_ref.model.custom_chat_template"


def use_chat_template(tokenizer: Any, template: str | None) -> Any:
    """``tokenizer`` with ``template`` as its chat template (unchanged when None), returned.

    Raises:
        ValueError: the template does not render ``[{"role": "user", ...}]`` with the generation prompt (a Jinja
            syntax error, a template that raises); the message names the key.
    """
    if template is None:
        return tokenizer
    from jinja2 import TemplateError

    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:
        raise ValueError(f"{CUSTOM_CHAT_TEMPLATE_KEY}: the template does not render a one-message conversation "
                         f"({type(exc).__name__}: {exc}); fix it, or leave the key unset to use the tokenizer's "
                         "own") from None
    return tokenizer
