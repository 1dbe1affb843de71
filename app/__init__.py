"""carryover: asynchronous RL training for long-running LLM agents on Celery.

``celery -A app worker`` finds the Celery app here as ``app.celery``. It is created on first
access, not at import: the CLI first learns which config (and so which Redis) to use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery import Celery


def __getattr__(name: str) -> Celery:
    if name == "celery":
        from app.celery_app import celery_app

        return celery_app
    raise AttributeError(f"module 'app' has no attribute {name!r}")
