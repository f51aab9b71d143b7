"""The reward model's input: the conversation rendered with its own chat template (verl's reward loop)."""

import pytest
from transformers import AutoTokenizer

from meshrl.models.resolve import resolve_model_path
from meshrl.rewards.reward_model_inputs import reward_model_ids, reward_model_text, strip_eos

CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("embedded:smollm2"))


def test_the_response_is_the_assistants_last_turn(tokenizer):
    text = reward_model_text(CHAT, "It is 5.", tokenizer)
    assert text == tokenizer.apply_chat_template([*CHAT, {"role": "assistant", "content": "It is 5."}],
                                                 tokenize=False)
    assert text.index("What is 2 + 3?") < text.index("It is 5.") and text.rstrip().endswith("<|im_end|>")


def test_ids_hold_the_templates_special_tokens_once(tokenizer):
    (ids,) = reward_model_ids([CHAT], ["It is 5."], tokenizer)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # SmolLM2's template opens every turn (its default system turn, user, assistant) with <|im_start|>, which is
    # also its "BOS": kept, and never added a second time
    assert ids[0] == start and ids.count(start) == 3
    assert tokenizer.decode(ids) == reward_model_text(CHAT, "It is 5.", tokenizer)


def test_max_length_keeps_the_first_tokens(tokenizer):
    (full,) = reward_model_ids([CHAT], ["It is 5."], tokenizer)
    (cut,) = reward_model_ids([CHAT], ["It is 5."], tokenizer, max_length=7)
    assert cut == full[:7] and len(full) > 7


def test_strip_eos_removes_every_eos_string():
    assert strip_eos("5<|im_end|><|im_end|>", "<|im_end|>") == "5"
    assert strip_eos("5", None) == "5"


def test_bad_input_is_named(tokenizer):
    with pytest.raises(ValueError, match="2 chats but 1 responses"):
        reward_model_ids([CHAT, CHAT], ["x"], tokenizer)
    bare = AutoTokenizer.from_pretrained(resolve_model_path("embedded:smollm2"))
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        reward_model_text(CHAT, "x", bare)
