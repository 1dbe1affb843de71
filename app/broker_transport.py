"""kombu's Redis transport with one fix for a broker restart (Celery 5.7, kombu 5.7).

When the broker connection drops, Celery's consumer first collects the connection (which
detaches the transport from it) and then closes it. Closing the channel restores the worker's
unacknowledged messages, which needs a Redis client the detached transport can no longer
build; the ``AttributeError`` that follows is not a connection error, so the worker stops
("Unrecoverable error") instead of reconnecting. Here a detached transport raises the
connection error it is: the close ignores it, the consumer reconnects, and the messages stay
in Redis' unacked set, from which kombu restores them after the visibility timeout (or the
rollout reaper does at once if this worker dies: ``workers/rollout/reaper.py``).

Selected with ``broker_transport`` in ``app.celery_app``; everything else is kombu's.
"""

from __future__ import annotations

import redis
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> dict[str, object]:
        if self.connection is None or self.connection.client is None:
            raise redis.exceptions.ConnectionError(
                "the broker connection was already collected; unacknowledged messages stay "
                "in Redis until restored")
        return super()._connparams(asynchronous=asynchronous)


class Transport(kombu_redis.Transport):
    Channel = Channel
