"""In-process checks of the policy worker with LoRA (verl's FSDP keys) on the tiny Llama with the transformers
rollout engine, without Ray; run as a script in a fresh process, it writes one JSON of measurements that
``test_lora_worker.py`` asserts on:

    python tests/parallel/lora_worker_checks.py --out results.json

The KL reference is the policy with its adapters off: no separate model, the base's log-probs before and after
updates; the engine is sent merged weights, so its log-probs follow the trainer's after every sync; the
checkpoint restores adapters and Adam's state and holds the PEFT adapter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))

from worker_checks import WIDTH, make_worker, max_diff, weights  # noqa: E402

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=2e-2"]


def rollout(worker, prompts):
    """A sampled batch with the trainer's and the reference's log-probs; the largest |engine - trainer| gap."""
    batch = worker.generate(prompts, "train")
    batch = batch.union(worker.compute_log_probs(batch, model="actor")).union(
        worker.compute_log_probs(batch, model="ref"))
    mask = batch["response_mask"].bool()
    return batch, float((batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max())


def adam_state(worker) -> dict[str, torch.Tensor]:
    """Adam's moments and step of every trained parameter, by parameter name."""
    from meshrl.parallel.optimizer import _inner_optimizers

    inner, = _inner_optimizers(worker.optimizer)
    name_of = {id(p): name for chunk in worker.policy for name, p in chunk.named_parameters()}
    return {f"{name_of[id(param)]}.{key}": value.clone() for param, item in inner.optimizer.state.items()
            for key, value in item.items()}


def main() -> None:
    from meshrl.algorithms import GlobalNorm
    from meshrl.protocol import Batch
    from meshrl.runtime import configure_environment

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    configure_environment()
    torch.set_num_threads(1)
    worker = make_worker(LORA)
    trained = {id(p) for p in worker.optimizer.get_parameters()}
    names = {name: id(p) in trained for chunk in worker.policy for name, p in chunk.named_parameters()}
    result = {"separate_reference": worker.ref is not None,
              "optimizer_params": sum(names.values()),
              "optimizer_params_not_adapters": sum(1 for n, t in names.items() if t and "_lora.lora_" not in n),
              "adapters_outside_optimizer": sum(1 for n, t in names.items() if not t and "_lora.lora_" in n)}
    g = torch.Generator().manual_seed(0)
    prompts = Batch(non_tensors={"prompt_ids": [torch.randint(10, 5000, (n,), generator=g).tolist()
                                                for n in (5, 7, 4, 6)]})
    start = weights(worker)
    batch, result["step1_engine_gap"] = rollout(worker, prompts)
    result["step1_ref_vs_old"] = float((batch["ref_log_probs"] - batch["old_log_probs"]).abs().max())
    mask = batch["response_mask"]
    batch.set("advantages", torch.randn(mask.shape[0], 1, generator=g) * mask)
    for _ in range(3):
        worker.update([(batch, GlobalNorm.from_mask(mask, max_len=WIDTH))])
    after = weights(worker)
    changed = {name: not torch.equal(after[name], start[name]) for name in start}
    result["base_tensors_changed"] = sum(1 for n, c in changed.items() if c and "_lora.lora_" not in n)
    result["adapter_tensors_unchanged"] = sum(1 for n, c in changed.items() if not c and "_lora.lora_" in n)
    ref_after = worker.compute_log_probs(batch, model="ref")["ref_log_probs"]
    old_after = worker.compute_log_probs(batch, model="actor")["old_log_probs"]
    result["ref_after_updates_vs_step1"] = float((ref_after - batch["ref_log_probs"]).abs().max())
    result["policy_moved"] = float((old_after - batch["old_log_probs"]).abs().max())
    sync = worker.sync_weights()
    result["sync_seconds"] = sync["sync/seconds"]
    _, result["after_sync_engine_gap"] = rollout(worker, prompts)

    folder = args.out.parent / "ckpt"
    worker.save_checkpoint(str(folder), 1)
    saved, saved_adam = weights(worker), adam_state(worker)
    result["peft_files"] = sorted(p.name for p in (folder / "actor" / "lora_adapter").iterdir())
    worker.update([(batch, GlobalNorm.from_mask(mask, max_len=WIDTH))])  # moves adapters and Adam's state
    result["moved_before_load"] = max_diff(saved, weights(worker))
    worker.load_checkpoint(str(folder))
    result["checkpoint_weights"] = max_diff(saved, weights(worker))
    result["checkpoint_adam"] = max_diff(saved_adam, adam_state(worker))
    _, result["after_resume_engine_gap"] = rollout(worker, prompts)
    worker.shutdown_engine()
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
