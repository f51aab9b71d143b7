"""Shared test set-up: project-local caches, offline hub, one thread per process, model fixtures."""

import pytest
import torch

from meshrl.runtime import configure_environment

configure_environment()
# Two cores are shared by the test process and any engines or ranks it starts.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_dir():
    """Local HF folder of the embedded SmolLM2-135M-Instruct (converted once, cached)."""
    from meshrl.models.embedded import smollm2_hf_dir

    return smollm2_hf_dir()


@pytest.fixture(scope="session")
def tiny_llama_dir():
    """Tiny random Llama (GQA, tied embeddings) with the SmolLM2 tokenizer."""
    from meshrl.models.tiny import TinySpec, tiny_model_dir

    return tiny_model_dir(TinySpec())


@pytest.fixture(scope="session")
def tiny_qwen2_dir():
    """Tiny random Qwen2 (GQA, QKV bias, untied embeddings) with the SmolLM2 tokenizer."""
    from meshrl.models.tiny import TinySpec, tiny_model_dir

    return tiny_model_dir(TinySpec(arch="qwen2", hidden_size=256, tie_word_embeddings=False))


@pytest.fixture(scope="session")
def ray_session():
    """One Ray session per test process for the in-process trainings and worker groups of every module that asks
    (``meshrl.trainer.main.run`` uses a Ray its caller started and leaves it running; a run's ``runtime_env``
    reaches its workers through their actor options either way): saves Ray's start and stop per module, ~5-10 s
    each on 2 cores. Eight logical CPUs: more than any test run places (2 ranks x policy, critic and reward
    model).

    The runs' worker processes are kept between them (``meshrl.workers.pool.keep_workers``, as a notebook running
    several trainings would): a run of a shape an earlier one had (role, ranks, environment) takes its released
    workers instead of starting processes and importing torch, Megatron and vLLM again. Yields the pool."""
    import ray

    from meshrl.config import load_config
    from meshrl.workers.cluster import start_ray
    from meshrl.workers.pool import keep_workers

    start_ray(load_config(["trainer.n_gpus_per_node=1", "trainer.nnodes=1", "ray_kwargs.ray_init.num_cpus=8"]))
    with keep_workers(max_idle=KEPT_WORKERS) as pool:
        yield pool
    ray.shutdown()


# Idle worker processes the shared Ray session keeps (~1 GiB each); a run needs at most six of its eight CPUs.
KEPT_WORKERS = 2
