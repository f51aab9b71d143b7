"""``meshrl convert``: Hugging Face folder <-> meshrl (megatron dist-checkpoint) checkpoint.

    meshrl convert hf-to-mcore --hf DIR --out ROOT [--critic] [--step N] [--tp T --pp P]
    meshrl convert mcore-to-hf --ckpt ROOT_OR_STEP_DIR --hf-config DIR --out DIR [--tokenizer DIR]
                               [--dtype float32|bfloat16] [--tp T --pp P]

Run it as one process, or under ``torchrun`` with ``--tp/--pp`` to split a large model over ranks (a
rank then reads / holds only its shard). The megatron checkpoint does not depend on that layout:
training may load it at any TP/PP.

``hf-to-mcore`` refuses a folder whose tensors disagree with its own ``config.json``;
``mcore-to-hf`` refuses an HF config that disagrees with the architecture saved in the checkpoint.
Both name the mismatching config field.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshrl.models.families import ModelSpec

# ModelSpec field -> the HF config field it comes from (for error messages; a field not listed is named as it is).
HF_FIELD = {
    "model_type": "model_type", "num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size", "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
    "tie_word_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps",
    "qkv_bias": "model_type (QKV bias)", "max_position_embeddings": "max_position_embeddings",
    "qk_norm": "model_type (q/k norms)",
}


class ConfigMismatch(ValueError):
    """The HF config and the checkpoint describe different models."""


def compare_specs(checkpoint: ModelSpec, hf: ModelSpec) -> None:
    """Raise ``ConfigMismatch`` naming every HF config field that differs from the checkpoint's."""
    mine, theirs = checkpoint.to_dict(), hf.to_dict()
    diffs = [f"{HF_FIELD.get(key, key)}: checkpoint has {mine[key]!r}, HF config has {theirs[key]!r}"
             for key in mine if mine[key] != theirs[key]]
    if diffs:
        raise ConfigMismatch("the HF config does not match the checkpoint: " + "; ".join(diffs))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrl convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors folder -> meshrl checkpoint root")
    to_mcore.add_argument("--hf", required=True, type=Path, help="HF folder (config.json + safetensors)")
    to_mcore.add_argument("--out", required=True, type=Path, help="checkpoint root to write")
    to_mcore.add_argument("--critic", action="store_true", help="build a critic (value head from score.*)")
    to_mcore.add_argument("--step", type=int, default=0, help="step number to record (default 0)")
    to_hf = sub.add_parser("mcore-to-hf", help="meshrl checkpoint -> HF safetensors folder")
    to_hf.add_argument("--ckpt", required=True, type=Path, help="checkpoint root (uses latest) or step_* folder")
    to_hf.add_argument("--hf-config", required=True, type=Path, help="folder with the model's HF config.json")
    to_hf.add_argument("--out", required=True, type=Path, help="HF folder to write")
    to_hf.add_argument("--tokenizer", type=Path, default=None,
                       help="folder to copy tokenizer files from (default: --hf-config)")
    to_hf.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                       help="dtype of the written tensors (default: the model's)")
    for sub_parser in (to_mcore, to_hf):
        sub_parser.add_argument("--tp", type=int, default=1, help="tensor parallel size of this run")
        sub_parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size of this run")
    return parser


def read_hf_config(folder: Path, flag: str):
    """The HF config in ``folder`` (given as ``flag``), read before any rank starts.

    Raises:
        ValueError: no config.json there, or one transformers cannot read (the message names the flag and folder).
    """
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():  # transformers would read the path as a hub repository id
        what = "has no config.json" if folder.is_dir() else "is not a folder"
        raise ValueError(f"{flag} {folder} {what}; give the model's Hugging Face folder")
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:  # invalid JSON, an unknown model_type
        raise ValueError(f"{flag} {folder}: {str(exc).splitlines()[0].strip()} Fix its config.json, or copy it "
                         "again from the model's source") from None


def hf_to_mcore(hf_dir: Path, hf_config, out: Path, critic: bool = False, step: int = 0) -> Path:
    """Convert (needs ``state.initialize``; ``hf_config``: ``hf_dir``'s); returns the checkpoint folder."""
    from meshrl.parallel import checkpoint, hf_conversion, model_builder

    chunks = model_builder.build_model(hf_config, critic=critic)
    hf_conversion.load_hf_weights(chunks, hf_dir, hf_config)
    return checkpoint.save_checkpoint(out, step, chunks)


def mcore_to_hf(ckpt: Path, hf_config_dir: Path, hf_config, out: Path, tokenizer: Path | None = None,
                dtype: str | None = None) -> Path | None:
    """Convert (needs ``state.initialize``; ``hf_config``: ``hf_config_dir``'s); returns the HF folder on the writing
    rank."""
    import torch

    from meshrl.parallel import checkpoint, hf_conversion, model_builder

    folder = ckpt if (ckpt / "meshrl.json").is_file() else checkpoint.latest_checkpoint(ckpt)
    if folder is None:
        raise FileNotFoundError(f"no meshrl checkpoint in {ckpt}")
    meta = checkpoint.checkpoint_metadata(folder)
    compare_specs(ModelSpec(**meta["model_spec"]), model_builder.model_spec(hf_config))
    chunks = model_builder.build_model(hf_config, critic=meta["critic"])
    checkpoint.load_checkpoint(folder, chunks)
    return hf_conversion.save_hf_checkpoint(chunks, hf_config, out, tokenizer_dir=tokenizer or hf_config_dir,
                                            dtype=getattr(torch, dtype) if dtype else None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``meshrl convert``; returns the exit status (2 for a config mismatch)."""
    args = _parser().parse_args(argv)
    from meshrl.parallel import state

    try:
        hf_config = read_hf_config(args.hf, "--hf") if args.command == "hf-to-mcore" else \
            read_hf_config(args.hf_config, "--hf-config")
    except ValueError as exc:
        print(f"meshrl convert: error: {exc}", file=sys.stderr)
        return 2
    state.initialize(state.ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp))
    try:
        if args.command == "hf-to-mcore":
            result = hf_to_mcore(args.hf, hf_config, args.out, critic=args.critic, step=args.step)
        else:
            result = mcore_to_hf(args.ckpt, args.hf_config, hf_config, args.out, args.tokenizer, args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        print(f"meshrl convert: error: {exc}", file=sys.stderr)
        return 2
    finally:
        state.destroy()
    if result is not None:
        print(f"wrote {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
