"""RL prompt dataset: rows in verl's layout (parquet or JSONL) -> chat-templated prompt token ids + reward metadata.

Row layout (what :mod:`meshrl.data.preprocess` writes)::

    data_source: str, prompt: [{"role": str, "content": str}, ...],
    reward_model: {"ground_truth": str | number, ...}, extra_info: dict | None (optional)

The prompt is rendered with the model's chat template,
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, **data.apply_chat_template_kwargs)``,
and tokenised without adding special tokens again (the template already places them). Everything is
validated and tokenised at construction, so a bad file fails before the first rollout rather than mid-epoch.

``data.reward_fn_key`` names the column whose value picks the reward function (verl's reward managers
pass it as ``data_source``); it must be a string in every row. With a key other than ``data_source`` the
``data_source`` column may be absent (metrics then group such rows under ``unknown``, as verl's do).
``data.train_max_samples`` / ``data.val_max_samples`` keep a subset of the rows of all files together,
chosen before filtering (:func:`meshrl.data.sampler.max_samples_subset`).

Over-long prompts (``len > max_prompt_length``) are dropped when ``filter_overlong_prompts`` (the count
is in :attr:`RLDataset.num_filtered`); otherwise ``truncation`` decides: ``error`` raises naming the
file, row and length; ``left`` keeps the last ``max_prompt_length`` tokens, ``right`` the first,
``middle`` the first ``ceil(max/2)`` and the last ``floor(max/2)``.

Images (``data.image_key``, verl's ``images`` column, ``<image>`` marking each in the prompt's text) are read when
the dataset has the vision-language model's processor (``meshrl.data.vision``): the prompt is rendered and
tokenised by the processor, so its ids hold one pad per merged image patch and the length filter counts them as
verl's does; the row's images travel with the sample (``PromptSample.images``, as stored) and
``multi_modal_inputs`` gives their ``pixel_values`` / ``image_grid_thw``. Without a processor (a text-only model) a
row with images or videos (``data.video_key``; videos are not read at all) raises :class:`MultiModalDataError`
rather than training on its text alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow.parquet as pq
import torch.utils.data
from omegaconf import DictConfig, OmegaConf

from meshrl.data.embedded import resolve_data_files
from meshrl.data.sampler import max_samples_subset
from meshrl.data.sources import read_jsonl

logger = logging.getLogger(__name__)

Truncation = Literal["error", "left", "right", "middle"]
TRUNCATION_MODES: tuple[str, ...] = ("error", "left", "right", "middle")
_MAX_LISTED_ERRORS = 5
# data_source of rows without one (allowed when data.reward_fn_key names another column), as in verl's metrics
UNKNOWN_SOURCE = "unknown"
_TOKENIZE_CHUNK = 1024


class DataFormatError(ValueError):
    """A data file has rows that do not follow the expected layout (file and row indices in the message)."""


class MultiModalDataError(DataFormatError):
    """A data file's rows carry images or videos; meshrl trains text-only policies (file and rows in the message)."""


class PromptTooLongError(ValueError):
    """A prompt exceeds ``max_prompt_length`` with ``truncation='error'`` (file, row and length in the message)."""


@dataclass(frozen=True)
class PromptSample:
    """One prompt: its token ids and what the reward needs. ``source_file``/``row`` locate it (row 0-based).

    ``reward_source`` is the row's ``data.reward_fn_key`` column, the reward function's ``data_source``
    argument; ``data_source`` is the row's own column, which metrics group by.
    """

    prompt_ids: list[int]
    data_source: str
    reward_source: str
    ground_truth: str
    extra_info: dict[str, Any]
    messages: list[dict[str, str]]
    source_file: str
    row: int
    images: tuple[Any, ...] = ()  # the row's data.image_key entries, as stored (meshrl.data.vision.load_image)


@dataclass(frozen=True)
class PromptBatch:
    """Field-wise lists for a batch of :class:`PromptSample` (same order as the requested indices)."""

    indices: list[int]
    prompt_ids: list[list[int]]
    data_sources: list[str]
    reward_sources: list[str]
    ground_truths: list[str]
    extra_infos: list[dict[str, Any]]
    messages: list[list[dict[str, str]]]
    images: list[tuple[Any, ...]]


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist (preprocess with `python -m meshrl.data.preprocess`)")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    raise DataFormatError(f"{path}: unsupported file type {path.suffix!r}; use .parquet or .jsonl")


def _check_row(row: Any, prompt_key: str, reward_fn_key: str = "data_source") -> str | None:
    """Why ``row`` does not follow the layout, or None if it does."""
    if not isinstance(row, Mapping):
        return f"row is a {type(row).__name__}, expected an object"
    messages = row.get(prompt_key)
    if not isinstance(messages, list) or not messages:
        return f"field {prompt_key!r} must be a non-empty list of chat messages, got {type(messages).__name__}"
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"{prompt_key}[{j}] must be {{'role': str, 'content': str}}, got {m!r:.80}"
    if not isinstance(row.get(reward_fn_key), str):
        named_by = "" if reward_fn_key == "data_source" else " (data.reward_fn_key names it)"
        return f"field {reward_fn_key!r}{named_by} must be a string, got {type(row.get(reward_fn_key)).__name__}"
    if row.get("data_source") is not None and not isinstance(row["data_source"], str):
        return f"field 'data_source' must be a string, got {type(row['data_source']).__name__}"
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
        return "field 'reward_model' must be an object with a 'ground_truth'"
    truth = reward_model["ground_truth"]
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        return f"reward_model.ground_truth must be a string or number, got {type(truth).__name__}"
    if row.get("extra_info") is not None and not isinstance(row["extra_info"], Mapping):
        return f"field 'extra_info' must be an object or null, got {type(row['extra_info']).__name__}"
    return None


def _has_media(value: Any) -> bool:
    """A multi-modal column's cell holds something (rows of text datasets may have the column empty)."""
    if value is None:
        return False
    try:
        return len(value) > 0
    except TypeError:
        return True


def truncate(ids: list[int], max_length: int, mode: Truncation) -> list[int]:
    """``ids`` cut to ``max_length`` tokens by ``mode`` ('left', 'right' or 'middle'; see the module docstring)."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = (max_length + 1) // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise ValueError(f"truncation mode {mode!r} cannot cut; expected one of {TRUNCATION_MODES[1:]}")


class RLDataset(torch.utils.data.Dataset):
    """Prompts from one or more files, tokenised with ``tokenizer``'s chat template.

    Args:
        files: parquet/JSONL file(s) (``data.train_files`` / ``data.val_files``).
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_prompt_length: prompt token budget (``data.max_prompt_length``).
        filter_overlong_prompts: drop prompts longer than the budget (``data.filter_overlong_prompts``).
        truncation: what to do with the rest when not filtering (``data.truncation``).
        prompt_key: the column holding the chat messages (``data.prompt_key``).
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template`` (e.g. ``enable_thinking``;
            ``data.apply_chat_template_kwargs``).
        reward_fn_key: the column that picks the reward function (``data.reward_fn_key``).
        media_keys: columns of images / videos (``data.image_key``, ``data.video_key``): a row with any is refused
            without a ``processor``, and with one a row with videos.
        processor: the vision-language model's (``meshrl.data.vision.load_processor``): rows' images are read.
        prompt_positions: with a ``processor``, the model's 3-D position rule (``meshrl.data.mrope_positions.
            positions_for_config``): ``multi_modal_inputs`` gives each prompt's positions with its images.
        max_samples: keep this many rows of all files together (-1: all; ``data.train_max_samples`` /
            ``data.val_max_samples``), drawn with ``seed`` when ``shuffle`` (``data.shuffle`` / ``data.seed``),
            else the first ones; chosen before filtering, as verl does.

    Raises:
        DataFormatError: malformed rows (file + row indices of the first few, and the total count).
        MultiModalDataError: rows with images (without a ``processor``) or videos under ``media_keys``.
        meshrl.data.vision.ImageDataError: a row whose images do not match its ``<image>`` marks, or do not load.
        PromptTooLongError: ``truncation='error'`` and a prompt is too long.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        max_prompt_length: int = 1024,
        filter_overlong_prompts: bool = True,
        truncation: Truncation = "error",
        prompt_key: str = "prompt",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reward_fn_key: str = "data_source",
        media_keys: Sequence[str] = ("images", "videos"),
        processor: Any = None,
        prompt_positions: Any = None,
        max_samples: int = -1,
        shuffle: bool = False,
        seed: int | None = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length must be > 0, got {max_prompt_length}")
        paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
        if not paths:
            raise ValueError("no data files given")
        self.max_prompt_length = max_prompt_length
        self.num_filtered = 0
        self.num_truncated = 0
        self._meta: list[tuple[str, str, str, dict[str, Any], list[dict[str, str]], str, int, tuple]] = []
        self.processor, self.prompt_positions, image_key = processor, prompt_positions, media_keys[0]
        token_chunks: list[np.ndarray] = []
        lengths: list[int] = []
        located: list[tuple[Path, int, dict[str, Any]]] = []  # (file, row index, row) of all files in order
        for path in paths:
            rows = _read_rows(path)
            self._validate(path, rows, prompt_key, reward_fn_key)
            self._refuse_media(path, rows, media_keys[1:] if processor is not None else media_keys)
            located.extend((path, index, row) for index, row in enumerate(rows))
        if not located:
            raise DataFormatError(f"{', '.join(map(str, paths))}: no rows, so there are no prompts; give a file that "
                                  "holds some")
        kept = [located[i] for i in max_samples_subset(len(located), max_samples, shuffle=shuffle, seed=seed)]
        for start in range(0, len(kept), _TOKENIZE_CHUNK):
            chunk = kept[start : start + _TOKENIZE_CHUNK]
            encoded = self._encode(tokenizer, [row[prompt_key] for _, _, row in chunk], chat_template_kwargs or {},
                                   processor, [row.get(image_key) or () for _, _, row in chunk],
                                   [f"{path}, row {index} (0-based)" for path, index, _ in chunk])
            for (path, index, row), ids in zip(chunk, encoded, strict=True):
                ids = self._fit(ids, path, index, filter_overlong_prompts, truncation)
                if ids is None:
                    continue
                token_chunks.append(np.asarray(ids, dtype=np.int64))
                lengths.append(len(ids))
                self._meta.append(
                    (
                        row.get("data_source") or UNKNOWN_SOURCE,
                        row[reward_fn_key],
                        str(row["reward_model"]["ground_truth"]),
                        dict(row.get("extra_info") or {}),
                        [{"role": m["role"], "content": m["content"]} for m in row[prompt_key]],
                        str(path),
                        index,
                        tuple(row.get(image_key) or ()) if processor is not None else (),
                    )
                )
        if self.num_filtered:
            logger.info("dropped %d prompt(s) longer than %d tokens", self.num_filtered, max_prompt_length)
        if not self._meta:
            raise ValueError(
                f"no prompts left in {[str(p) for p in paths]} (all {self.num_filtered} longer than "
                f"max_prompt_length={max_prompt_length})"
            )
        # One flat id buffer + offsets: a list of per-row Python lists costs ~10x the memory.
        self._ids = np.concatenate(token_chunks)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.prompt_lengths = np.asarray(lengths, dtype=np.int64)

    @staticmethod
    def _validate(path: Path, rows: list[Any], prompt_key: str, reward_fn_key: str) -> None:
        if rows and all(isinstance(row, Mapping) for row in rows):
            # A key naming a column the file lacks: said once, not once per row.
            for key, name in ((prompt_key, "data.prompt_key"), (reward_fn_key, "data.reward_fn_key")):
                if not any(key in row for row in rows):
                    raise DataFormatError(f"{path}: no row has the field {key!r} that {name} names; the rows have "
                                          f"{', '.join(dict.fromkeys(k for row in rows for k in row))}")
        problems = [(i, why) for i, row in enumerate(rows)
                    if (why := _check_row(row, prompt_key, reward_fn_key)) is not None]
        if not problems:
            return
        listed = "\n".join(f"  {path}, row {i}: {why}" for i, why in problems[:_MAX_LISTED_ERRORS])
        more = f"\n  ... and {len(problems) - _MAX_LISTED_ERRORS} more" if len(problems) > _MAX_LISTED_ERRORS else ""
        raise DataFormatError(
            f"{len(problems)} malformed row(s) in {path} (rows are 0-based; expected verl's layout: "
            f"{reward_fn_key}, {prompt_key}=[{{role, content}}], reward_model.ground_truth, extra_info):\n"
            f"{listed}{more}"
        )

    @staticmethod
    def _refuse_media(path: Path, rows: list[Mapping[str, Any]], media_keys: Sequence[str]) -> None:
        rows_with = [i for i, row in enumerate(rows) if any(_has_media(row.get(key)) for key in media_keys)]
        if not rows_with:
            return
        more = ", ..." if len(rows_with) > _MAX_LISTED_ERRORS else ""
        listed = ", ".join(map(str, rows_with[:_MAX_LISTED_ERRORS])) + more
        raise MultiModalDataError(
            f"{path}: {len(rows_with)} row(s) carry multi-modal data under {' / '.join(map(repr, media_keys))} "
            f"(data.image_key / data.video_key; rows {listed}, 0-based): multi-modal training (images, video) is not "
            "built yet (images are read for a vision-language model's processor, meshrl.data.vision, but no such "
            "model trains yet; videos are not read), and meshrl trains text-only policies; use a text-only dataset")

    @staticmethod
    def _encode(tokenizer: Any, conversations: list[list[dict[str, str]]], template_kwargs: Mapping[str, Any],
                processor: Any = None, images: Sequence[Sequence[Any]] = (),
                where: Sequence[str] = ()) -> list[list[int]]:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat template; RL prompts are chat messages and "
                f"need one (use an instruct model's tokenizer, or set tokenizer.chat_template)"
            )
        if processor is not None and any(images):  # the processor expands each image's pads
            from meshrl.data import vision

            encoded = []
            for messages, row_images, place in zip(conversations, images, where, strict=True):
                try:
                    built = vision.prompt_messages(messages, row_images)
                except vision.ImageDataError as error:
                    raise vision.ImageDataError(f"{place}: {error}") from None
                encoded.append(vision.encode_prompt(processor, *built, template_kwargs)[0])
            return encoded
        texts = tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _fit(
        self, ids: list[int], path: Path, index: int, filter_overlong: bool, truncation: Truncation
    ) -> list[int] | None:
        if len(ids) <= self.max_prompt_length:
            return ids
        if filter_overlong:
            self.num_filtered += 1
            return None
        if truncation == "error":
            raise PromptTooLongError(
                f"{path}, row {index} (0-based): prompt is {len(ids)} tokens after the chat template, longer than "
                f"data.max_prompt_length={self.max_prompt_length}. Set data.filter_overlong_prompts=True to drop "
                f"such prompts, data.truncation to 'left', 'right' or 'middle' to cut them, or raise the limit."
            )
        self.num_truncated += 1
        return truncate(ids, self.max_prompt_length, truncation)

    def __len__(self) -> int:
        return len(self._meta)

    def __getitem__(self, index: int) -> PromptSample:
        data_source, reward_source, ground_truth, extra_info, messages, source_file, row, images = self._meta[index]
        ids = self._ids[self._offsets[index] : self._offsets[index + 1]].tolist()
        return PromptSample(ids, data_source, reward_source, ground_truth, extra_info, messages, source_file, row,
                            images)

    def multi_modal_inputs(self, index: int) -> dict[str, Any]:
        """The ``pixel_values`` and ``image_grid_thw`` of prompt ``index``'s images ({} without images), as the
        processor made them when it tokenised the prompt (verl's ``multi_modal_inputs``), and with the dataset's
        ``prompt_positions`` the prompt's 3-D positions (``PROMPT_POSITIONS``)."""
        sample = self[index]
        if not sample.images:
            return {}
        from meshrl.data import vision
        from meshrl.data.mrope_positions import PROMPT_POSITIONS

        inputs = vision.image_inputs(self.processor, sample.images)
        if self.prompt_positions is not None:
            inputs[PROMPT_POSITIONS] = self.prompt_positions(torch.as_tensor(sample.prompt_ids),
                                                             inputs["image_grid_thw"])
        return inputs

    def get_batch(self, indices: Sequence[int]) -> PromptBatch:
        """The prompts at ``indices`` (e.g. one step of :class:`meshrl.data.sampler.PromptSampler`)."""
        samples = [self[i] for i in indices]
        return PromptBatch(
            indices=list(indices),
            prompt_ids=[s.prompt_ids for s in samples],
            data_sources=[s.data_source for s in samples],
            reward_sources=[s.reward_source for s in samples],
            ground_truths=[s.ground_truth for s in samples],
            extra_infos=[s.extra_info for s in samples],
            messages=[s.messages for s in samples],
            images=[s.images for s in samples],
        )


def load_datasets(data: DictConfig, tokenizer: Any, tools: list[dict[str, Any]] | None = None,
                  processor: Any = None, prompt_positions: Any = None) -> tuple[RLDataset, RLDataset | None]:
    """The training and validation prompts of the ``data`` config section (no validation set without
    ``data.val_files``): each file list resolved (``meshrl.data.embedded``), templated with
    ``apply_chat_template_kwargs`` and, for a multi-turn rollout, its tools' OpenAI schemas (``tools``, which
    the template renders where the model expects them, as verl's agent loop does), and cut to
    ``train_max_samples`` / ``val_max_samples`` rows; with a vision-language model's ``processor`` rows' images
    are read (and ``prompt_positions``, its 3-D position rule, positions them)."""
    template_kwargs = OmegaConf.to_container(data.apply_chat_template_kwargs, resolve=True)
    if tools:
        template_kwargs["tools"] = tools
    common = dict(max_prompt_length=data.max_prompt_length, filter_overlong_prompts=data.filter_overlong_prompts,
                  truncation=data.truncation, prompt_key=data.prompt_key, chat_template_kwargs=template_kwargs,
                  reward_fn_key=data.reward_fn_key, media_keys=(data.image_key, data.video_key),
                  processor=processor, prompt_positions=prompt_positions, shuffle=data.shuffle, seed=data.seed)
    train = RLDataset(resolve_data_files(data.train_files), tokenizer, max_samples=data.train_max_samples, **common)
    if not data.val_files:
        return train, None
    return train, RLDataset(resolve_data_files(data.val_files), tokenizer, max_samples=data.val_max_samples, **common)
