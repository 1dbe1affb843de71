"""verl's Ray worker group as the engine's ranks: two CPU ranks under Ray take the same step
as one in-process rank (the path multi-GPU and multi-node updates take)."""

from __future__ import annotations

import pytest

from app.config import load_config
from app.config.loader import REPO_ROOT
from tests.unit.test_engine import max_diff, samples
from workers.trainer.engine import EngineTrainer, launcher
from workers.trainer.verl_batch import to_verl_batch

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

    local = EngineTrainer(load_config(None, BASE), MODEL)
    m1 = local.update(to_verl_batch(samples(), 0), 0)
    w1 = local.full_weights()
    try:
        on_ray = EngineTrainer(load_config(None, [*BASE, "trainer.launcher=ray",
                                                  "trainer.n_gpus_per_node=2"]), MODEL)
        assert on_ray.size == 2
        m2 = on_ray.update(to_verl_batch(samples(), 0), 0)
        w2 = on_ray.full_weights()
    finally:
        ray.shutdown()
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
    assert max_diff(w1, w2) < 1e-5
