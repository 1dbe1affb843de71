"""The training driver's entry points (``carryover train``) and its loop: one
``Driver.run_step`` (``app/driver/step.py``: top up, wait, select, train, record) per
optimizer step, until ``trainer.total_steps``.

What a run needs before its first step is checked here, before anything of it is written:
a resumed run goes on with its stored config (the caller's file and overrides must agree
with it), the running gateway serves by the same config, the data and the agent pass the
preflight, and this process holds the run's lease (one driver per run). The driver never
touches token data; it moves group ids and asks the trainer worker (queue ``trainer``) for
each update.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypedDict

import redis

from app.config import ConfigError
from app.config.loader import flat_keys, repo_path
from app.config.schema import Config
from app.driver.collector import Collector, Starved
from app.driver.lease import DriverLease, RunBusy
from app.driver.metrics import Metrics
from app.driver.preflight import preflight
from app.driver.recovery import OutageWatch
from app.driver.step import Driver, EvalHook, StepHook, TrainingFailed
from app.state.connection import connect, redact, resolve_redis_url
from app.state.runs import MissingState, read_run, run_config

log = logging.getLogger(__name__)


class TrainResult(TypedDict):
    """What ``train`` returns: the run, its steps done and where its metrics went."""

    run_id: str
    steps: int
    run_dir: str
    jsonl: str
    wandb_dir: str | None  # None without W&B


def _require_gateway_agrees(cfg: Config) -> None:
    """Refuse a run whose config differs from the running gateway's on what the gateway
    serves by (``app/config/serving.py``): it would train on what it did not ask for."""
    from app.services.health import gateway_disagreements

    found = gateway_disagreements(cfg)
    refused, noted = found if found is not None else ([], [])
    for line in noted:
        log.warning("%s (the default of calls whose agent sets none)", line)
    if refused:
        raise ConfigError([*refused, "the gateway reads its own config, once, when the stack "
                           "starts: start the stack with this run's config (carryover up with "
                           "the same file and overrides), or give the run the stack's values"])


def _require_same_config(given: Config, stored: Config, run_id: str, keys: Iterable[str]) -> None:
    """Refuse to resume with a file or overrides (``keys``: what they set) that differ from
    the run's config: the run goes on with its own (its trainer and workers read the stored
    one), so a changed value would be ignored without a word. Keys left to their defaults
    are not compared: the run keeps the defaults it started with."""
    mine = flat_keys(given.to_dict(), into_free_form=True)
    theirs = flat_keys(stored.to_dict(), into_free_form=True)
    differ = [f"{key}: value {mine.get(key)!r} differs from run {run_id}'s {theirs.get(key)!r}"
              for key in sorted(keys) if mine.get(key) != theirs.get(key)]
    if differ:
        raise ConfigError([*differ, f"--resume {run_id} goes on with the config the run "
                           "started with: give the same file and overrides, or start a new "
                           "run"])


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def run_dir_for(cfg: Config, run_id: str) -> Path:
    return repo_path(str(cfg.logging.dir)) / run_id


def run_training(cfg: Config, resume: str | None = None, *, given: Iterable[str] = (),
                 on_step: StepHook | None = None, run_id: str | None = None) -> int:
    """Entry point of ``carryover train``; returns an exit code."""
    os.environ["CARRYOVER_ROLE"] = "driver"  # names the process in what it records
    try:
        result = train(cfg, resume=resume, on_step=on_step, run_id=run_id, given=given)
    except TrainingFailed as exc:
        log.error("%s", exc)
        return 1
    print(f"run {result['run_id']} finished: {result['steps']} steps; "
          f"metrics in {result['run_dir']}/metrics.jsonl")
    return 0


def train(cfg: Config, resume: str | None = None, *, given: Iterable[str] = (),
          on_step: StepHook | None = None,
          run_id: str | None = None,
          should_stop: Callable[[int, Metrics], bool] | None = None,
          on_eval: EvalHook | None = None) -> TrainResult:
    """Run (or resume) a run for ``trainer.total_steps``; ``should_stop(step, metrics)``,
    asked after each step, ends it early (a benchmark that reached its steady state).
    ``on_eval(step, metrics)`` gets each evaluation's ``val/*`` metrics (``data.val_files``),
    reported after ``step`` updates. Resumed, the run goes on with its stored config, and
    ``given`` (the keys the caller's file and overrides set) must agree with it."""
    from app.celery_app import celery_app

    url = resolve_redis_url(cfg)
    if celery_app.conf.carryover_redis_url != url:
        raise TrainingFailed("the Celery app was built for another Redis than the run's config "
                             "(set $CARRYOVER_CONFIG / $REDIS_URL before importing app.celery_app)")
    client = connect(url, reconnect_s=float(cfg.redis.reconnect_s))
    if resume:
        try:
            record = read_run(client, resume)
            stored = run_config(client, resume)  # the run keeps the config it started with
        except MissingState:
            raise TrainingFailed(f"--resume {resume}: no such run in the Redis at "
                                 f"{redact(url)} (a run id is printed when its run "
                                 "starts, and names its folder under logging.dir)") from None
        if record.status == "finished":
            # its final evaluations would run and be reported a second time
            raise TrainingFailed(f"run {resume} already finished ({record.step} steps); "
                                 "start a new run instead of resuming it")
        _require_same_config(cfg, stored, resume, given)
        cfg = stored
    _require_gateway_agrees(cfg)
    samples = preflight(cfg)  # a bad data file or agent stops the run before it is recorded
    # Each Redis outage the driver rides out is followed by a check of what it lost (see
    # app/driver/recovery.py): the last second of acknowledged writes may be gone.
    watch = OutageWatch(url)
    if resume:
        run_id = resume
    else:
        run_id = run_id or new_run_id()
        Collector.create_run(client, run_id, cfg.to_dict(),
                             "async" if cfg.agentlightning.async_rollout.enabled else "sync")
    lease = DriverLease(client, run_id)
    try:
        lease.acquire()
    except RunBusy as exc:
        watch.close()
        raise TrainingFailed(str(exc)) from None
    try:
        return _drive(client, cfg, run_id, resume, lease, watch, samples, on_step,
                      should_stop, on_eval)
    finally:
        lease.release()


def _drive(client: redis.Redis, cfg: Config, run_id: str, resume: str | None,
           lease: DriverLease, watch: OutageWatch, samples: list[dict[str, object]],
           on_step: StepHook | None, should_stop: Callable[[int, Metrics], bool] | None,
           on_eval: EvalHook | None) -> TrainResult:
    """The run, once this driver holds its lease: one ``Driver.run_step`` per update."""
    driver = Driver(client, cfg, run_id, lease, watch, samples, run_dir_for(cfg, run_id),
                    on_step=on_step, on_eval=on_eval)
    driver.begin(resume=bool(resume))
    try:
        while driver.step < driver.total:
            metrics = driver.run_step()
            if should_stop is not None and should_stop(driver.step - 1, metrics):
                break
        driver.finish()
    except Starved as exc:
        raise TrainingFailed(f"step {driver.step}: {exc}") from exc
    finally:
        driver.close()
    return {"run_id": run_id, "steps": driver.step, "run_dir": str(driver.run_dir),
            "jsonl": str(driver.sink.jsonl_path), "wandb_dir": driver.sink.wandb_dir}
