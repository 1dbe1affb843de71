"""The one Celery app. Routing lives here, in configuration, never at call sites.

Queues: ``rollout`` (sibling agent runs), ``groups`` (chord callbacks: own queue so they
never wait behind long siblings), ``trainer`` (one update at a time, ``--pool solo``).
Workers find their Redis through ``$REDIS_URL`` or the config named by
``$CARRYOVER_CONFIG`` (default: the embedded server).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Container, Mapping
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, quote, urlsplit

from celery import Celery, signals

from app.config import service_config
from app.state.connection import resolve_redis_url

if TYPE_CHECKING:
    import redis


def retries_covering(budget_s: float, start: float, step: float, maximum: float) -> int:
    """How many retries kombu's growing intervals (``start``, ``start + step``, ... capped
    at ``maximum``) take to span ``budget_s`` seconds."""
    waited, retries = 0.0, 0
    while waited < budget_s:
        waited += max(min(start + step * retries, maximum), 0.01)
        retries += 1
    return retries


def celery_urls(url: str) -> tuple[str, str]:
    """(broker, result backend) for the Redis at ``url``. A unix socket (redis-py's
    ``unix:///path?db=N&password=P``) is ``socket://`` to Celery's Redis backend, and
    ``redis+socket://:P@/path?virtual_host=N`` to kombu, which reads neither query key."""
    if not url.startswith("unix://"):
        return url, url
    u = urlsplit(url)
    query = parse_qs(u.query)
    password = query.get("password", [u.password or ""])[0]
    auth = f":{quote(password, safe='')}@" if password else ""
    db = query.get("db", ["0"])[0]
    return (f"redis+socket://{auth}{u.path}?virtual_host={db}",
            "socket://" + url.removeprefix("unix://"))


def make_celery() -> Celery:
    cfg = service_config()
    url = resolve_redis_url(cfg)
    broker, backend = celery_urls(url)
    celery = Celery(
        "carryover",
        broker=broker,
        # the project's backend class: its connections ride out a restart (see the module)
        backend="app.result_backend:Backend+" + backend,
        include=["workers.rollout.tasks", "workers.trainer.tasks"],
    )
    celery.conf.update(**_messages(), **_delivery(),
                       **_reconnect(url, float(cfg.redis.reconnect_s)), **_transport())
    return celery


def _messages() -> dict[str, object]:
    return dict(
        # JSON only: nothing a worker receives can execute code when decoded.
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_routes={
            "workers.rollout.tasks.run_rollout": {"queue": "rollout"},
            "workers.rollout.tasks.finish_group": {"queue": "groups"},
            "workers.trainer.tasks.*": {"queue": "trainer"},
        },
        task_default_queue="rollout",
        result_expires=3600,
        worker_hijack_root_logger=False,
        # Flower's view (received/started/succeeded). No "sent" events: they were a third of
        # the driver's chord dispatch time (bench/overhead.py, py-spy).
        worker_send_task_events=True,
    )


def _delivery() -> dict[str, object]:
    return dict(
        # At-least-once delivery of agent runs: a task is acknowledged only when it
        # returns, and requeued when its worker process dies. Siblings and callbacks are
        # idempotent (see workers.rollout.tasks), so a rerun changes nothing downstream.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
    )


def _reconnect(url: str, budget: float) -> dict[str, object]:
    """A Redis restart (redis.reconnect_s): a worker's consumer reconnects with kombu's
    intervals (2 s growing by 2 s up to 30 s) for at least the budget; a publish (the
    driver's chords and trainer calls, a chord callback sent by the last sibling) is retried
    every second or less for as long; the result backend's connections use the clients' own
    retry (app/result_backend.py) and its retry policy."""
    every_quarter_second = {"max_retries": retries_covering(budget, 0.0, 0.25, 1.0),
                            "interval_start": 0.0, "interval_step": 0.25, "interval_max": 1.0}
    return dict(
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        broker_connection_max_retries=retries_covering(budget, 2.0, 2.0, 30.0),
        task_publish_retry=True,
        task_publish_retry_policy=dict(every_quarter_second),
        result_backend_transport_options={"retry_policy": dict(every_quarter_second)},
        redis_socket_keepalive=not url.startswith("unix://"),  # a TCP option
        carryover_reconnect_s=budget,
        carryover_redis_url=url,  # as the project's own clients spell it
    )


def _transport() -> dict[str, object]:
    return dict(
        # kombu's Redis transport, fixed so a worker survives a broker restart while it holds
        # unacknowledged messages (see app/broker_transport.py)
        broker_transport="app.broker_transport:Transport",
        broker_transport_options={
            # Agents may run for hours; redelivery of a live task on timeout would start a
            # second agent. Lost workers are found through acks_late + the restore scan.
            "visibility_timeout": int(os.environ.get("CARRYOVER_VISIBILITY_TIMEOUT", 43200)),
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        # redis-py's default pool of 100 raises when hundreds of rollout threads store
        # results at once; a failed store would turn a sibling into a chord error.
        redis_max_connections=2048,
        broker_pool_limit=64,
    )


celery_app = make_celery()


@signals.celeryd_init.connect
def rollout_slots(conf: object = None, options: Mapping[str, object] | None = None,
                  **_: object) -> None:
    """A rollout worker started without ``-c`` (the Procfile, ``carryover up``) runs
    ``services.rollout_concurrency`` slots, read from the config like everything else;
    an explicit ``-c`` still wins."""
    options = options or {}
    queues = options.get("queues") or []
    if isinstance(queues, str):
        queues = queues.split(",")
    if options.get("concurrency") is None and isinstance(queues, Container) \
            and "rollout" in queues:
        conf.worker_concurrency = service_config().services.rollout_concurrency  # type: ignore[attr-defined]


@functools.cache
def task_redis() -> redis.Redis:
    """The Redis client tasks use (the broker's server), one pool per worker process."""
    from app.state.connection import connect

    return connect(celery_app.conf.carryover_redis_url)

# Agents' HTTP clients log every request at INFO; a worker runs hundreds of them.
for _name in ("httpx", "openai", "urllib3"):
    logging.getLogger(_name).setLevel(logging.WARNING)
