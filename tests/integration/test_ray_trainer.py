"""verl's Ray worker group as the engine's ranks: two CPU ranks under Ray take the same step
as one in-process rank (the path multi-GPU and multi-node updates take), and a worker's
second run gets the ranks the first one held."""

from __future__ import annotations

import pytest

from app.config import load_config
from app.config.loader import REPO_ROOT
from app.config.settings import launcher
from tests.unit.test_engine import assert_same_step, step_of
from workers.trainer import resident
from workers.trainer.engine import EngineTrainer
from workers.trainer.settings import TrainerSettings

pytestmark = pytest.mark.slow
MODEL = str(REPO_ROOT / "var" / "models" / "tiny-qwen2")
BASE = ["trainer.device=cpu", "actor_rollout_ref.actor.lr=1e-3"]


def test_launcher_choice():
    cuda = load_config(None, ["trainer.n_gpus_per_node=8"])
    assert launcher(cuda, "cuda") == "ray" and launcher(cuda, "cpu") == "local"
    assert launcher(load_config(None, []), "cuda") == "local"  # one GPU: in process
    assert launcher(load_config(None, ["trainer.launcher=ray"]), "cpu") == "ray"


@pytest.mark.timeout(600)  # the old ranks' placement group kept: the second run waits on
def test_two_runs_in_one_worker_on_two_ray_ranks_take_the_same_step_as_one_local_rank(
        tmp_path):
    """A trainer worker takes one run, then another: the first run's rank actors and their
    placement group are given back (Ray here has exactly the two CPUs the ranks reserve),
    and the second run's two ranks take the same step as one in-process rank."""
    import ray

    local = step_of(EngineTrainer(load_config(None, BASE), MODEL))
    cfg = load_config(None, [*BASE, "trainer.launcher=ray", "trainer.n_gpus_per_node=2",
                             f"trainer.checkpoint_dir={tmp_path}"])
    settings = TrainerSettings.from_config(cfg)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        first = resident.resident_trainer("ray-run-1", cfg, settings)
        assert first.trainer.size == 2
        second = resident.resident_trainer("ray-run-2", cfg, settings)  # closes the first
        assert second is not first and second.trainer.size == 2
        resident._resident = None
        assert_same_step(local, step_of(second.trainer))
    finally:
        if resident._resident is not None:
            resident._resident.close()
            resident._resident = None
        ray.shutdown()
