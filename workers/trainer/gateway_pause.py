"""The trainer's hold of the gateway pause, under which it changes the servers' weights (a
step's update and publish, and a take-over's publish of the weights it restored).

Invariants: the gateway is resumed whatever happens after the pause (``finally``); the pause
is a lease the trainer keeps extending (``liveness.Beats``), so a SIGKILLed trainer leaves
the gateway paused for at most ``trainer.heartbeat_s``; no weight is touched once the pause
is no longer this trainer's (``require_pause``); the upstream keeper reloads no server while
it is held (``keeper.publish_lock``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from app.state.pause import Pause
from workers.trainer.errors import PauseLost
from workers.trainer.keeper import publish_lock
from workers.trainer.liveness import Beats
from workers.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)


@contextmanager
def paused(pause: Pause, settings: TrainerSettings, beats: Beats, timings: dict[str, float]
           ) -> Iterator[int]:
    """Pause the gateway as a lease kept alive by ``beats``; always resume. Yields the
    requests in flight at the pause; ``timings`` gets ``paused_for`` and ``resume`` on the
    way out. Holds the publish lock so the upstream keeper never reloads a server in
    between."""
    ttl = settings.heartbeat_s
    with publish_lock:
        inflight = pause.pause(pause_ttl_s=ttl)

        def extend() -> None:
            if not pause.extend_pause(ttl):
                log.error("the gateway pause could not be extended (it expired or was taken "
                          "over): this step will not touch the weights")

        beats.add("pause", extend)
        try:
            yield inflight
        finally:
            beats.remove("pause")
            t = time.monotonic()
            timings["paused_for"] = pause.resume()
            timings["resume"] = time.monotonic() - t


def require_pause(pause: Pause, what: str) -> None:
    """Abort the step, before ``what`` touches any weight, when the pause is no longer ours
    (its lease could not be extended, or it expired and another holder took it over):
    agents may be generating, and a reload under them trains on garbage."""
    if not pause.holds_pause():
        raise PauseLost(f"the gateway pause was lost before {what}; the step is aborted "
                        "with no weight changed (trainer.heartbeat_s may be too short for "
                        "this machine)")
