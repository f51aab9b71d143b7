"""Tiny random reward models (``tiny-rm:<family>``): a family's tiny model (``meshrl.models.tiny``) as an HF
``*ForSequenceClassification`` with one label — the checkpoint layout of a discriminative reward model (verl's
``reward_model.model.path``), for tests and CPU smoke runs. The ``score`` head is drawn larger than HF's init so
scores differ between responses."""

from __future__ import annotations

from pathlib import Path

from meshrl.atomic_io import cached_dir
from meshrl.runtime import cache_dir


def tiny_reward_model_dir(model_type: str = "llama", seed: int = 0) -> Path:
    """Local HF folder (config, safetensors, SmolLM2 tokenizer) of the tiny reward model, built once and cached."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from meshrl.models.embedded import smollm2_hf_dir
    from meshrl.models.families import family
    from meshrl.models.tiny import tiny_config, tiny_spec

    spec = tiny_spec(model_type, seed=seed)
    def build(tmp: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir())
        config = tiny_config(spec)
        config.num_labels = 1
        config.pad_token_id = tokenizer.pad_token_id
        classifier = getattr(transformers, f"{family(model_type).hf_prefix}ForSequenceClassification")
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = classifier(config).to(torch.float32)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if param.dim() >= 2:
                        param.normal_(0.0, 0.08)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return cached_dir(cache_dir() / "models" / spec.name().replace("tiny-", "tiny-rm-", 1), "model.safetensors",
                      build)
