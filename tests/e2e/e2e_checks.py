"""Checks shared by the end-to-end tests (import as ``from e2e_checks import ...``: pytest puts this folder on
sys.path)."""

import math
from collections.abc import Iterable
from pathlib import Path

import pytest

from meshrl.trainer.tracking import METRICS_FILE, read_metrics


def non_finite(metrics: dict) -> dict:
    """The float metrics that are NaN or infinite (empty when all are finite)."""
    return {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}


def steps_of(run_dir: Path) -> dict[int, dict]:
    """A run folder's logged metrics by step (a step's several records merged)."""
    steps: dict[int, dict] = {}
    for record in read_metrics(Path(run_dir) / METRICS_FILE):
        steps.setdefault(record["step"], {}).update(record)
    return steps


def with_extended(names: Iterable[str], extended: set[str]) -> list:
    """``names`` as parametrize values, those in ``extended`` marked ``extended`` (``make test-extended``)."""
    return [pytest.param(name, marks=[pytest.mark.extended] if name in extended else []) for name in names]


def geo3k_data(folder: Path, dataset: str = "geo3k") -> Path:
    """verl's Geometry3K layout (``train.parquet``, ``test.parquet`` under ``folder/<dataset>``) written by ``meshrl
    preprocess <dataset>`` (``geo3k``, or ``geo3k_multiturn_w_tool`` for the tool scripts) from a local copy in the
    hub's layout, eight training and two test problems with images of several sizes."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from meshrl.data import preprocess

    def png(height: int, width: int, seed: int) -> bytes:
        buffer = io.BytesIO()
        pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, format="PNG")
        return buffer.getvalue()

    copy = folder / "geometry3k"
    (copy / "data").mkdir(parents=True)
    for split, count in (("train", 8), ("test", 2)):
        rows = [{"images": [{"bytes": png(40 + 14 * i, 60 + 9 * i, i), "path": f"{split}_{i}.png"}],
                 "problem": f"<image>Find x in triangle {i}.", "answer": str(3 + i)} for i in range(count)]
        pq.write_table(pa.Table.from_pylist(rows), copy / "data" / f"{split}-00000-of-00001.parquet")
    preprocess.preprocess(dataset, folder / dataset, local_dataset_path=copy, log=lambda _: None)
    return folder / dataset
