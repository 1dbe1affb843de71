"""Trainer checkpoints: the engine's sharded model and optimizer state (verl's FSDP
checkpoint manager, one shard per rank), the controller's RNG, step, policy version and a
snapshot of the run's state, so a resumed run continues from the same parameters.

Layout: ``<checkpoint_dir>/<run_id>/step_<k>/{engine/, rng.pt, meta.json}``; written to a
temporary directory and renamed, so a crash never leaves a half checkpoint that looks
complete (``meta.json`` is written last).

``BackgroundSaves`` writes one while the driver collects the next step's groups: the
parameters and optimizer state do not change until the next update, which waits for the
write first, so the checkpoint is the state after the step it names.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np
import torch

if TYPE_CHECKING:
    from workers.trainer.engine import EngineTrainer

log = logging.getLogger(__name__)


class RngState(TypedDict):
    """The generators' state a checkpoint records (``rng.pt``)."""

    torch: torch.Tensor
    # np.random.get_state(): the legacy tuple (numpy declares a dict as well)
    numpy: tuple[str, np.ndarray, int, int, float] | dict[str, object]
    python: tuple[object, ...]                      # random.getstate()


class CheckpointMeta(TypedDict):
    """A checkpoint's ``meta.json``."""

    run_id: str
    step: int
    policy_version: int
    run_state: dict[str, str]  # the run's Redis record (keys.run) when it was saved


def rng_state() -> RngState:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def save_checkpoint(trainer: EngineTrainer, root: Path, run_id: str, step: int, version: int,
                    run_state: dict[str, str], keep: int = 2, rng: RngState | None = None
                    ) -> Path:
    """``rng``: the generators' state to record (default: now)."""
    run_dir = root / run_id
    out = run_dir / f"step_{step:06d}"
    run_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(run_dir)
    # a name of its own: a second trainer process saving the same step cannot mix its
    # files into this one's, and the cleanup above knows whose it is
    tmp = run_dir / (f".step_{step:06d}.{socket.gethostname()}.{os.getpid()}."
                     f"{secrets.token_hex(3)}.tmp")
    tmp.mkdir()
    try:
        trainer.save(tmp / "engine")
        torch.save(rng if rng is not None else rng_state(), tmp / "rng.pt")
        meta: CheckpointMeta = {"run_id": run_id, "step": step, "policy_version": version,
                                "run_state": run_state}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        # on disk before the rename makes it the latest: after a power loss a renamed
        # checkpoint must not hold empty files
        _sync_tree(tmp)
        # a checkpoint of this step already there is an earlier save's (a step trained
        # again after its record was lost): this one holds the weights now
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        _sync(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(p for p in run_dir.iterdir() if p.name.startswith("step_"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return out


# an abandoned temporary checkpoint of another host (or of an unknown writer) is removed
# once it is this old; this host's are removed as soon as their process is gone
ABANDONED_AFTER_S = 24 * 3600


def _remove_abandoned(run_dir: Path) -> None:
    """Remove what failed saves left (a full disk, a crash): a partial checkpoint holds
    gigabytes. A live process's save in progress is left alone."""
    host = socket.gethostname()
    for tmp in run_dir.glob(".step_*.tmp"):
        parts = tmp.name.split(".")  # "", step_N, host..., pid, nonce, tmp
        mine = len(parts) >= 6 and ".".join(parts[2:-3]) == host and parts[-3].isdigit()
        try:
            if mine:
                os.kill(int(parts[-3]), 0)
                continue  # its writer still runs
            if time.time() - tmp.stat().st_mtime < ABANDONED_AFTER_S:
                continue
        except ProcessLookupError:
            pass
        except (PermissionError, FileNotFoundError):
            continue
        shutil.rmtree(tmp, ignore_errors=True)


def _sync(path: Path) -> None:
    """``path`` on disk. Where the filesystem cannot say (some FUSE mounts refuse fsync of a
    directory), it is taken as done."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EROFS):
            raise
    finally:
        os.close(fd)


def _sync_tree(root: Path) -> None:
    """Every file and directory under ``root`` on disk."""
    for here, _dirs, files in os.walk(root):
        for name in files:
            _sync(Path(here) / name)
        _sync(Path(here))


def checkpoint_step(path: Path) -> int:
    """The updates the checkpoint at ``path`` holds (its directory's name says)."""
    return int(path.name.removeprefix("step_"))


def complete_checkpoints(root: Path, run_id: str) -> list[Path]:
    """The run's complete checkpoints, newest first."""
    run_dir = root / run_id
    if not run_dir.is_dir():
        return []
    return sorted((p for p in run_dir.iterdir()
                   if p.name.startswith("step_") and (p / "meta.json").exists()), reverse=True)


def latest_checkpoint(root: Path, run_id: str) -> Path | None:
    done = complete_checkpoints(root, run_id)
    return done[0] if done else None


def is_torn(exc: BaseException) -> bool:
    """``exc``, raised loading a checkpoint, says its files are cut short or garbled (what
    a power loss during the save leaves), rather than that loading failed for now."""
    if isinstance(exc, (EOFError, pickle.UnpicklingError, json.JSONDecodeError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("PytorchStreamReader", "failed finding central directory",
                                  "invalid header or archive is corrupted"))


def set_aside(path: Path, why: str) -> Path:
    """Rename a checkpoint out of the way (``<why>-step_<k>-<time>``), kept for a person to
    look at: it is no longer loaded, nor pruned."""
    target = path.parent / f"{why}-{path.name}-{time.time_ns()}"
    path.rename(target)
    return target


def set_aside_after(root: Path, run_id: str, recorded: int) -> list[Path]:
    """Move the run's checkpoints holding more than ``recorded`` updates out of the way
    (renamed ``passed_over-step_<k>-<time>``, kept for a person to look at): they belong to
    steps whose record was lost, which will be trained again. Left in place, the pruning
    of older checkpoints would delete the new ones first, and a later restart could load
    one of them. -> where they went."""
    run_dir = root / run_id
    moved = []
    for path in sorted(run_dir.iterdir() if run_dir.is_dir() else []):
        if path.name.startswith("step_") and checkpoint_step(path) > recorded:
            moved.append(set_aside(path, "passed_over"))
    return moved


def load_checkpoint(trainer: EngineTrainer, path: Path) -> CheckpointMeta:
    trainer.load(path / "engine")
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return json.loads((path / "meta.json").read_text())


class CheckpointError(RuntimeError):
    pass


def _timed(write: Callable[[], object]) -> float:
    t = time.monotonic()
    write()
    return time.monotonic() - t


class BackgroundSaves:
    """At most one checkpoint write at a time, in a thread. ``wait`` before the engine is
    used again (an update, a load, closing it): it returns the seconds waited. A write that
    failed is made once more there, in the foreground, while the engine still holds what it
    was to save (a transient failure, a network file system's blip or a disk freed since,
    costs no checkpoint); ``CheckpointError`` if that fails too."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: tuple[int, Future[float], Callable[[], object]] | None = None
        self.last_write_s: float | None = None  # how long the last finished write took

    def start(self, step: int, write: Callable[[], object]) -> None:
        self.wait()
        self._pending = (step, self._pool.submit(_timed, write), write)

    def close(self) -> None:
        """Wait for the write in progress, then stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown()

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def wait(self) -> float:
        if self._pending is None:
            return 0.0
        step, future, write = self._pending
        self._pending = None
        t = time.monotonic()
        try:
            self.last_write_s = future.result()
        except Exception as first:
            log.warning("the checkpoint after step %d, written in the background, failed "
                        "(%s: %s); writing it again", step, first.__class__.__name__, first)
            try:
                self.last_write_s = _timed(write)
            except Exception as exc:
                raise CheckpointError(
                    f"the checkpoint after step {step} failed twice (in the background, "
                    f"then again): {exc.__class__.__name__}: {exc}") from exc
        return time.monotonic() - t
