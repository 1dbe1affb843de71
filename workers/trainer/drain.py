"""How a step quiets model traffic before new weights are loaded: one strategy per
``gateway.drain_mode``, chosen once from config.

Each strategy runs with the gateway paused (no new call is admitted) and returns the
engines it holds paused (``weights.Held``: released after the version bump, or on any
failure as a context manager):

- ``wait``: wait for the calls in flight (bounded by ``gateway.drain_timeout_s``), cancel
  the rest; no engine is held.
- ``keep``: freeze the calls in flight inside the engines; they finish on the new weights,
  whose load drops the KV cache they hold so they recompute it.
- ``abort``: cancel the calls' leases (their agents get a retryable error, nothing of them
  is recorded) and end them in the engines.
- ``continue``: end the calls in the engines but keep their leases: the gateway keeps what
  each had generated and carries it on after the update (``gateway.continuation``). Works
  with engines that sleep, unlike ``keep``.

A new mode is a new class here and a name in ``DRAINS``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import ClassVar

from app.config.schema import DrainMode
from app.state.pause import Pause
from workers.trainer import weights
from workers.trainer.errors import StepError
from workers.trainer.settings import TrainerSettings


class DrainError(StepError):
    """Calls were still generating when the drain gave up: no weight may be loaded."""


class Drain:
    mode: ClassVar[DrainMode]

    def __init__(self, timeout_s: float, urls: Sequence[str]) -> None:
        self.timeout_s = timeout_s
        self.urls = list(urls)

    def quiet(self, pause: Pause, metrics: dict[str, object]) -> weights.Held:
        raise NotImplementedError


class WaitDrain(Drain):
    mode = "wait"

    def quiet(self, pause: Pause, metrics: dict[str, object]) -> weights.Held:
        drained = pause.drain(self.timeout_s)
        metrics["training/async/proxy_drain_seconds"] = drained.seconds
        metrics["training/async/proxy_cancelled_at_drain_timeout"] = drained.cancelled
        if drained.unended:
            raise DrainError(f"{drained.unended} request(s) cancelled at the drain timeout "
                             "were still generating after a lease TTL; not loading weights "
                             "under them")
        return weights.NOTHING_HELD


class _EngineDrain(Drain):
    """Pause generation inside the engines instead of waiting for the calls in flight."""

    engine_mode: ClassVar[weights.EnginePauseMode]

    def _hold(self, pause: Pause, metrics: dict[str, object], t: float, cancelled: list[str],
              frozen: int) -> weights.Held:
        try:
            held = weights.pause_engines(self.urls, self.engine_mode)
        except weights.EnginePauseError as exc:
            raise DrainError(str(exc)) from exc
        unended = pause.wait_ended(cancelled, pause.ttl_ms / 1000.0) if cancelled else 0
        metrics["training/async/proxy_drain_seconds"] = time.monotonic() - t
        metrics["training/async/proxy_frozen_calls"] = frozen
        metrics["training/async/proxy_aborted_calls"] = len(cancelled)
        if unended:
            held.release(check=False)
            raise DrainError(f"{unended} aborted request(s) were still live after a lease "
                             "TTL; not loading weights under them")
        return held


class KeepDrain(_EngineDrain):
    mode = "keep"
    engine_mode = "keep"

    def quiet(self, pause: Pause, metrics: dict[str, object]) -> weights.Held:
        return self._hold(pause, metrics, time.monotonic(), [], pause.live_leases())


class AbortDrain(_EngineDrain):
    mode = "abort"
    engine_mode = "abort"

    def quiet(self, pause: Pause, metrics: dict[str, object]) -> weights.Held:
        t = time.monotonic()
        return self._hold(pause, metrics, t, pause.cancel_live(), 0)


class ContinueDrain(_EngineDrain):
    mode = "continue"
    engine_mode = "abort"   # the engines end the calls; the gateway carries them on

    def quiet(self, pause: Pause, metrics: dict[str, object]) -> weights.Held:
        live = pause.live_leases()
        pause.carry_on_cut_calls()   # before the engines end the calls
        held = self._hold(pause, metrics, time.monotonic(), [], 0)
        metrics["training/async/proxy_continued_calls"] = live
        return held


DRAINS: dict[DrainMode, type[Drain]] = {
    d.mode: d for d in (WaitDrain, KeepDrain, AbortDrain, ContinueDrain)}


def drain_for(settings: TrainerSettings) -> Drain:
    return DRAINS[settings.drain_mode](settings.drain_timeout_s, settings.inference.urls)
