"""``inference.weight_sync: transfer`` against the real vLLM CPU server: the trainer's weights
go through vLLM's weight-transfer routes in shared-memory buckets, read by the engine the
project registers through vLLM's plugin entry point; the server then scores and checksums
exactly as after a reload of the same weights from disk. A server killed in the middle of a
transfer fails the load cleanly, and once it is back the upstream keeper sends it the
weights again."""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from app.config import load_config
from app.config.secrets import inference_api_key
from app.state import keys
from bench.stack import free_port, inference_server
from tests.conftest import REPO, SMOLLM2, SMOLLM2_NAME
from workers.trainer import publish, weights
from workers.trainer.batch import Sample
from workers.trainer.engine import EngineTrainer
from workers.trainer.keeper import UpstreamKeeper
from workers.trainer.resident import Resident
from workers.trainer.settings import TrainerSettings
from workers.trainer.transfer import ShmSender
from workers.trainer.verl_batch import to_verl_batch
from workers.trainer.weight_sync.transfer import send_again, transfer_loader

pytestmark = pytest.mark.slow



def update(trainer: EngineTrainer, steps: int) -> None:
    """``steps`` updates on a group whose rewards differ, sampled (as far as the old
    log-probs say) by the trainer's own weights, so PPO's ratio does not clip the step."""
    batch = [Sample([1, 3, 4, 5, 9, 10], [6 + i, 7, 8, 2], [0.0] * 4, float(i % 2), "g0",
                    1.0, 0, rollout_id=f"r{i}") for i in range(4)]
    for step in range(steps):
        own = trainer.log_probs(to_verl_batch(batch, trainer.pad_id))
        batch = [Sample(s.prompt_ids, s.response_ids, own[i, :4].tolist(), s.reward,
                        s.group_id, 1.0, 0, rollout_id=s.rollout_id)
                 for i, s in enumerate(batch)]
        trainer.update(to_verl_batch(batch, trainer.pad_id), step)


@pytest.fixture(scope="module")
def smol_trainer():
    # a large step: the update moves the bf16 probe and many bf16 tensors
    cfg = load_config("config/arith.yaml", ["trainer.device=cpu",
                                            "actor_rollout_ref.actor.lr=5e-4"])
    weights.use_api_key(inference_api_key(cfg))
    trainer = EngineTrainer(cfg, str(SMOLLM2))
    yield cfg, trainer
    trainer.close()


def test_a_transfer_loads_what_a_reload_from_disk_loads(smol_trainer, smollm2_server,
                                                        tmp_path):
    cfg, trainer = smol_trainer
    url = smollm2_server
    tol = float(cfg.trainer.probe_tolerance)
    ids = weights.probe_ids(SMOLLM2)
    # the server starts from the trainer's weights as they are (from disk)
    try:
        old = weights.publish_version(tmp_path, 1, 3,
                                      lambda d: trainer.export_weights(d, "bfloat16"))
        weights.reload_weights(url, old, version=1)
        before = trainer.probe_log_probs(ids)
        digests_before = weights.weight_checksums(url)
        update(trainer, 2)
        after = trainer.probe_log_probs(ids)
        assert weights.mean_gap(before, after) > tol

        bucket = 16 << 20
        sent = trainer.transfer_weights([url], "bfloat16", bucket, 120, inference_api_key(cfg))
        assert sent.loaded == [url] and not sent.failed and not sent.unreachable
        assert not glob.glob("/dev/shm/carryover-transfer-*")  # no bucket left behind
        weights.after_load(url, 60, version=2)
        # every tensor went (the tied head included), in buckets no larger than the setting
        # or the largest tensor (the 49,152 x 576 embeddings), several of them
        params = 134_515_008 + 49_152 * 576
        assert params * 2 <= sent.bytes_moved < params * 2 + 64 * 300
        assert sent.largest_bucket <= max(bucket, 49_152 * 576 * 2)
        assert sent.buckets >= sent.bytes_moved // max(bucket, 49_152 * 576 * 2)
        # the server holds the new weights: the probe (closer to the new than to the old) and
        # the checksums (changed, and the same on every replica) say so
        m = weights.verify_sync(url, SMOLLM2_NAME, after, before, tol, ids)
        assert m["weight_sync/probe_gap_to_previous"] > tol
        by_transfer = weights.weight_checksums(url)
        c = weights.check_checksums(url, by_transfer, digests_before, must_change=True)
        assert c["weight_sync/changed_tensors"] > 0
        probe_by_transfer = weights.engine_probe_logprobs(url, SMOLLM2_NAME, ids)

        # the same weights from disk: the same scores, the same digests
        new = weights.publish_version(tmp_path, 3, 3,
                                      lambda d: trainer.export_weights(d, "bfloat16"))
        weights.reload_weights(url, new, version=3)
        assert weights.mean_gap(weights.engine_probe_logprobs(url, SMOLLM2_NAME, ids),
                                probe_by_transfer) < 1e-6
        assert weights.weight_checksums(url) == by_transfer
    finally:
        weights.reload_weights(url, SMOLLM2)  # the shared server back on the model's weights


def test_a_server_killed_mid_transfer_fails_the_load_and_the_keeper_sends_it_again(
        redis_client, tmp_path):
    port = free_port()
    cfg = load_config(None, [
        "trainer.device=cpu", "actor_rollout_ref.actor.lr=1e-2", f"inference.port={port}",
        f"inference.urls=[http://127.0.0.1:{port}]", "inference.weight_sync=transfer",
        # not the session's model: the session trainer's keeper never acts on what this
        # test publishes
        "inference.served_model_name=transfer-test-model",
        # 2 KiB buckets: the tiny model goes in hundreds, so the kill lands in the middle
        "inference.transfer_bucket_mb=0.002"])
    weights.use_api_key(inference_api_key(cfg))
    settings = TrainerSettings.from_config(cfg)
    model = REPO / cfg.actor_rollout_ref.model.path
    trainer = EngineTrainer(cfg, str(model))
    resident = Resident("transfer-test", trainer, weights.probe_ids(model))
    ids = resident.probe_ids
    before = trainer.probe_log_probs(ids)
    update(trainer, 3)
    after = trainer.probe_log_probs(ids)
    assert weights.mean_gap(before, after) > settings.probe_tolerance
    try:
        with inference_server(cfg, tmp_path / "vllm-1.log") as (url, proc):
            killed = threading.Event()

            def kill_mid_transfer() -> None:
                # once the tenth bucket is out, the server dies
                pattern = f"/dev/shm/carryover-transfer-{os.getpid()}-*/bucket-*"
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    if any(int(p.rsplit("-", 1)[1]) >= 10 for p in glob.glob(pattern)):
                        os.killpg(proc.pid, signal.SIGKILL)
                        killed.set()
                        return
                    time.sleep(0.0005)

            watcher = threading.Thread(target=kill_mid_transfer)
            watcher.start()
            metrics: dict = {}
            with pytest.raises(weights.WeightSyncError, match="no inference server loaded"):
                publish.switch_weights(
                    redis_client, [url], None, 1, weights.NOTHING_HELD, 30, 0.5,
                    load=transfer_loader(resident, settings, 1, False, metrics))
            watcher.join()
            assert killed.is_set()
            # stale (the gateway routes around it), the version not bumped, no bucket left
            assert redis_client.sismember(keys.upstreams_stale(), url)
            assert redis_client.get(keys.policy_version()) is None
            assert not glob.glob(f"/dev/shm/carryover-transfer-{os.getpid()}-*")
            proc.wait(30)
            # while it is down, a step waits for it without gathering the model each time
            waited: dict = {}
            with pytest.raises(weights.WeightSyncError, match="could be reached"):
                publish.switch_weights(
                    redis_client, [url], None, 1, weights.NOTHING_HELD, 2, 0.5,
                    load=transfer_loader(resident, settings, 1, False, waited))
            assert "weight_sync/bytes_moved" not in waited
        # the weights were published by transfer (no export), and the server comes back
        resident.weights_version = 1
        redis_client.hset(keys.policy_published(), mapping={
            "version": 1, "path": "", "model": cfg.inference.served_model_name,
            "probe": json.dumps(after), "probe_ids": json.dumps(ids)})
        with inference_server(cfg, tmp_path / "vllm-2.log") as (url2, _):
            assert url2 == url and weights.loaded_version(url) == "default"
            keeper = UpstreamKeeper(redis_client, [url], cfg.inference.served_model_name,
                                    settings.probe_tolerance)
            # no trainer to send from: it stays stale, and asks the driver for the weights
            assert keeper.tick() == []
            assert redis_client.sismember(keys.upstreams_stale(), url)
            assert "no trainer in this process" in redis_client.get(
                keys.upstreams_need_weights())
            keeper.send_weights = lambda u, v, f: send_again(resident, settings, u, v, f)
            assert keeper.tick() == [url]
            assert not redis_client.sismember(keys.upstreams_stale(), url)
            assert weights.loaded_version(url) == "1"
            assert weights.verify_sync(url, cfg.inference.served_model_name, after, before,
                                       settings.probe_tolerance, ids)[
                "weight_sync/probe_gap"] < settings.probe_tolerance
            # an error on the trainer's side part-way: raised once the tensors are drained,
            # the server's session closed (the next sync starts one), no bucket left
            state = trainer.full_weights("float32")

            def breaks_after_five():
                for i, item in enumerate(state.items()):
                    if i == 5:
                        raise RuntimeError("gather failed")
                    yield item

            sender = ShmSender([url], 2048, 30, inference_api_key(cfg))
            with pytest.raises(RuntimeError, match="gather failed"):
                sender.send(breaks_after_five(), torch.float32)
            assert url in sender.result.failed
            assert not glob.glob(f"/dev/shm/carryover-transfer-{os.getpid()}-*")
            send_again(resident, settings, url, 1, False)
            assert weights.verify_sync(url, cfg.inference.served_model_name, after, None,
                                       settings.probe_tolerance, ids)[
                "weight_sync/probe_gap"] < settings.probe_tolerance
            # between an update and its publish the trainer's weights are no version: the
            # keeper does not send them (the step's own load reaches the server)
            # the server's engine reads from no folder but a transfer folder in /dev/shm
            auth = {"Authorization": f"Bearer {inference_api_key(cfg)}"}
            for folder in (tmp_path, Path("/dev/shm")):
                resp = requests.post(url + "/init_weight_transfer_engine", headers=auth,
                                     json={"init_info": {"directory": str(folder)}}, timeout=30)
                assert resp.status_code != 200, folder
            assert requests.get(url + "/health", timeout=5).status_code == 200
            resident.weights_version = None
            with pytest.raises(weights.WeightSyncError,
                               match="an update or a checkpoint is under way"):
                send_again(resident, settings, url, 1, False)
    finally:
        trainer.close()
        redis_client.delete(keys.policy_published(), keys.upstreams_stale())


def test_a_sync_after_one_the_server_failed_loads_what_it_sends(smollm2_server, tmp_path):
    """An update that raises inside vLLM (here a tensor the model has no parameter for)
    ends the server's session there; the trainer's close then meets no session. A layer
    the failed sync had begun stays part-loaded in vLLM's layer-wise reload, and the next
    sync must still load every tensor it sends into it."""
    from safetensors.torch import load_file

    cfg = load_config("config/arith.yaml", ["trainer.device=cpu"])
    key, url = inference_api_key(cfg), smollm2_server
    ids = weights.probe_ids(SMOLLM2)
    state = load_file(str(SMOLLM2 / "model.safetensors"))
    try:
        weights.reload_weights(url, SMOLLM2)
        base = weights.engine_probe_logprobs(url, SMOLLM2_NAME, ids)
        q = "model.layers.0.self_attn.q_proj.weight"
        broken = ShmSender([url], 1, 60, key)  # a bucket per tensor
        broken.send([(q, state[q] * 2), ("model.layers.0.no_such.weight", state[q])],
                    torch.bfloat16)
        assert list(broken.result.failed) == [url] and not broken.result.loaded
        sent = ShmSender([url], 16 << 20, 120, key).send(state.items(), torch.bfloat16)
        assert sent.loaded == [url], sent.failed
        weights.after_load(url, 60)
        # the model's own weights again: scored as after a reload of them from disk
        assert weights.mean_gap(weights.engine_probe_logprobs(url, SMOLLM2_NAME, ids),
                                base) < 1e-6
    finally:
        weights.reload_weights(url, SMOLLM2)  # the shared server back on the model's weights


def test_the_server_holds_no_bucket_past_its_update(smollm2_server):
    """vLLM's layer-wise reload keeps the tensors of a layer not yet complete: on a CPU
    server those were views into the bucket's mapping, so an unlinked bucket's pages stayed
    in /dev/shm until its layer was done, beside the buckets after it. With a bucket per
    tensor, no bucket sent before the last one is still mapped in the server."""
    from safetensors.torch import load_file

    cfg = load_config("config/arith.yaml", ["trainer.device=cpu"])
    state = load_file(str(SMOLLM2 / "model.safetensors"))
    mapped: list[int] = []

    def buckets_mapped() -> int:
        found = 0
        for maps in glob.glob("/proc/[0-9]*/maps"):
            try:
                text = Path(maps).read_text()
            except OSError:
                continue
            found += sum(f"carryover-transfer-{os.getpid()}-" in line and "(deleted)" in line
                         for line in text.splitlines())
        return found

    def watched():
        for i, item in enumerate(state.items()):
            if 2 <= i <= 12:  # layer 0's tensors, each in a bucket of its own
                mapped.append(buckets_mapped())
            yield item

    try:
        sent = ShmSender([smollm2_server], 1, 120, inference_api_key(cfg)).send(
            watched(), torch.bfloat16)
        assert sent.loaded == [smollm2_server], sent.failed
        assert mapped and max(mapped) == 0, mapped
    finally:
        weights.reload_weights(smollm2_server, SMOLLM2)


def test_a_reload_after_one_that_failed_loads_the_weights(smollm2_server, tmp_path):
    """A reload from disk that raises inside vLLM part-way (a tensor the model has no
    parameter for, after one it has) leaves nothing behind: the next reload serves the
    weights it reads."""
    from safetensors.torch import load_file, save_file

    ids = weights.probe_ids(SMOLLM2)
    state = load_file(str(SMOLLM2 / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({q: state[q] * 2, "model.layers.0.no_such.weight": state[q]},
              str(bad / "model.safetensors"))
    try:
        weights.reload_weights(smollm2_server, SMOLLM2)
        base = weights.engine_probe_logprobs(smollm2_server, SMOLLM2_NAME, ids)
        with pytest.raises(weights.WeightSyncError):
            weights.reload_weights(smollm2_server, bad)
        weights.reload_weights(smollm2_server, SMOLLM2)
        assert weights.mean_gap(weights.engine_probe_logprobs(
            smollm2_server, SMOLLM2_NAME, ids), base) < 1e-6
    finally:
        weights.reload_weights(smollm2_server, SMOLLM2)
