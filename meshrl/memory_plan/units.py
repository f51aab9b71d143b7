"""Byte counts per element and the unit of the estimate: what a tensor of each kind costs."""

from __future__ import annotations

GIB = 1024**3


# Bytes per element. bf16 compute with fp32 gradients and AdamW master copy (megatron.dtype bfloat16, the
# GPU default), or fp32 throughout (float32, the CPU default).
BYTES_GPU = dict(param=2, grad=4, optim=12, act=2)


BYTES_CPU = dict(param=4, grad=4, optim=8, act=4)


LOGIT_BYTES_TRAIN = 10  # bf16 logits + fp32 copy kept by the cross entropy + fp32 gradient


LOGIT_BYTES_ENTROPY = 8  # the entropy bonus keeps an fp32 log-softmax and a temporary


LOGIT_BYTES_FORWARD = 6  # bf16 logits + fp32 copy


# Σπ² of the old-log-prob pass (actor.calculate_sum_pi_squared), before the cross entropy: bf16 logits + their fp32
# copy + the fp32 exp it squares in place (forward.vocab_parallel_sum_pi_squared); the fused path squares its chunk's
# own exp in place (nothing more than FUSED_BYTES_FORWARD)
SUM_PI2_BYTES_FORWARD = 10


FUSED_BYTES_TRAIN = 16  # per element of one [chunk, V/TP] chunk: fp32 logits, softmax and gradient (+ bf16 copies)


FUSED_BYTES_FORWARD = 12  # fp32 logits and two temporaries


OVERHEAD_GIB = {"cuda": 2.0, "cpu": 1.5}  # per process: CUDA context + NCCL + allocator slack / interpreter + libraries


CPU_DEFAULT_KV_BYTES = GIB  # the rollout config's documented default for CPU engines


class PlanError(ValueError):
    """The recipe cannot be planned (unknown model, impossible layout); the message says what to change."""

def gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def flops_text(value: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} FLOP"
