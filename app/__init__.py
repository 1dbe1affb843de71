"""carryover: asynchronous RL training for long-running LLM agents on Celery.

``celery -A app worker`` finds the Celery app here as ``app.celery``.
"""

from app.celery_app import celery_app as celery

__all__ = ["celery"]
