"""Model parallelism on megatron-core: build, shard, run and checkpoint the models a
family of ``meshrl.models.families`` describes.

Knows nothing of RL; losses come in as callables. Modules (import them directly; importing this
package does not import megatron, which costs seconds):

- ``state``: process groups (TP, PP, virtual PP, DP; gloo on CPU, NCCL on GPU) with a fail-fast timeout.
- ``cpu_compat``: process-local redirection of megatron-core's CUDA-only calls on CPU-only machines.
- ``model_builder``: ``GPTModel`` chunks (policy or critic) from a Hugging Face config.
- ``hf_conversion``: streamed HF safetensors -> shard loading, ``iter_hf_weights`` (full HF tensors for
  export and rollout weight sync), HF folder export.
- ``packing``: sequences packed without padding (THD, ``use_remove_padding``) and back.
- ``forward`` / ``schedule``: per-token log-probs, entropy (vocab-parallel) and values; forward-only
  and training passes through megatron's pipeline schedules, with globally normalised losses.
- ``optimizer``: megatron AdamW, clipping, LR schedule, ``train_step``.
- ``checkpoint``: atomic, layout-independent distributed checkpoints (model, optimizer, schedule).
- ``offload``: parameters / gradients / optimizer state to host memory and back.
- ``convert_cli``: ``meshrl convert hf-to-mcore | mcore-to-hf``.
"""
