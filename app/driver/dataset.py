"""Prompts for the driver: a JSONL or Parquet file read once, visited in a seeded order per
epoch (one sample = one JSON object / one row)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from app.config.errors import ConfigError
from app.config.loader import REPO_ROOT
from app.config.schema import Config


class DatasetError(ConfigError):
    """A data file that cannot be used, named by its config key: a configuration error (the
    command line reports it as one), found before a run is recorded."""

    def __init__(self, problem: str) -> None:
        super().__init__([problem])


def load_samples(path: str, key: str = "data.train_files") -> list[dict[str, object]]:
    """The samples of ``path``; errors name the config ``key`` that gave it."""
    p = Path(path)
    if not p.is_absolute():
        p = REPO_ROOT / p
    if p.suffix == ".parquet":
        return _load_parquet(p, key)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{key}: cannot read {p} ({exc.strerror})") from None
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        at = raw.count(b"\n", 0, exc.start) + 1
        raise DatasetError(f"{key}: {p}:{at}: not UTF-8 text (byte {exc.start})") from None
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


def _load_parquet(p: Path, key: str) -> list[dict[str, object]]:
    import pyarrow.parquet as pq

    if not p.is_file():
        raise DatasetError(f"{key}: cannot read {p} (no such file)")
    try:
        rows = pq.read_table(p).to_pylist()
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{key}: cannot read {p} ({exc})") from None
    if not rows:
        raise DatasetError(f"{key}: {p} holds no samples")
    for no, row in enumerate(rows, 1):
        try:
            json.dumps(row)
        except (TypeError, ValueError):
            # a sample reaches the agent as JSON: a timestamp, bytes or decimal column would
            # fail after the run is recorded, without naming the file
            bad = next(col for col, value in row.items() if not _json_ok(value))
            raise DatasetError(
                f"{key}: {p}: row {no}, column {bad!r}: a {type(row[bad]).__name__} value "
                "cannot be sent to an agent as JSON (cast the column to string or a "
                "number)") from None
    return rows


def _json_ok(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def check_files(cfg: Config) -> list[dict[str, object]]:
    """Read the run's data files as its driver will (``data.train_files``, and
    ``data.val_files`` when set), so that a bad one stops a run before anything is recorded
    or started; the training samples are returned."""
    samples = load_samples(cfg.data.train_files)
    if cfg.data.val_files:
        load_samples(cfg.data.val_files, key="data.val_files")
    return samples


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 100_003 + epoch).shuffle(order)
    return order
