"""Prompts for the driver: a JSONL or Parquet file read once, visited in a seeded order per
epoch (one sample = one JSON object / one row)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from app.config.loader import REPO_ROOT


class DatasetError(ValueError):
    pass


def load_samples(path: str, key: str = "data.train_files") -> list[dict]:
    """The samples of ``path``; errors name the config ``key`` that gave it."""
    p = Path(path)
    if not p.is_absolute():
        p = REPO_ROOT / p
    if p.suffix == ".parquet":
        return _load_parquet(p, key)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise DatasetError(f"{key}: cannot read {p} ({exc.strerror})") from None
    samples = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{key}: {p}:{no}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{key}: {p}:{no}: each line must be a JSON object")
        samples.append(obj)
    if not samples:
        raise DatasetError(f"{key}: {p} holds no samples")
    return samples


def _load_parquet(p: Path, key: str) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(p).to_pylist()
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{key}: cannot read {p} ({exc})") from None
    if not rows:
        raise DatasetError(f"{key}: {p} holds no samples")
    return rows


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 100_003 + epoch).shuffle(order)
    return order
