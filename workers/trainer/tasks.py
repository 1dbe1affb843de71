"""Trainer tasks (queue ``trainer``, ``--pool solo``): one update per task, model resident."""

from __future__ import annotations

from app.celery_app import celery_app, task_redis


@celery_app.task(name="workers.trainer.tasks.train_step")
def train_step(run_id: str, step: int) -> dict:
    from workers.trainer.service import train_step as run_step

    return run_step(task_redis(), run_id, step)


@celery_app.task(name="workers.trainer.tasks.init_run")
def init_run(run_id: str) -> dict:
    from workers.trainer.service import init_run as init

    return init(task_redis(), run_id)
