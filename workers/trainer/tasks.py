"""Trainer tasks (queue ``trainer``, ``--pool solo``): one update per task, model resident.

Acknowledged on receipt, not late: a trainer task whose worker dies is re-sent by the driver
as soon as its heartbeat expires (``app.driver.trainer_call``), not redelivered by the broker
after the visibility timeout. The worker also runs the upstream keeper
(``workers.trainer.keeper``), which reloads the current weights into a restarted inference
server.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from celery.signals import worker_init, worker_ready, worker_shutdown

from app.celery_app import celery_app, task_redis
from app.state.connection import outage_for
from app.state.policy import published_here

if TYPE_CHECKING:
    from workers.trainer.weight_sync.base import Metrics

log = logging.getLogger(__name__)

# Times a step whose gateway pause was lost is taken up again here, under a new pause: its
# lease could not be extended (Redis out of this host's reach for longer than
# trainer.heartbeat_s), which says nothing against the step, and failing the task fails the
# run. An update it already made is published, not made again (``once``, the redo path).
PAUSE_RETRIES = 2

# The last policy version this worker published is put back if a Redis crash loses its bump
# (app/state/policy.py); watched from the worker's first trainer task on.
_watching: list[bool] = []


def _watch_outages() -> None:
    if not _watching:
        _watching.append(True)
        outage_for(celery_app.conf.carryover_redis_url).listeners.append(
            lambda began, ended: published_here.check_soon(task_redis()))


@celery_app.task(name="workers.trainer.tasks.train_step", acks_late=False)
def train_step(run_id: str, step: int) -> Metrics:
    """One update, at most once (``workers.trainer.once``)."""
    from workers.trainer import once
    from workers.trainer.errors import PauseLost
    from workers.trainer.resident import resident_generation
    from workers.trainer.step import train_step as run_step

    _watch_outages()
    client = task_redis()
    done = once.remembered(client, run_id, int(step), resident_generation(run_id))
    if done is not None:
        return done
    for attempt in range(PAUSE_RETRIES + 1):
        try:
            metrics = run_step(client, run_id, step)
            break
        except PauseLost as exc:
            if attempt == PAUSE_RETRIES:
                raise
            log.warning("step %s of run %s: %s; taking it up again under a new pause", step,
                        run_id, exc)
    once.remember(run_id, int(step), metrics, resident_generation(run_id))
    return metrics


@celery_app.task(name="workers.trainer.tasks.init_run", acks_late=False)
def init_run(run_id: str) -> Metrics:
    from workers.trainer.resident import init_run as init

    _watch_outages()
    return init(task_redis(), run_id)


@celery_app.task(name="workers.trainer.tasks.restore_servers", acks_late=False)
def restore_servers(run_id: str) -> Metrics:
    from workers.trainer.resident import restore_servers as restore

    _watch_outages()
    return restore(task_redis(), run_id)


@worker_init.connect
def _refuse_without_shared_secret(sender: object = None, **_: object) -> None:
    """A trainer worker started by plain ``celery`` (the Procfile's line) is checked as
    ``carryover serve trainer`` is: before it takes a task, not at its first weight load,
    where servers on other hosts would refuse this machine's own key. A ``SystemExit`` is
    not caught by Celery's signal dispatch, so the worker stops with the one line."""
    if "trainer" not in (celery_app.amqp.queues.consume_from or {}):
        return
    from app.config import ConfigError, service_config
    from app.config.secrets import check_shared_secret

    try:
        check_shared_secret(service_config(), "trainer")
    except ConfigError as exc:
        sys.exit("\n".join(f"config error: {line}" for line in exc.problems))


@worker_ready.connect
def _start_upstream_keeper(sender: object = None, **_: object) -> None:
    if "trainer" not in (celery_app.amqp.queues.consume_from or {}):
        return  # a rollout or groups worker
    from app.config import service_config
    from app.config.secrets import inference_api_key
    from app.config.settings import InferenceSettings
    from workers.trainer import weights
    from workers.trainer.keeper import start_keeper

    cfg = service_config()
    weights.use_api_key(inference_api_key(cfg))
    keeper = start_keeper(task_redis(), list(cfg.inference.urls),
                          cfg.inference.served_model_name, float(cfg.trainer.probe_tolerance),
                          float(cfg.trainer.upstream_check_s))
    # until a run's first task configures it from the run's own config
    inf = InferenceSettings.from_config(cfg)
    keeper.configure(list(inf.urls), inf.served_model_name, float(cfg.trainer.probe_tolerance),
                     float(cfg.trainer.reload_timeout_s), inf.data_parallel_size,
                     inf.sleep_mode, float(cfg.trainer.upstream_check_s))


@worker_shutdown.connect
def _close_resident(sender: object = None, **_: object) -> None:
    """A worker that stops (warm shutdown) finishes its checkpoint write and frees what its
    run held, its exports in shared memory among them."""
    if "workers.trainer.resident" not in sys.modules:
        return  # a rollout or groups worker, or a trainer that never took a task
    from workers.trainer.resident import close_resident

    close_resident()
