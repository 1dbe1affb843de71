"""Prompts for the driver: a JSONL file read once, visited in a seeded order per epoch."""

from __future__ import annotations

import json
import random
from pathlib import Path

from app.config.loader import REPO_ROOT


class DatasetError(ValueError):
    pass


def load_samples(path: str) -> list[dict]:
    p = Path(path)
    if not p.is_absolute():
        p = REPO_ROOT / p
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise DatasetError(f"data.train_files: cannot read {p} ({exc.strerror})") from None
    samples = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"data.train_files: {p}:{no}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"data.train_files: {p}:{no}: each line must be a JSON object")
        samples.append(obj)
    if not samples:
        raise DatasetError(f"data.train_files: {p} holds no samples")
    return samples


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 100_003 + epoch).shuffle(order)
    return order
