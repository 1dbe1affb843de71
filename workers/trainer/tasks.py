"""Trainer tasks (queue ``trainer``, ``--pool solo``): one update per task, model resident."""

from __future__ import annotations

from functools import cache

from app.celery_app import celery_app
from app.state.connection import connect

_redis = cache(lambda: connect(celery_app.conf.broker_url))


@celery_app.task(name="workers.trainer.tasks.train_step")
def train_step(run_id: str, step: int) -> dict:
    from workers.trainer.service import train_step as run_step

    return run_step(_redis(), run_id, step)


@celery_app.task(name="workers.trainer.tasks.init_run")
def init_run(run_id: str) -> dict:
    from workers.trainer.service import init_run as init

    return init(_redis(), run_id)
