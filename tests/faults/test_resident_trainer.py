"""The trainer a worker keeps between a run's steps: a retry of a step that failed after its
update publishes that update (any other step starts from the recorded weights), a run taken
up from its checkpoint reports the updates lost, and a restarted
driver's ``init_run`` keeps the weights of the steps trained since the last checkpoint,
unless another trainer worker trained past them. A step that fails after its export leaves
the published export in place, however few versions are kept, and a version bump a Redis
crash lost is put back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.config import load_config
from app.state import keys
from tests.conftest import free_port, standin_gateway
from tests.faults.test_engine_sleep import _prepared_run
from tests.unit.test_engine import max_diff
from workers.trainer import resident
from workers.trainer.settings import TrainerSettings
from workers.trainer.step import train_step


@pytest.fixture(scope="module")
def upstream(redis_service, tmp_root):
    with standin_gateway(tmp_root, "resident-tests") as (_, _, upstreams):
        yield upstreams[0][0]


def _cfg(url: str, tmp_path, *overrides: str):
    # the stand-in scores every probe token -1: a tolerance that admits it
    return load_config(None, [*json.loads(os.environ["CARRYOVER_OVERRIDES"]),
                              f"inference.urls=[{url}]", "trainer.device=cpu",
                              f"trainer.weights_dir={tmp_path / 'w'}",
                              f"trainer.checkpoint_dir={tmp_path / 'c'}",
                              "trainer.reload_timeout_s=2", "inference.startup_timeout_s=2",
                              "trainer.probe_tolerance=100", "trainer.total_steps=10",
                              "trainer.save_freq=10", "actor_rollout_ref.rollout.n=2",
                              *overrides])


def _weights() -> dict:
    assert resident._resident is not None
    return {k: v.clone() for k, v in resident._resident.trainer.full_weights().items()}


def test_a_retry_of_a_step_that_failed_after_its_update_publishes_that_update(
        upstream, redis_client, tmp_path, real_trainer):
    """The update ran and the load of its weights failed. The retry must neither train the
    step's groups again on top of it nor reload the last checkpoint (which loses every
    update since): it publishes the weights it has and records the step."""
    run_id = "retry-run"
    cfg = _cfg(f"http://127.0.0.1:{free_port()}", tmp_path)  # nobody listens: the load fails
    _prepared_run(redis_client, run_id, cfg)
    settings = TrainerSettings.from_config(cfg)
    first = resident.resident_trainer(run_id, cfg, settings)
    first.published = True  # the servers hold these weights: no first load of them
    before = _weights()
    with pytest.raises(Exception, match="Connection|connect|refused"):  # noqa: B017
        train_step(redis_client, run_id, 0)
    assert redis_client.get(keys.run_step_result(run_id, 0)) is None
    updated = _weights()
    assert max_diff(before, updated) > 0  # the update ran before the load failed
    update_metrics = dict(first.update_metrics)
    assert update_metrics
    # the server is back; the driver sends the step again
    redis_client.hset(keys.run(run_id), "config",
                      json.dumps(_cfg(upstream, tmp_path).to_dict()))
    m = train_step(redis_client, run_id, 0)
    assert resident._resident is first and max_diff(updated, _weights()) == 0
    assert redis_client.get(keys.run_step_result(run_id, 0)) is not None
    assert {k: m[k] for k in update_metrics} == update_metrics  # the update's own figures
    assert not first.unrecorded and first.steps_done == 1


def test_a_retry_of_another_step_starts_from_the_recorded_weights(redis_client, tmp_path,
                                                                  real_trainer):
    """An unrecorded update is published only by its own step: any other step gets the
    run's recorded weights, not those of an update no recorded step holds."""
    run_id = "other-run"
    cfg = _cfg(f"http://127.0.0.1:{free_port()}", tmp_path)
    _prepared_run(redis_client, run_id, cfg)
    settings = TrainerSettings.from_config(cfg)
    first = resident.resident_trainer(run_id, cfg, settings)
    first.published = True
    before = _weights()
    with pytest.raises(Exception, match="Connection|connect|refused"):  # noqa: B017
        train_step(redis_client, run_id, 0)
    again = resident.resident_trainer(run_id, cfg, settings, step=1)
    assert again is not first and not again.published
    assert max_diff(before, _weights()) == 0


def test_a_run_taken_up_from_its_checkpoint_reports_the_updates_lost(
        upstream, redis_client, tmp_path, real_trainer):
    """A resumed run whose trainer worker is new: the checkpoint (none yet here) lacks the
    run's 3 recorded updates; the driver is told, with the next step's metrics."""
    run_id = "lost-run"
    cfg = _cfg(upstream, tmp_path)
    _prepared_run(redis_client, run_id, cfg)
    redis_client.hset(keys.run(run_id), "step", 3)
    m = resident.init_run(redis_client, run_id)
    assert m["trainer/rolled_back_updates"] == 3 and m["trainer/restored_from_step"] is None
    assert resident._resident.rollback["trainer/rolled_back_updates"] == 3


def test_updates_recorded_past_the_drivers_count_are_reported_lost_too(
        upstream, redis_client, tmp_path, real_trainer):
    """A driver that died between step 3's record and its count's increment: the run holds 4
    updates, and a new trainer worker with no checkpoint reports all 4 lost (it compared
    with the driver's count, 3, and lost update 3 silently when the checkpoint was step 3's)."""
    run_id = "lost-run-uncounted"
    cfg = _cfg(upstream, tmp_path)
    _prepared_run(redis_client, run_id, cfg)
    redis_client.hset(keys.run(run_id), "step", 3)
    redis_client.set(keys.run_step_result(run_id, 3), json.dumps({"policy/version": 4}))
    m = resident.init_run(redis_client, run_id)
    assert m["trainer/rolled_back_updates"] == 4 and m["trainer/restored_from_step"] is None


def test_a_restarted_driver_keeps_the_updates_since_the_last_checkpoint(
        upstream, redis_client, tmp_path, real_trainer):
    run_id = "kept-run"
    cfg = _cfg(upstream, tmp_path)
    _prepared_run(redis_client, run_id, cfg)
    resident.init_run(redis_client, run_id)
    initial = _weights()
    train_step(redis_client, run_id, 0)
    trained, kept = _weights(), resident._resident
    assert max_diff(initial, trained) > 0
    # the driver restarts (--resume) and asks the same worker to take the run up again:
    # no checkpoint holds step 0's update, and it is not thrown away
    m = resident.init_run(redis_client, run_id)
    assert resident._resident is kept and max_diff(trained, _weights()) == 0
    assert m["policy/version"] > 0  # the servers were given the kept weights again
    # another trainer worker trained step 1 meanwhile: this one's weights are behind it,
    # so the run's are loaded (here no checkpoint yet: the initial weights)
    redis_client.set(keys.run_step_result(run_id, 1), json.dumps({}))
    resident.init_run(redis_client, run_id)
    assert resident._resident is not kept and max_diff(initial, _weights()) == 0


def test_a_checkpoint_past_the_runs_record_is_passed_over(upstream, redis_client, tmp_path,
                                                         real_trainer):
    """Step 0 was trained, recorded and checkpointed; then a Redis crash lost its record
    (the run's step counter still says 0) and the trainer worker restarted. Its checkpoint
    holds step 0's update: loaded, step 0 would be trained a second time on top of it. A
    checkpoint is passed over unless the run recorded every update it holds; one whose
    record is stored (the driver died before counting the step) is kept."""
    run_id = "past-run"
    cfg = _cfg(upstream, tmp_path, "trainer.save_freq=1")
    _prepared_run(redis_client, run_id, cfg)
    resident.init_run(redis_client, run_id)
    initial = _weights()
    train_step(redis_client, run_id, 0)
    trained = _weights()
    resident.close_resident()  # the worker restarts; its checkpoint write is finished
    assert (tmp_path / "c" / run_id / "step_000001" / "meta.json").exists()
    result = redis_client.get(keys.run_step_result(run_id, 0))
    # the driver died after the step's record, before counting it: the checkpoint is kept
    resident.init_run(redis_client, run_id)
    assert resident._resident.restored_step == 1 and max_diff(trained, _weights()) == 0
    resident.close_resident()
    # the crash lost the record: the run holds no update, nor may the trainer; the
    # checkpoint is set aside (else the pruning would delete the step's new one first, and
    # a later restart could load it)
    redis_client.delete(keys.run_step_result(run_id, 0))
    resident.init_run(redis_client, run_id)
    assert resident._resident.restored_step is None and max_diff(initial, _weights()) == 0
    names = [p.name for p in (tmp_path / "c" / run_id).iterdir()]
    assert "step_000001" not in names and any(n.startswith("passed_over-step_000001")
                                              for n in names)
    resident.close_resident()
    # the same for a step sent again to a new worker
    redis_client.delete(keys.group_trained(f"{run_id}-g0"))
    train_step(redis_client, run_id, 0)
    assert resident._resident.restored_step is None and result is not None


def test_a_failed_step_keeps_the_published_export(upstream, redis_client, tmp_path,
                                                  real_trainer):
    """With ``keep_weight_versions: 1`` the next export must not delete the published one
    before it is verified: the step below fails at the load, and the keeper still has the
    published weights to load into a server that restarts."""
    run_id = "keep-one"
    cfg = _cfg(upstream, tmp_path, "trainer.keep_weight_versions=1")
    _prepared_run(redis_client, run_id, cfg)
    resident.init_run(redis_client, run_id)
    published = Path(redis_client.hget(keys.policy_published(), "path"))
    assert published.is_dir()
    # the same run, its only server gone: the step exports, then cannot load
    _prepared_run(redis_client, run_id, _cfg(f"http://127.0.0.1:{free_port()}", tmp_path,
                                             "trainer.keep_weight_versions=1"))
    with pytest.raises(Exception, match="Connection|connect|refused"):  # noqa: B017
        train_step(redis_client, run_id, 0)
    assert redis_client.get(keys.run_step_result(run_id, 0)) is None
    assert (published.parent / "v000002").is_dir()   # the step did export
    assert Path(redis_client.hget(keys.policy_published(), "path")) == published
    assert (published / "model.safetensors").is_file()


def test_a_version_bump_lost_in_a_redis_crash_is_put_back(upstream, redis_client, tmp_path,
                                                          real_trainer):
    """The trainer worker remembers each version it makes the servers serve as soon as it
    bumps it, the start of a run's included: a Redis crash that loses the bump (and the step
    then fails storing its result) is repaired when Redis is back, instead of the next
    update reusing the number for other weights. So is the record of the last verified
    version, which the keeper loads into a server that restarts."""
    from app.state.policy import published_here

    run_id = "bump-run"
    cfg = _cfg(upstream, tmp_path)
    _prepared_run(redis_client, run_id, cfg)
    redis_client.set(keys.policy_version(), 5)   # the run's numbers went that far
    version = resident.init_run(redis_client, run_id)["policy/version"]
    assert version == 6
    redis_client.set(keys.policy_version(), version - 1)   # the crash lost the bump
    assert published_here.check(redis_client) == version - 1
    assert int(redis_client.get(keys.policy_version())) == version
    # and the verified record the keeper loads into a restarted server
    record = redis_client.hgetall(keys.policy_published())
    redis_client.delete(keys.policy_published())
    assert published_here.check(redis_client) is None   # the version was not lost this time
    assert redis_client.hgetall(keys.policy_published()) == record
    # a store emptied on purpose starts the numbers again: the old ones are not restored
    redis_client.delete(keys.policy_version())
    assert resident.init_run(redis_client, run_id)["policy/version"] == 1
    assert published_here.check(redis_client) is None
    assert int(redis_client.get(keys.policy_version())) == 1


def test_a_run_start_resumes_an_engine_a_dead_trainer_left_paused(upstream, redis_client,
                                                                  tmp_path, real_trainer):
    """A trainer killed between the engines' /pause and /resume leaves them paused; the
    re-sent step (or a driver's restart) loads the weights with no engine pause of its own
    (``drain_mode: wait``), and must resume that engine too: paused, it schedules nothing,
    so the probe would wait on it and the step would fail again at every retry."""
    import requests

    run_id = "left-paused"
    _prepared_run(redis_client, run_id, _cfg(upstream, tmp_path))
    requests.post(upstream + "/pause", params={"mode": "keep"}, timeout=5).raise_for_status()
    try:
        resident.init_run(redis_client, run_id)
        assert requests.get(upstream + "/is_paused", timeout=5).json()["is_paused"] is False
        assert not redis_client.sismember(keys.upstreams_stale(), upstream)
    finally:
        requests.post(upstream + "/resume", timeout=5)


def test_servers_the_keeper_cannot_restore_get_the_runs_weights_from_the_trainer_worker(
        upstream, redis_client, tmp_path, real_trainer):
    """The trainer's host reboots: its worker restarts with no trainer, the server with its
    initial weights, and the published export (in /dev/shm) is gone. The keeper cannot load
    them and says so; with every server stale no group finishes, so no step would come to
    reload them. The task the driver sends instead loads the run's last checkpoint (here
    none: the initial weights), serves it under a new version, and the next step reports
    the updates lost."""
    import shutil

    import requests

    from workers.trainer import weights
    from workers.trainer.keeper import UpstreamKeeper

    run_id = "rebooted"
    cfg = _cfg(upstream, tmp_path)
    settings = TrainerSettings.from_config(cfg)
    _prepared_run(redis_client, run_id, cfg)
    resident.init_run(redis_client, run_id)
    initial = _weights()
    train_step(redis_client, run_id, 0)
    published = redis_client.hgetall(keys.policy_published())
    trained_version = int(published["version"])
    assert weights.loaded_version(upstream) == str(trained_version)
    # the reboot (a warm stop of the worker frees an export in /dev/shm too)
    resident.close_resident()
    shutil.rmtree(published["path"], ignore_errors=True)
    assert not Path(published["path"]).exists()
    requests.post(upstream + "/update_weight_version", json={"new_version": "default"},
                  timeout=5).raise_for_status()
    keeper = UpstreamKeeper(redis_client, [upstream], cfg.inference.served_model_name,
                            settings.probe_tolerance)
    assert keeper.tick() == []
    assert redis_client.sismember(keys.upstreams_stale(), upstream)
    assert "is gone" in redis_client.get(keys.upstreams_need_weights())
    # the driver, waiting for step 1's groups, asks the trainer worker
    _prepared_run(redis_client, run_id, cfg, step=1)
    redis_client.hset(keys.run(run_id), "step", 1)   # the driver's count of updates done
    restored = resident.restore_servers(redis_client, run_id)
    assert restored["trainer/rolled_back_updates"] == 1
    assert restored["trainer/restored_from_step"] is None
    version = restored["trainer/restored_policy_version"]
    assert version > trained_version
    assert weights.loaded_version(upstream) == str(version)
    assert max_diff(initial, _weights()) == 0
    assert not redis_client.exists(keys.upstreams_need_weights())
    assert not redis_client.sismember(keys.upstreams_stale(), upstream)
    assert keeper.tick() == []   # nothing left to restore
    assert resident.restore_servers(redis_client, run_id) == {}   # nor to ask for
    # the next step trains on the restored weights and reports what was lost
    step = train_step(redis_client, run_id, 1)
    assert step["trainer/rolled_back_updates"] == 1
    assert step["policy/version"] == version + 1
    _prepared_run(redis_client, run_id, cfg, step=2)   # reported once
    assert "trainer/rolled_back_updates" not in train_step(redis_client, run_id, 2)


def test_a_final_checkpoint_that_failed_to_save_is_saved_when_the_run_is_taken_up(
        upstream, redis_client, tmp_path, real_trainer, monkeypatch):
    """The last step's update was recorded, then its checkpoint failed (a full disk): the
    step fails and the run stops. Resumed, the run has nothing left to train, so no step
    would ever save it again: the trainer that holds the update saves it when the run is
    taken up, before the run can finish without its final weights on disk."""
    from workers.trainer import checkpoint

    run_id = "final-save"
    cfg = _cfg(upstream, tmp_path, "trainer.total_steps=1")
    _prepared_run(redis_client, run_id, cfg)
    resident.init_run(redis_client, run_id)
    real_save = checkpoint.save_checkpoint

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_checkpoint", full_disk)
    with pytest.raises(OSError, match="No space"):
        train_step(redis_client, run_id, 0)
    assert redis_client.get(keys.run_step_result(run_id, 0)) is not None  # recorded
    trained = _weights()
    monkeypatch.setattr(checkpoint, "save_checkpoint", real_save)  # space freed
    redis_client.hset(keys.run(run_id), "step", 1)  # the driver counted the step
    resident.init_run(redis_client, run_id)
    latest = checkpoint.latest_checkpoint(tmp_path / "c", run_id)
    assert latest is not None and checkpoint.checkpoint_step(latest) == 1
    # it holds the update: a new trainer restored from it has the same weights
    resident.close_resident()
    resident.init_run(redis_client, run_id)
    assert resident._resident.restored_step == 1 and max_diff(trained, _weights()) == 0
    resident.close_resident()


def test_a_run_taken_up_while_its_checkpoint_is_written_waits_for_it(
        upstream, redis_client, tmp_path, real_trainer, monkeypatch):
    """A step's checkpoint is written in the background; the driver dies and a new one takes
    the run up on the same worker meanwhile. The engine must not be used while it is saved
    (the export, a second save of the same step): the write in progress is waited for, and
    the step is not saved twice."""
    import threading
    import time

    from workers.trainer import checkpoint

    run_id = "pending-save"
    cfg = _cfg(upstream, tmp_path, "trainer.save_freq=1", "trainer.checkpoint_in_background=true")
    _prepared_run(redis_client, run_id, cfg)
    resident.init_run(redis_client, run_id)
    real_save = checkpoint.save_checkpoint
    saving, saves = threading.Event(), []

    def slow_save(*args, **kwargs):
        saves.append(args[3])
        saving.set()
        time.sleep(2)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", slow_save)
    train_step(redis_client, run_id, 0)
    assert resident._resident.saves.pending and saving.wait(10)
    redis_client.hset(keys.run(run_id), "step", 1)
    resident.init_run(redis_client, run_id)  # the same worker: its trainer is kept
    assert saves == [1]  # written once, by the background save
    assert checkpoint.checkpoint_step(checkpoint.latest_checkpoint(tmp_path / "c", run_id)) == 1
    resident.close_resident()
