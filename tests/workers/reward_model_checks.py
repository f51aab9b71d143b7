"""In-process check of the reward-model role, without Ray: one ``RewardModelWorker`` at world size 1 (gloo) on the
tiny reward model, scoring conversations that ``reward_model_batch`` renders, against transformers' own
``LlamaForSequenceClassification`` on the same token ids (the independent implementation).

Run as a script in a fresh process (it starts torch.distributed and megatron's global state); it writes one JSON
that ``test_reward_model_worker.py`` asserts on:

    python tests/workers/reward_model_checks.py --out results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

CHATS = [[{"role": "user", "content": "What is 2 + 3?"}],
         [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a prime above 10."}],
         [{"role": "user", "content": "Say hi"}],
         [{"role": "user", "content": "Write one word that rhymes with cat, then stop."}]]
RESPONSES = ["2 + 3 = 5. The answer is 5.", "13", "hi there, how are you doing today?", "hat"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from omegaconf import OmegaConf
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from meshrl.config import load_config
    from meshrl.config.validate import validate_config
    from meshrl.models.resolve import resolve_model_path
    from meshrl.parallel.forward import OutputRequest
    from meshrl.protocol import Batch
    from meshrl.workers.reward_model import RewardModelWorker, reward_model_batch

    cfg = load_config(["reward_model.enable=True", "reward_model.model.path=tiny-rm:llama",
                       "reward_model.micro_batch_size_per_gpu=3", "reward_model.use_dynamic_bsz=False"],
                      recipe="cpu_tiny_grpo")
    plan = validate_config(cfg)
    model_dir = resolve_model_path(cfg.reward_model.model.path)
    worker = RewardModelWorker(0, 1, OmegaConf.to_container(cfg.reward_model, resolve=True), str(model_dir), plan)
    worker.setup(worker.address())

    policy_tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.actor_rollout_ref.model.path))
    rm_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = [policy_tokenizer(text + policy_tokenizer.eos_token, add_special_tokens=False)["input_ids"]
               for text in RESPONSES]
    width = max(map(len, encoded)) + 2  # right padding, as the rollout leaves it
    responses = torch.full((len(encoded), width), policy_tokenizer.pad_token_id)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    for row, ids in enumerate(encoded):
        responses[row, :len(ids)], mask[row, :len(ids)] = torch.tensor(ids), 1
    batch = Batch(tensors={"responses": responses, "response_mask": mask}, non_tensors={"raw_prompt": CHATS})
    inputs = reward_model_batch(batch, policy_tokenizer, rm_tokenizer)

    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([ids])).logits[0, 0] for ids in inputs["prompt_ids"]])
    results = {"expected": expected.tolist(), "rendered": [rm_tokenizer.decode(ids) for ids in inputs["prompt_ids"]]}
    for name, remove_padding in (("packed", True), ("rows", False)):
        worker.request = OutputRequest(remove_padding=remove_padding)
        results[name] = worker.compute_scores(inputs)["rm_scores"].tolist()
    Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
