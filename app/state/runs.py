"""Reading a run's state back from Redis (workers and ``--resume`` use this)."""

from __future__ import annotations

import functools

import redis

from app.config.schema import Config
from app.state import keys
from app.state.records import GroupRecord, RunRecord


class MissingState(LookupError):
    pass


def read_run(client: redis.Redis, run_id: str) -> RunRecord:
    data = client.hgetall(keys.run(run_id))
    if not data:
        raise MissingState(f"run {run_id!r} not found in Redis")
    return RunRecord.from_hash(data)


def read_group(client: redis.Redis, group_id: str) -> GroupRecord:
    data = client.hgetall(keys.group(group_id))
    if not data:
        raise MissingState(f"group {group_id!r} not found in Redis")
    return GroupRecord.from_hash(data)


@functools.lru_cache(maxsize=16)
def _config_from_json(raw: str) -> Config:
    import json

    from app.config import load_config

    return load_config(base=json.loads(raw))


def run_config(client: redis.Redis, run_id: str) -> Config:
    """The validated config the driver stored with the run (cached per process)."""
    raw = client.hget(keys.run(run_id), "config")
    if raw is None:
        raise MissingState(f"run {run_id!r} not found in Redis")
    return _config_from_json(raw)
