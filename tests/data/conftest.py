"""Shared fixtures for the data tests: the real GSM8K files preprocessed once, and SmolLM2's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrl.data.preprocess import preprocess


@pytest.fixture(scope="session")
def gsm8k_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gsm8k")
    preprocess("gsm8k", out, log=lambda _: None)
    return out


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path):
    """SmolLM2-135M-Instruct's tokenizer with its chat template (from the embedded model folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
