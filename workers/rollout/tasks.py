"""Rollout tasks. Thin: decode ids, call a plain function, return a small record.

``run_rollout`` is a chord sibling (queue ``rollout``); ``finish_group`` is the chord body
(queue ``groups``). Both are idempotent, which ``task_acks_late`` requires.
"""

from __future__ import annotations

from app.celery_app import celery_app, task_redis


@celery_app.task(name="workers.rollout.tasks.run_rollout")
def run_rollout(group_id: str, index: int) -> dict:
    from dataclasses import asdict

    from workers.rollout.episode import run_sibling

    return asdict(run_sibling(task_redis(), group_id, index))


@celery_app.task(name="workers.rollout.tasks.finish_group")
def finish_group(results: list, group_id: str) -> str:
    from workers.rollout.completion import finish_group as finish

    # ``results`` (what the siblings returned) is not trusted: Redis holds the truth.
    return finish(task_redis(), group_id)
