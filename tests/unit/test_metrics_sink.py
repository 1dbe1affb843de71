"""The run's metrics file and W&B: a line cut short by a crash is dropped when the run goes
on, and neither a full disk nor W&B's own errors stop training."""

from __future__ import annotations

import json

import pytest

from app.config import load_config
from app.driver.metrics import MetricsSink


@pytest.fixture
def sink(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    return lambda: MetricsSink(tmp_path / "run", "r1", load_config(None, []), console=False)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_line_cut_short_by_a_crash_is_dropped_when_the_run_goes_on(sink, tmp_path):
    first = sink()
    first.log(0, {"reward/mean": 0.5})
    with first.jsonl_path.open("a") as f:  # the driver killed in the middle of step 1's line
        f.write('{"step": 1, "reward/mean": 0.')
    resumed = sink()
    resumed.log(1, {"reward/mean": 0.75})
    assert lines(resumed.jsonl_path) == [{"step": 0, "reward/mean": 0.5},
                                         {"step": 1, "reward/mean": 0.75}]


class _FailingWandb:
    def __init__(self) -> None:
        self.logged = 0

    def log(self, row, step):
        self.logged += 1
        raise OSError(28, "No space left on device")

    def finish(self):
        raise RuntimeError("wandb service gone")


def test_w_and_b_failing_does_not_stop_training(sink, caplog):
    s = sink()
    s.wandb_run = _FailingWandb()
    failing = s.wandb_run
    s.log(0, {"reward/mean": 0.5})
    s.log(1, {"reward/mean": 0.6})  # W&B given up after its first failure
    assert failing.logged == 1 and s.wandb_run is None
    assert [r["step"] for r in lines(s.jsonl_path)] == [0, 1]
    s.wandb_run = _FailingWandb()
    s.close()  # a finish that fails does not hide how the run ended
    assert "W&B disabled for the rest of this run" in caplog.text


def test_a_metrics_file_that_cannot_be_written_does_not_stop_training(sink, caplog):
    s = sink()
    s.jsonl_path.mkdir()  # any OSError on the write: here, a directory in the way
    s.log(0, {"reward/mean": 0.5})
    assert "step 0's metrics not written" in caplog.text


def test_the_last_entry_kept_in_redis_is_written_once_at_resume(sink):
    """The driver died after keeping a step's metrics in Redis and before writing its line:
    the resumed run writes it; a line already there (non-finite values as null) is not
    written again."""
    first = sink()
    first.log(0, {"reward/mean": 0.5, "actor/grad_norm": float("nan")})
    kept_0 = json.dumps({"step": 0, "reward/mean": 0.5, "actor/grad_norm": float("nan")})
    kept_1 = json.dumps({"step": 1, "reward/mean": 0.75})
    assert not sink().catch_up(kept_0) and not sink().catch_up(None)
    resumed = sink()
    assert resumed.catch_up(kept_1)
    assert not sink().catch_up(kept_1)
    assert lines(resumed.jsonl_path) == [
        {"step": 0, "reward/mean": 0.5, "actor/grad_norm": None},
        {"step": 1, "reward/mean": 0.75}]


def test_an_entry_kept_again_after_a_later_line_is_not_written_twice(sink):
    """An outage's repair keeps a step's entry in Redis again, after an evaluation's line
    that the file already has after it: that step is not written a second time."""
    first = sink()
    first.log(3, {"reward/mean": 0.5})
    first.log(3, {"val/reward_mean": 0.25})
    resumed = sink()
    assert not resumed.catch_up(json.dumps({"step": 3, "reward/mean": 0.5}))
    assert len(lines(resumed.jsonl_path)) == 2


def test_an_offline_w_and_b_run_prints_no_advertisement(tmp_path):
    """W&B suggests its Weave product when it sees an LLM client imported (the driver imports
    openai through the agents): the demo's output must not carry it."""
    import subprocess
    import sys

    code = ("import openai\n"
            "from pathlib import Path\n"
            "from app.config import load_config\n"
            "from app.driver.metrics import MetricsSink\n"
            f"s = MetricsSink(Path({str(tmp_path)!r}) / 'run', 'r1', load_config(None, []))\n"
            "assert s.wandb_run is not None\n"
            "s.log(0, {'reward/mean': 0.5})\n"
            "s.close()\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith("WANDB_")} | {"WANDB_MODE": "offline"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Weave" not in out.stdout + out.stderr, out.stdout + out.stderr
