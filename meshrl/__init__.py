"""meshrl: RL post-training for LLMs on Megatron-core + vLLM + Ray (see docs/architecture.md)."""

__version__ = "0.1.0"
