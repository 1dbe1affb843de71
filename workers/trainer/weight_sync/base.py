"""What every way of putting a version's weights into the inference servers provides.

A way has two sides. The step's (an instance, built from the run's settings): export the
version if it goes by a file, the loader that puts it into some servers, the name the
servers serve it under, the check of a loaded server beyond the probe, the fields of the
verified record (``keys.policy_published``). The upstream keeper's (class methods, from that
record alone: the keeper may hold no trainer and another run's config): load the published
version into one restarted server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from workers.trainer import weights
from workers.trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from workers.trainer.resident import Resident

Metrics = dict[str, object]


def add_count(metrics: Metrics, key: str, n: int) -> None:
    """``metrics[key] += n`` for a count (absent: 0)."""
    before = metrics.get(key, 0)
    metrics[key] = (before if isinstance(before, int) else 0) + n


class NeedsTrainer(weights.WeightSyncError):
    """The published weights cannot be loaded by the keeper: only a trainer can serve them."""


@dataclass
class LoadOutcome:
    """What one attempt to load a version into some servers did, per server."""

    loaded: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # refused the connection
    failed: dict[str, str] = field(default_factory=dict)       # may hold part of the version


# loads a version into the servers given; retried by the publish on those not loaded
Loader = Callable[[list[str]], LoadOutcome]
# the keeper's load of one restarted server by the trainer it holds: (url, version,
# frozen_calls)
Sender = Callable[[str, int, bool], None]


def dtype_name(settings: TrainerSettings) -> str:
    """The servers' dtype as torch names it (bfloat16, float32)."""
    return str(weights.engine_dtype(settings.inference.dtype, settings.model_path)
               ).removeprefix("torch.")


class WeightSync:
    name: ClassVar[str]
    timing: ClassVar[str]   # the load's timing: ``timing/trainer_<timing>_seconds``

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings

    # --- the step's side

    def prepare(self, resident: Resident, version: int, frozen_calls: bool,
                metrics: Metrics, timings: dict[str, float], published: str | None,
                fresh_base: bool = False) -> tuple[Path | None, Loader]:
        """``version``'s export (None: it goes without one) and the loader of it.
        ``published``: the export the servers hold now (kept until this one is verified);
        ``fresh_base``: a run's start, where a previous run may have left other weights."""
        raise NotImplementedError

    def served_name(self, version: int) -> str:
        """The model name the servers serve ``version`` under (what the probe asks)."""
        return self.settings.inference.served_model_name

    def check_loaded(self, url: str, resident: Resident, moved: bool,
                     metrics: Metrics) -> None:
        """A check of ``url``'s load beyond the probe (``moved``: the probe says the
        weights changed since the last version)."""

    def record(self, path: Path | None, version: int) -> dict[str, str]:
        """The ``path`` and ``adapter`` fields of the verified record, which tell the
        keeper's side which way published it (``weight_sync_of``)."""
        raise NotImplementedError

    def verified(self, path: Path | None) -> None:
        """``path``'s version was proved by the probe."""

    def sender(self, resident: Resident) -> Sender | None:
        """What the keeper loads a restarted server with while ``resident`` is this
        process's trainer, where the published record is not enough."""
        return None

    # --- the keeper's side

    @classmethod
    def reload(cls, url: str, published: Mapping[str, str], timeout: float,
               frozen_calls: bool, send: Sender | None) -> None:
        """Load the ``published`` version into the restarted server ``url``; raises
        ``NeedsTrainer`` where only a trainer can."""
        raise NotImplementedError

    @classmethod
    def served_in(cls, published: Mapping[str, str], model_name: str) -> str:
        """The model name the servers serve the ``published`` version under."""
        return model_name

    @classmethod
    def source(cls, published: Mapping[str, str]) -> str:
        """Where the ``published`` version came from, for the log."""
        return published["path"]
