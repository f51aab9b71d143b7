"""What a discriminative reward model reads: the conversation re-rendered with the reward model's own chat
template, as verl's reward loop builds it (``RewardLoopWorker._preprocess_reward_inputs``).

For each sample, with ``chat`` the prompt's messages (``raw_prompt``, kept with ``data.return_raw_chat``) and
``response`` the response's text decoded with the policy's tokenizer (special tokens kept, the EOS string
removed)::

    text = rm_tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": response}],
                                            add_generation_prompt=False, tokenize=False)
    ids  = rm_tokenizer(text, add_special_tokens=False)

The template writes the special tokens the model expects (a Llama-3 reward model's one BOS), so tokenising adds
none, as transformers' ``apply_chat_template(tokenize=True)`` does. verl gets the same single BOS another way
(it cuts the BOS string from the text and lets its server's tokenizer add one), which loses the first token of
templates whose "BOS" is a chat marker the tokenizer never adds (SmolLM2's ``<|im_start|>``). The score is the
model's ``score`` head (``*ForSequenceClassification``, ``num_labels=1``) at the sequence's last token.

The policy and the reward model may use different tokenizers (verl's example pairs a Qwen2 policy with a
Llama-3 reward model): everything crosses over as text.
"""

from __future__ import annotations

from typing import Any, Sequence


def reward_model_text(chat: Sequence[dict[str, Any]], response: str, rm_tokenizer) -> str:
    """The conversation with ``response`` as the assistant's last turn, rendered by ``rm_tokenizer``'s template."""
    if not getattr(rm_tokenizer, "chat_template", None):
        raise ValueError("the reward model's tokenizer has no chat template; give reward_model.model.path a "
                         "tokenizer with one (tokenizer_config.json's chat_template)")
    return rm_tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": response}],
                                            add_generation_prompt=False, tokenize=False)


def reward_model_ids(chats: Sequence[Sequence[dict[str, Any]]], responses: Sequence[str], rm_tokenizer,
                     max_length: int | None = None) -> list[list[int]]:
    """Token ids of each (chat, response) pair for the reward model (module docstring).

    ``max_length`` (``reward_model.max_length``): a longer sequence keeps its first ``max_length`` tokens, as
    verl's legacy reward-model workers truncate (right side).
    """
    if len(chats) != len(responses):
        raise ValueError(f"{len(chats)} chats but {len(responses)} responses")
    out = []
    for chat, response in zip(chats, responses):
        ids = rm_tokenizer(reward_model_text(chat, response, rm_tokenizer), add_special_tokens=False)["input_ids"]
        out.append(list(ids[:max_length] if max_length else ids))
    return out


def strip_eos(text: str, eos_token: str | None) -> str:
    """The response text without the policy's EOS string (verl removes every occurrence)."""
    return text.replace(eos_token, "") if eos_token else text
