"""What every controller backend shares: the endpoint an agent gets, the error an attempt
fails with, the reward it must return and the clock that stops while the gateway is paused.

The backends (``controller.py``: python and process; ``kubernetes.py``) import this module
and never each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.state.records import checked_reward

# Linux refuses one environment string over 128 KiB (MAX_ARG_STRLEN): a process agent gets a
# larger sample on stdin only, and a Kubernetes Job cannot carry one.
SAMPLE_ENV_MAX_BYTES = 100_000


def fits_environment(text: str) -> bool:
    """Whether ``text`` may go in one environment variable (``SAMPLE_ENV_MAX_BYTES``)."""
    return len(text.encode()) <= SAMPLE_ENV_MAX_BYTES


class AgentError(Exception):
    """An attempt failed: the agent raised, exited non-zero, timed out or gave no reward."""

    def __init__(self, message: str, stderr_tail: str = "") -> None:
        super().__init__(message)
        self.stderr_tail = stderr_tail


@dataclass(frozen=True)
class LLMEndpoint:
    base_url: str    # <gateway>/rollout/<rollout_id>/v1
    api_key: str = field(repr=False)  # the rollout's token: never in a log or an error
    model: str
    rollout_id: str
    max_wait_s: float = 900.0  # keep retrying a paused gateway this long (retry_max_wait_s)

    def env(self) -> dict[str, str]:
        reward_url = self.base_url.removesuffix("/v1") + "/reward"
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key,
                "OPENAI_MODEL": self.model, "CARRYOVER_ROLLOUT_ID": self.rollout_id,
                "CARRYOVER_REWARD_URL": reward_url,
                "CARRYOVER_MAX_WAIT_S": str(self.max_wait_s)}


def parse_reward(value: object) -> float:
    """A finite float of sane size, or AgentError naming what came back."""
    if isinstance(value, dict) and "reward" in value:
        value = value["reward"]
    try:
        return checked_reward(value)
    except ValueError as exc:
        raise AgentError(f"agent returned {exc}") from None


class PauseAwareClock:
    """Elapsed time that stops while the gateway is paused."""

    def __init__(self, is_paused: Callable[[], bool]) -> None:
        self.is_paused = is_paused
        self.active = 0.0
        self.paused = 0.0
        self._last = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        dt, self._last = now - self._last, now
        try:
            paused = self.is_paused()
        except Exception:  # noqa: BLE001 - Redis blip: count the time
            paused = False
        if paused:
            self.paused += dt
        else:
            self.active += dt

    def skip(self) -> None:
        """Leave the time since the last tick uncounted (a wait that is not the agent's,
        such as its turn to be created)."""
        self._last = time.monotonic()


def stop_reason(clock: PauseAwareClock, timeout_s: float, cancelled: Callable[[], bool]
                ) -> str | None:
    """Advance the clock; why the attempt must stop now (timeout, cancel), or None."""
    clock.tick()
    if clock.active > timeout_s:
        return f"agent timed out after {timeout_s:.0f}s (controller.rollout_timeout_s)"
    if cancelled():
        return "rollout cancelled"
    return None


class Controller:
    def adopt(self) -> str | None:
        """The rollout id of this sibling's agent that is still running from an earlier
        delivery of its task (so it is watched, not started twice); None to start fresh."""
        return None

    def stop(self, rollout_id: str) -> None:
        """Stop an adopted agent that will not be watched (its group was cancelled)."""

    def run(self, sample: dict[str, object], llm: LLMEndpoint, timeout_s: float,
            clock: PauseAwareClock, cancelled: Callable[[], bool],
            posted_reward: Callable[[], object] = lambda: None, adopted: bool = False) -> float:
        """``posted_reward`` reads a reward the agent POSTed to the gateway (or None);
        ``adopted``: the agent of ``llm.rollout_id`` is already running (see :meth:`adopt`)."""
        raise NotImplementedError
