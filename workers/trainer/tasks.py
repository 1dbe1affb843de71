"""Trainer tasks (queue ``trainer``, ``--pool solo``): one update per task, model resident.

Acknowledged on receipt, not late: a trainer task whose worker dies is re-sent by the driver
as soon as its heartbeat expires (``app.driver.trainer_call``), not redelivered by the broker
after the visibility timeout. The worker also runs the upstream keeper
(``workers.trainer.keeper``), which reloads the current weights into a restarted inference
server.
"""

from __future__ import annotations

from typing import Any

from celery.signals import worker_ready

from app.celery_app import celery_app, task_redis
from app.state.connection import outage_for
from app.state.policy import PublishedVersion

# The last policy version this worker published, put back if a Redis crash loses its bump
# (app/state/policy.py); watched from the worker's first update on.
_published = PublishedVersion()
_watching: list[bool] = []


def _watch_outages() -> None:
    if not _watching:
        _watching.append(True)
        outage_for(celery_app.conf.broker_url).listeners.append(
            lambda began, ended: _published.check_soon(task_redis()))


@celery_app.task(name="workers.trainer.tasks.train_step", acks_late=False)
def train_step(run_id: str, step: int) -> dict:
    from workers.trainer.service import train_step as run_step

    _watch_outages()
    metrics = run_step(task_redis(), run_id, step)
    if metrics.get("policy/version"):
        _published.published(int(metrics["policy/version"]))
        _published.check(task_redis())  # a bump lost while this step ran
    return metrics


@celery_app.task(name="workers.trainer.tasks.init_run", acks_late=False)
def init_run(run_id: str) -> dict:
    from workers.trainer.service import init_run as init

    return init(task_redis(), run_id)


@worker_ready.connect
def _start_upstream_keeper(sender: Any = None, **_: Any) -> None:
    if "trainer" not in (celery_app.amqp.queues.consume_from or {}):
        return  # a rollout or groups worker
    from app.config import service_config
    from workers.trainer.keeper import start_keeper

    cfg = service_config()
    start_keeper(task_redis(), list(cfg.inference.urls), cfg.inference.served_model_name,
                 float(cfg.trainer.probe_tolerance), float(cfg.trainer.upstream_check_s))
