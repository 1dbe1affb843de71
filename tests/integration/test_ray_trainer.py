"""verl's Ray worker group as the engine's ranks: two CPU ranks under Ray take the same step
as one in-process rank (the path multi-GPU and multi-node updates take)."""

from __future__ import annotations

import pytest

from app.config import load_config
from app.config.loader import REPO_ROOT
from tests.unit.test_engine import assert_same_step, step_of
from workers.trainer.engine import EngineTrainer, launcher

pytestmark = pytest.mark.slow
MODEL = str(REPO_ROOT / "var" / "models" / "tiny-qwen2")
BASE = ["trainer.device=cpu", "actor_rollout_ref.actor.lr=1e-3"]


def test_launcher_choice():
    cuda = load_config(None, ["trainer.n_gpus_per_node=8"])
    assert launcher(cuda, "cuda") == "ray" and launcher(cuda, "cpu") == "local"
    assert launcher(load_config(None, []), "cuda") == "local"  # one GPU: in process
    assert launcher(load_config(None, ["trainer.launcher=ray"]), "cpu") == "ray"


def test_two_ray_ranks_take_the_same_step_as_one_local_rank():
    import ray

    local = step_of(EngineTrainer(load_config(None, BASE), MODEL))
    try:
        on_ray = EngineTrainer(load_config(None, [*BASE, "trainer.launcher=ray",
                                                  "trainer.n_gpus_per_node=2"]), MODEL)
        assert on_ray.size == 2
        assert_same_step(local, step_of(on_ray))
    finally:
        ray.shutdown()
