"""Rollout: inference engines colocated with the trainer, and the weight sync into them.

    engine = create_engine(model_dir, EngineConfig.from_rollout(cfg.actor_rollout_ref.rollout))
    with colocated_rollout(engine, iter_hf_weights(chunks, hf_config), offload_trainer=..., onload_trainer=...):
        completions = engine.generate(prompt_ids, SamplingConfig.from_rollout(rollout_cfg))

Importing this package does not import vLLM or transformers; the engines import them when built.
"""

from meshrl.rollout.base import (
    ENGINE_NAMES,
    Completion,
    EngineConfig,
    EngineStateError,
    EngineUnavailableError,
    RolloutEngine,
    SamplingConfig,
)
from meshrl.rollout.engines import ENGINES, create_engine, unsupported_rollout_features
from meshrl.rollout.weight_sync import (
    LiveBytesMeter,
    SyncStats,
    WeightSyncError,
    colocated_rollout,
    iter_buckets,
    sync_weights,
)

__all__ = [
    "ENGINES",
    "ENGINE_NAMES",
    "Completion",
    "EngineConfig",
    "EngineStateError",
    "EngineUnavailableError",
    "LiveBytesMeter",
    "RolloutEngine",
    "SamplingConfig",
    "SyncStats",
    "WeightSyncError",
    "colocated_rollout",
    "create_engine",
    "iter_buckets",
    "sync_weights",
    "unsupported_rollout_features",
]
