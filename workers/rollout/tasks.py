"""Rollout tasks. Thin: decode ids, call a plain function, return a small record.

``run_rollout`` is a chord sibling (queue ``rollout``); ``finish_group`` is the chord body
(queue ``groups``). Both are idempotent, which ``task_acks_late`` requires.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery.signals import task_received, worker_ready, worker_shutdown

from app.celery_app import celery_app, task_redis

if TYPE_CHECKING:
    from celery.worker.request import Request


@celery_app.task(name="workers.rollout.tasks.run_rollout")
def run_rollout(group_id: str, index: int) -> dict[str, object]:
    from dataclasses import asdict

    from workers.rollout.episode import run_sibling

    return asdict(run_sibling(task_redis(), group_id, index))


@celery_app.task(name="workers.rollout.tasks.finish_group")
def finish_group(results: list[dict[str, object]], group_id: str) -> str:
    from app.state.completion import finish_group as finish

    # ``results`` (what the siblings returned) is not trusted: Redis holds the truth.
    return finish(task_redis(), group_id)


# --- liveness: a dead worker's deliveries are requeued by its peers (workers.rollout.reaper)

@worker_ready.connect
def _start_reaper(sender: object = None, **_: object) -> None:
    if not {"rollout", "groups"} & set(celery_app.amqp.queues.consume_from or {}):
        return  # the trainer worker: acknowledges on receipt, re-sent by the driver
    from app.config import service_config
    from workers.rollout.reaper import start_reaper

    start_reaper(task_redis(), celery_app, float(service_config().services.worker_heartbeat_s))


@task_received.connect
def _record_delivery(sender: object = None, request: Request | None = None,
                     **_: object) -> None:
    from workers.rollout.reaper import running_reaper

    reaper = running_reaper()
    if reaper is not None and request is not None:
        reaper.received(request.message.delivery_tag, request.id)


@worker_shutdown.connect
def _stop_reaper(sender: object = None, **_: object) -> None:
    from workers.rollout.reaper import stop_reaper

    stop_reaper()
