"""Checkpoints written in the background: one at a time, waited for before the engine is
used again, a failed write reported with its step."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from workers.trainer import checkpoint
from workers.trainer.checkpoint import BackgroundSaves, CheckpointError


def test_wait_blocks_until_the_write_is_done():
    saves = BackgroundSaves()
    release = threading.Event()
    done = []

    def write() -> None:
        release.wait(5)
        time.sleep(0.2)  # the write itself: at least this long, however late it started
        done.append(True)

    saves.start(3, write)
    assert saves.pending and not done
    threading.Timer(0.2, release.set).start()
    waited = saves.wait()
    assert done == [True] and not saves.pending  # it returned after the write, not before
    # how long wait() itself waited depends on when this thread got there
    assert waited > 0 and saves.last_write_s >= 0.2
    assert saves.wait() == 0.0  # nothing pending


def test_a_second_write_starts_after_the_first_ends():
    saves = BackgroundSaves()
    order: list[str] = []

    def slow() -> None:
        time.sleep(0.2)
        order.append("first")

    saves.start(1, slow)
    saves.start(2, lambda: order.append("second"))
    saves.wait()
    assert order == ["first", "second"]


def test_a_write_that_fails_twice_is_raised_with_its_step():
    saves = BackgroundSaves()
    tries = []

    def broken() -> None:
        tries.append(1)
        raise OSError("No space left on device")

    saves.start(7, broken)
    with pytest.raises(CheckpointError, match=r"after step 7.*OSError: No space left"):
        saves.wait()
    assert not saves.pending and len(tries) == 2


def test_a_write_that_failed_once_is_made_again_while_the_engine_holds_its_state():
    """A transient failure (a network file system's blip) cost the checkpoint: the step
    after failed, and unless the resumed run found this worker's trainer kept, the run went
    back to an older checkpoint."""
    saves = BackgroundSaves()
    tries = []

    def flaky() -> None:
        tries.append(1)
        if len(tries) == 1:
            raise OSError("Stale file handle")

    saves.start(7, flaky)
    saves.wait()
    assert len(tries) == 2 and not saves.pending


class _Engine:
    def save(self, path):
        path.mkdir(parents=True)


def test_the_rng_recorded_is_the_one_taken_before_the_write(tmp_path):
    torch.manual_seed(0)
    before = checkpoint.rng_state()
    torch.rand(10)  # the generator moves on while the checkpoint is written
    out = checkpoint.save_checkpoint(_Engine(), tmp_path, "run", 1, 5, {}, rng=before)
    saved = torch.load(out / "rng.pt", weights_only=False)
    assert torch.equal(saved["torch"], before["torch"])
    assert not torch.equal(saved["torch"], torch.get_rng_state())
