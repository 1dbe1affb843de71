"""A checkpoint round trip through the engine's sharded save restores bit-identical
parameters and optimizer state."""

from __future__ import annotations

import os

import torch

from app.config import load_config
from app.config.loader import REPO_ROOT
from workers.trainer.batch import Sample
from workers.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from workers.trainer.engine import EngineTrainer
from workers.trainer.verl_batch import to_verl_batch

MODEL = str(REPO_ROOT / "var" / "models" / "tiny-qwen2")


def batch():
    samples = [Sample([1, 3, 4], [5, 6, 2], [-3.0, -3.1, -3.2], float(i % 2), f"g{i // 2}",
                      1.0, 0) for i in range(4)]
    return to_verl_batch(samples, 0)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_is_bit_identical(tmp_path):
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=null",
                             "trainer.device=cpu"])
    a = EngineTrainer(cfg, MODEL)
    a.update(batch())
    save_checkpoint(a, tmp_path, "run", 1, 3, {"step": "1"})
    b = EngineTrainer(cfg, MODEL)
    assert not same(a.full_weights(), b.full_weights())
    meta = load_checkpoint(b, latest_checkpoint(tmp_path, "run"))
    assert meta["step"] == 1 and meta["policy_version"] == 3
    assert same(a.full_weights(), b.full_weights())
    # the optimizer state came back too: the next update is identical on both
    a.update(batch(), 1)
    b.update(batch(), 1)
    assert same(a.full_weights(), b.full_weights())


def test_a_lora_adapter_round_trips_through_the_checkpoint(tmp_path):
    """With ``lora_rank`` the trainable state is the adapter (and its optimizer state): the
    checkpoint restores it, so the restored trainer scores and updates as the saved one."""
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=null",
                             "trainer.device=cpu", "actor_rollout_ref.model.lora_rank=8",
                             "actor_rollout_ref.actor.lr=5e-2"])
    ids = [1, 3, 4, 5, 6, 7, 8, 2]
    a = EngineTrainer(cfg, MODEL)
    start = a.probe_log_probs(ids)
    a.update(batch())
    trained = a.probe_log_probs(ids)
    assert trained != start  # the adapter moved the model
    save_checkpoint(a, tmp_path, "run", 1, 2, {"step": "1"})
    # the adapter alone, not the frozen base: fewer bytes than the base has weights (the
    # whole model, saved in fp32, was 4 bytes a weight)
    (saved,) = latest_checkpoint(tmp_path, "run").rglob("model_world_size_*_rank_0.pt")
    assert saved.stat().st_size < a.parameter_count()
    b = EngineTrainer(cfg, MODEL)
    assert b.probe_log_probs(ids) == start
    load_checkpoint(b, latest_checkpoint(tmp_path, "run"))
    assert b.probe_log_probs(ids) == trained
    a.update(batch(), 1)
    b.update(batch(), 1)
    assert a.probe_log_probs(ids) == b.probe_log_probs(ids)


def test_a_save_leaves_nothing_in_the_temp_directory(tmp_path, monkeypatch):
    """verl makes each checkpoint directory under a lock file in the temp directory, named
    by the path, and never removes it: one file per checkpoint and rank, for good."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    cfg = load_config(None, ["trainer.device=cpu"])
    trainer = EngineTrainer(cfg, MODEL)
    for step in (1, 2):
        save_checkpoint(trainer, tmp_path / "ckpt", "run", step, step, {"step": str(step)})
    assert latest_checkpoint(tmp_path / "ckpt", "run").name == "step_000002"
    assert sorted(p.name for p in scratch.iterdir() if p.name.startswith("ckpt_")) == []


def test_a_failed_save_leaves_no_partial_checkpoint_behind(tmp_path):
    """A save that fails half-way (a full disk) removes its temporary directory (a partial
    checkpoint holds gigabytes, and would keep the disk full), and the next save removes
    any a dead process of this host left, but not a live one's save in progress."""
    import socket
    import subprocess

    cfg = load_config(None, ["trainer.device=cpu"])
    trainer = EngineTrainer(cfg, MODEL)
    run_dir = tmp_path / "ckpt" / "run"
    run_dir.mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    (run_dir / f".step_000001.{host}.{gone.pid}.aa.tmp").mkdir()  # a crashed process's
    real_save = trainer.save

    def full_disk(path):
        path.mkdir(parents=True)
        (path / "shard").write_bytes(b"x" * 1024)
        raise OSError(28, "No space left on device")

    trainer.save = full_disk
    try:
        save_checkpoint(trainer, tmp_path / "ckpt", "run", 2, 2, {})
    except OSError as exc:
        assert exc.errno == 28
    else:
        raise AssertionError("the save did not fail")
    assert sorted(p.name for p in run_dir.iterdir()) == []
    trainer.save = real_save
    live = run_dir / f".step_000004.{host}.{os.getpid()}.bb.tmp"  # another save, under way
    live.mkdir()
    save_checkpoint(trainer, tmp_path / "ckpt", "run", 3, 3, {})
    assert sorted(p.name for p in run_dir.iterdir()) == [live.name, "step_000003"]


def test_a_checkpoint_that_cannot_be_loaded_gives_way_to_the_one_before(tmp_path):
    """A newest checkpoint torn by a power loss (its files empty) is set aside and the run
    goes on from the one before, instead of failing every resume until a person steps in."""
    from workers.trainer.resident import close_resident, resident_trainer
    from workers.trainer.settings import TrainerSettings

    cfg = load_config(None, ["trainer.device=cpu", "actor_rollout_ref.actor.lr=1e-2",
                             f"trainer.checkpoint_dir={tmp_path / 'ckpt'}"])
    a = EngineTrainer(cfg, MODEL)
    a.update(batch())
    save_checkpoint(a, tmp_path / "ckpt", "run", 1, 1, {})
    after_one = a.full_weights()
    a.update(batch(), 1)
    save_checkpoint(a, tmp_path / "ckpt", "run", 2, 2, {})
    (tmp_path / "ckpt" / "run" / "step_000002" / "rng.pt").write_bytes(b"")
    try:
        resident = resident_trainer("run", cfg, TrainerSettings.from_config(cfg))
        assert resident.restored_step == 1 and resident.steps_done == 1
        assert same(resident.trainer.full_weights(), after_one)
    finally:
        close_resident()
    names = sorted(p.name for p in (tmp_path / "ckpt" / "run").iterdir())
    assert names[0].startswith("step_000001") and names[1].startswith("unreadable-step_000002")


def test_a_checkpoint_that_fails_to_load_for_now_is_kept(tmp_path, monkeypatch):
    """Only a torn checkpoint gives way: a load that fails for another reason (memory, a
    rank lost, a file system away) fails the task, which a retry may get past, and the
    checkpoint stays where it is."""
    from workers.trainer import checkpoint as ckpt
    from workers.trainer.resident import close_resident, resident_trainer
    from workers.trainer.settings import TrainerSettings

    cfg = load_config(None, ["trainer.device=cpu", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}"])
    save_checkpoint(EngineTrainer(cfg, MODEL), tmp_path / "ckpt", "run", 1, 1, {})

    def busy(trainer, path):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(ckpt, "load_checkpoint", busy)
    try:
        resident_trainer("run", cfg, TrainerSettings.from_config(cfg))
    except RuntimeError as exc:
        assert "out of memory" in str(exc)
    else:
        raise AssertionError("the load did not fail")
    finally:
        close_resident()
    assert [p.name for p in (tmp_path / "ckpt" / "run").iterdir()] == ["step_000001"]
