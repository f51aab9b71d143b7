"""Mistral (7B v0.2 / v0.3 and Mistral-shaped models): Llama's structure, its own head_dim field, and a
``sliding_window`` that meshrl does not implement: a window is accepted only when it can never slide (null, or
at least ``max_position_embeddings``, so every query sees every earlier key as in full attention). Mistral-7B
v0.1 (window 4096 of 32768 positions) is refused."""

from meshrl.models.families import Family, Refusal


def _window_never_slides(window, hf_config) -> bool:
    return window is None or window >= hf_config.max_position_embeddings


FAMILY = Family(
    model_type="mistral",
    hf_prefix="Mistral",
    refusals=(
        Refusal("sliding_window", _window_never_slides,
                "meshrl does not implement sliding-window attention yet; only a window of at least "
                "max_position_embeddings (which never slides) or null is accepted"),
    ),
    tiny_shape=dict(tie_word_embeddings=False, norm_scale=0.1),
    tiny_config=dict(sliding_window=None),
)
