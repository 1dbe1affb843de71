"""``bench.repeat_runs`` summarises finished runs: per run the demo's gain and minutes of
training, the held-out success after each evaluation, and the median and range over runs."""

from __future__ import annotations

import json

import pytest

from bench import repeat_runs


def _run(path, rewards: list[float], step_s: float, evals: dict[int, float]):
    path.parent.mkdir(parents=True)
    rows = [{"step": k, "val/success_rate": v, "val/sent_at_step": float(k)}
            for k, v in evals.items()]
    rows += [{"step": i, "reward/mean": r, "timing/step_seconds": step_s}
             for i, r in enumerate(rewards)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_median_and_range_over_runs(tmp_path, capsys):
    paths = [_run(tmp_path / f"r{i}" / "metrics.jsonl", [0.0, 0.1] + [0.2] * 3 + [g] * 5,
                  6.0 * (i + 1), {0: 0.2, 5: 0.2 + g}) for i, g in enumerate((0.5, 0.3, 0.9))]
    assert repeat_runs.main(["--metrics", *map(str, paths)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reward_gain"]["runs"] == pytest.approx([0.45, 0.25, 0.85])
    assert out["reward_gain"]["median"] == pytest.approx(0.45)
    assert out["reward_gain"]["min"] == pytest.approx(0.25)
    assert out["training_minutes"]["runs"] == pytest.approx([1.0, 2.0, 3.0])
    assert out["val_success"]["5"]["median"] == pytest.approx(0.7)
    assert out["minutes_before_eval"]["5"]["runs"] == pytest.approx([0.5, 1.0, 1.5])
    assert out["val_success"]["0"]["max"] == pytest.approx(0.2)
