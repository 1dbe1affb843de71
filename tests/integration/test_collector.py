"""The asynchronous collector with real Redis, real Celery workers, the real gateway, vLLM and
trainer. Scripted agents (tests/agents.py) are held on Redis "gates" that the test opens
after chosen steps, so every carry-over metric has one exact expected value."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.config import load_config, to_yaml
from app.driver.loop import train
from app.state import keys
from app.state.records import SiblingResult
from tests.conftest import REPO, wait_rollouts_idle

pytestmark = pytest.mark.slow
CARRY = "training/async/"


@pytest.fixture
def stack(redis_client, gateway_service, celery_workers):
    yield redis_client
    # Open every gate so no agent thread stays blocked in the shared rollout worker.
    for gate in ("s1", "s2", "slow", "end", "never"):
        redis_client.set(f"test:gate:{gate}", 1)
    wait_rollouts_idle(redis_client)  # every agent saw its gate open before it goes
    for key in redis_client.scan_iter("test:*"):
        redis_client.delete(key)


def make_cfg(tmp_path: Path, samples: list[dict], *overrides: str):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"s{i}", **s}) + "\n"
                            for i, s in enumerate(samples)))
    env = json.loads(os.environ["CARRYOVER_OVERRIDES"])
    base = load_config(None, env)
    from app.state.connection import resolve_redis_url

    return load_config(None, [
        *env,
        f"data.train_files={data}", "data.shuffle=false",
        "controller.agent=tests.agents:scripted",
        f"agent.redis_url={resolve_redis_url(base)}",
        f"logging.dir={tmp_path / 'runs'}", "logging.wandb_mode=disabled",
        "logging.console=false",
        f"trainer.weights_dir={tmp_path / 'weights'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
        "actor_rollout_ref.rollout.n=2",
        *overrides,
    ])


def run(cfg, releases: dict[int, list[str]] | None = None, client=None,
        also=None) -> tuple[dict, list]:
    rows = []

    def on_step(step: int, metrics: dict) -> None:
        rows.append(metrics)
        if also is not None:
            also(step, metrics)
        for gate in (releases or {}).get(step, []):
            client.set(f"test:gate:{gate}", 1)

    return train(cfg, on_step=on_step), rows


def carry(row: dict) -> tuple:
    return (row[CARRY + "n_prev_carry_over_rollouts"], row[CARRY + "n_completed_rollouts"],
            row[CARRY + "n_new_carry_over_rollouts"], row[CARRY + "new_carry_over_age_max_steps"])


def test_scripted_carry_over_scenario(stack, tmp_path):
    samples = [{}, {}, {"gate": "slow"}, {"gate": "s1"}, {}, {"gate": "s2"},
               {"gate": "end"}, {"gate": "end"}]
    cfg = make_cfg(tmp_path, samples, "data.train_batch_size=2",
                   "agentlightning.async_rollout.async_train_batch_size=4",
                   "trainer.total_steps=3")
    held: dict = {}

    def hold_a_call_over_step_1(step: int, metrics: dict) -> None:
        """A model call in flight when step 1's pause begins, ending 0.3 s into it: that
        pause counts it and its drain waits for it."""
        if step != 0:
            return
        from app.state.pause import Admission

        adm = Admission(stack)
        status, lease, _ = adm.admit("held-call")
        assert status == 1

        def end_it() -> None:
            deadline = time.monotonic() + 60
            while not stack.exists(keys.paused()) and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(0.3)
            adm.release(lease)

        held["thread"] = threading.Thread(target=end_it, daemon=True)
        held["thread"].start()

    result, rows = run(cfg, {0: ["s1"], 1: ["slow", "s2"]}, stack, hold_a_call_over_step_1)
    held["thread"].join(5)
    run_id = result["run_id"]
    # Every training/async/* count, per step. Unfinished rollouts (n=2): step 0 carries the
    # gated g2 (slow) and g3 (s1); step 1 carries g2 and g5 (s2); step 2 carries g6 and g7
    # (end). The groups refilled during update s count from step s (they run on its old
    # weights), so g4 and g5 are consumed at age 1 and 2, g6 and g7 carried at age 1.
    expected = [
        {"n_prev_carry_over_rollouts": 0, "n_completed_rollouts": 4,
         "n_new_carry_over_rollouts": 4, "new_carry_over_age_max_steps": 0,
         "n_carry_over_finished_rollouts": 0, "n_complete_unselected_rollouts": 0,
         "consumed_age_mean_steps": 0.0, "consumed_age_max_steps": 0,
         "n_dropped_groups": 0, "n_requeued_groups": 0, "n_cancelled_groups": 0},
        {"n_prev_carry_over_rollouts": 4, "n_completed_rollouts": 4,
         "n_new_carry_over_rollouts": 4, "new_carry_over_age_max_steps": 1,
         "n_carry_over_finished_rollouts": 0, "n_complete_unselected_rollouts": 0,
         "consumed_age_mean_steps": 1.0, "consumed_age_max_steps": 1,
         "n_dropped_groups": 0, "n_requeued_groups": 0, "n_cancelled_groups": 0},
        {"n_prev_carry_over_rollouts": 4, "n_completed_rollouts": 4,
         "n_new_carry_over_rollouts": 4, "new_carry_over_age_max_steps": 1,
         "n_carry_over_finished_rollouts": 0, "n_complete_unselected_rollouts": 0,
         "consumed_age_mean_steps": 2.0, "consumed_age_max_steps": 2,
         "n_dropped_groups": 0, "n_requeued_groups": 0, "n_cancelled_groups": 0},
    ]
    timing = {"proxy_inflight_at_pause", "proxy_drain_seconds",
              "proxy_cancelled_at_drain_timeout"}
    for want in expected:  # nothing filtered or quarantined in this run
        want.update(n_filtered_groups=0, n_quarantined_prompts=0, filtered_group_share=0.0)
    for row, want in zip(rows, expected, strict=True):
        got = {k[len(CARRY):]: v for k, v in row.items()
               if k.startswith(CARRY) and k[len(CARRY):] not in timing}
        assert got == want
    steps = [stack.lrange(keys.run_step_groups(run_id, s), 0, -1) for s in range(3)]
    g = [f"{run_id}-g{i}" for i in range(8)]
    assert steps == [[g[0], g[1]], [g[3], g[4]], [g[2], g[5]]]
    # no group is trained before every sibling has finished
    for gid in [x for s in steps for x in s]:
        results = [SiblingResult.from_json(v)
                   for v in stack.hgetall(keys.group_results(gid)).values()]
        assert len(results) == 2 and all(r.status == "ok" for r in results)
        selected_at = float(stack.hget(keys.group(gid), "selected_at"))
        assert max(r.finished_at for r in results) <= selected_at
        assert stack.get(keys.group_trained(gid)) is not None
        # released once the step's result was stored: Redis does not grow with steps
        assert not any(stack.exists(keys.rollout_calls(r.rollout_id), keys.rollout(r.rollout_id))
                       for r in results)
        assert not stack.exists(keys.group_rollouts(gid))
    # carried past the end, the two groups held by the "end" gate are cancelled with it:
    # their agents stop, and their prompts are re-queued for a resumed run
    assert stack.zcard(keys.run_active(run_id)) == 0
    assert [stack.hget(keys.group(x), "status") for x in (g[6], g[7])] == ["cancelled"] * 2
    assert sorted(stack.lrange(keys.run_requeue(run_id), 0, -1)) == sorted(
        stack.hget(keys.group(x), "sample_index") for x in (g[6], g[7]))
    # refill during update s: the groups start on the weights update s replaces
    for gid in g[4:]:
        dispatched = int(stack.hget(keys.group(gid), "dispatch_step"))
        assert int(stack.hget(keys.group(gid), "dispatch_version")) \
            < rows[dispatched]["policy/version"]
    for r in rows:
        assert r["training/async/proxy_inflight_at_pause"] >= 0
        assert r["training/async/proxy_drain_seconds"] >= 0
    # the held call: in flight when step 1's pause began, waited for by its drain
    assert rows[1]["training/async/proxy_inflight_at_pause"] >= 1
    assert rows[1]["training/async/proxy_drain_seconds"] >= 0.25


def test_refill_after_update_starts_groups_on_the_new_weights(stack, tmp_path):
    cfg = make_cfg(tmp_path, [{} for _ in range(10)], "data.train_batch_size=2",
                   "agentlightning.async_rollout.async_train_batch_size=4",
                   "agentlightning.async_rollout.refill=after_update", "trainer.total_steps=3")
    result, rows = run(cfg)
    run_id = result["run_id"]
    for gid in (f"{run_id}-g{i}" for i in range(4, 8)):
        dispatched = int(stack.hget(keys.group(gid), "dispatch_step"))
        assert dispatched >= 1
        assert int(stack.hget(keys.group(gid), "dispatch_version")) \
            == rows[dispatched - 1]["policy/version"]
    assert all(r["policy/sample_version_lag_mean"] <= 1 for r in rows)
    # 2 groups (4 rollouts) carried each step, finished or not by the time of selection
    for r in rows:
        assert r[CARRY + "n_completed_rollouts"] == 4
        assert r[CARRY + "n_new_carry_over_rollouts"] \
            + r[CARRY + "n_carry_over_finished_rollouts"] == 4


def test_sync_baseline_has_no_carry_over(stack, tmp_path):
    cfg = make_cfg(tmp_path, [{} for _ in range(6)], "data.train_batch_size=2",
                   "agentlightning.async_rollout.enabled=false", "trainer.total_steps=2")
    result, rows = run(cfg)
    assert [carry(r) for r in rows] == [(0, 4, 0, 0), (0, 4, 0, 0)]
    assert stack.zcard(keys.run_active(result["run_id"])) == 0


def test_retry_then_drop_and_requeue(stack, tmp_path):
    samples = [{"fail": "first"}, {"fail": "always"}, {}, {}, {}, {}]
    cfg = make_cfg(tmp_path, samples, "data.train_batch_size=2",
                   "agentlightning.async_rollout.async_train_batch_size=3",
                   "controller.max_attempts=2", "trainer.total_steps=2")
    result, rows = run(cfg)
    run_id = result["run_id"]
    g0 = SiblingResult.from_json(stack.hget(keys.group_results(f"{run_id}-g0"), "0"))
    assert g0.status == "ok" and g0.attempts == 2
    assert stack.hget(keys.group(f"{run_id}-g1"), "status") == "dropped"
    assert sum(r["training/async/n_dropped_groups"] for r in rows) >= 1
    assert sum(r["training/async/n_requeued_groups"] for r in rows) >= 1
    # the dropped prompt (index 1) was dispatched again in a later group
    again = [stack.hget(keys.group(f"{run_id}-g{i}"), "sample_index") for i in range(2, 8)]
    assert "1" in again
    # this run's line (the session's log holds every test's)
    assert any(run_id in line and "scripted failure of s1" in line
               for line in (REPO_LOG_DIR() / "rollout.log").read_text().splitlines())


def REPO_LOG_DIR() -> Path:  # noqa: N802 - the session's log directory
    from tests.conftest import _TMP

    return _TMP / "logs"


def test_zero_reward_policy_trains_failed_siblings_with_zero(stack, tmp_path):
    samples = [{"fail": "always"}, {"gate": "never"}, {"gate": "never"}]
    cfg = make_cfg(tmp_path, samples, "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=2",
                   "controller.on_failure=zero_reward", "controller.max_attempts=1",
                   "trainer.total_steps=1")
    _, rows = run(cfg)
    assert rows[0]["batch/failed_rollouts_zero_reward"] == 2
    assert rows[0]["reward/mean"] == 0.0


def test_age_cap_cancels_and_requeues(stack, tmp_path):
    samples = [{"gate": "never"}] + [{} for _ in range(6)]
    cfg = make_cfg(tmp_path, samples, "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=2",
                   "agentlightning.async_rollout.max_carry_over_age_steps=1",
                   "trainer.total_steps=3")
    result, rows = run(cfg)
    run_id = result["run_id"]
    assert [r["training/async/n_cancelled_groups"] for r in rows] == [0, 0, 1]
    assert stack.hget(keys.group(f"{run_id}-g0"), "status") == "cancelled"
    assert len(json.loads(stack.hget(keys.group(f"{run_id}-g0"), "task_ids"))) == 2  # revoked
    # the cancelled prompt is dispatched again by the next top-up (re-queued prompts go
    # first): one later group carries sample 0, dispatched at or after the cancel (step 2)
    again = [g for g in (f"{run_id}-g{i}" for i in range(1, 7))
             if stack.hget(keys.group(g), "sample_index") == "0"]
    assert len(again) == 1 and int(stack.hget(keys.group(again[0]), "dispatch_step")) >= 2


def test_duplicate_callback_and_redelivered_sibling_change_nothing(stack, tmp_path):
    from workers.rollout.tasks import finish_group, run_rollout

    cfg = make_cfg(tmp_path, [{} for _ in range(4)], "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=2",
                   "trainer.total_steps=1")
    result, _ = run(cfg)
    gid = stack.lrange(keys.run_step_groups(result["run_id"], 0), 0, -1)[0]
    before = dict(stack.hgetall(keys.group_results(gid)))
    assert finish_group.apply_async(args=[[], gid]).get(timeout=30) == "duplicate"
    assert stack.zscore(keys.run_ready(result["run_id"]), gid) is None
    again = run_rollout.apply_async(args=[gid, 0]).get(timeout=30)
    assert again["rollout_id"] == SiblingResult.from_json(before["0"]).rollout_id
    assert dict(stack.hgetall(keys.group_results(gid))) == before
    # no new attempt was started (it would have made a rollout record; the trained one's
    # were released with its step)
    assert list(stack.scan_iter(f"co:rollout:{gid}.0.*")) == []


def test_early_chord_callback_is_completed_by_the_last_sibling(redis_client, tmp_path):
    """A sibling that ran twice (its worker wrongly presumed dead) counts twice in the
    chord, so the callback can fire before the last sibling stored its result: the group
    must not be completed partially, and the last sibling completes it."""

    from app.driver.collector import Collector
    from app.state.completion import finish_group
    from app.state.records import GroupRecord
    from workers.rollout.episode import store_result

    cfg = make_cfg(tmp_path, [{}])
    Collector.create_run(redis_client, "early", cfg.to_dict(), "async")
    gid = "early-g0"
    redis_client.hset(keys.group(gid), mapping=GroupRecord(gid, "early", 0, n=2).to_hash())
    redis_client.zadd(keys.run_active("early"), {gid: 0})

    def result(i: int) -> SiblingResult:
        return SiblingResult(i, f"{gid}.{i}.x", "ok", 0.5, 1, 0.1)

    store_result(redis_client, gid, result(0))
    assert finish_group(redis_client, gid) == "incomplete"  # the early callback
    assert redis_client.zscore(keys.run_ready("early"), gid) is None
    assert not redis_client.exists(keys.group_done(gid))
    store_result(redis_client, gid, result(1))  # the last sibling completes the group
    assert redis_client.hget(keys.group(gid), "status") == "complete"
    assert redis_client.zscore(keys.run_ready("early"), gid) == 0
    assert finish_group(redis_client, gid) == "duplicate"
    # the exactly-once guard lives a week, not for ever (a long run would keep one per group)
    from app.state.retention import GUARD_TTL_S
    assert GUARD_TTL_S - 60 < redis_client.ttl(keys.group_done(gid)) <= GUARD_TTL_S


def test_driver_killed_and_resumed_keeps_its_carry_over(stack, tmp_path):
    samples = [{}, {"gate": "end"}, {"sleep": 0.5}, {"sleep": 0.5}] + [{} for _ in range(8)]
    cfg = make_cfg(tmp_path, samples, "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=3",
                   "trainer.total_steps=4", "logging.console=true")
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(to_yaml(cfg))
    env = {**os.environ, "CARRYOVER_OVERRIDES": "[]"}
    carryover = str(Path(sys.executable).parent / "carryover")
    proc = subprocess.Popen([carryover, "train", "--config", str(cfg_file)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("step    2/4"):
            break
    runs = [k for k in stack.scan_iter("co:run:*") if k.count(":") == 2]
    run_id = runs[0].split(":", 2)[2]
    # killed once step 2's groups are selected, before its update has ended

    def selected_step() -> int | None:
        raw = stack.hget(keys.run(run_id), "last_selection")
        return json.loads(raw)["step"] if raw else None

    deadline = time.monotonic() + 60
    while selected_step() != 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert stack.hget(keys.run(run_id), "step") == "2"
    assert stack.exists(keys.run_step_groups(run_id, 2))
    selected = json.loads(stack.hget(keys.run(run_id), "last_selection"))
    active_before = set(stack.zrange(keys.run_active(run_id), 0, -1))
    assert f"{run_id}-g1" in active_before  # the gated group is carried over
    out = subprocess.run([carryover, "train", "--config", str(cfg_file), "--resume", run_id],
                         cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert stack.hget(keys.run(run_id), "step") == "4"
    trained = [g for s in range(4) for g in stack.lrange(keys.run_step_groups(run_id, s), 0, -1)]
    assert len(trained) == len(set(trained)) == 4  # no group trained twice
    assert stack.zcard(keys.run_active(run_id)) == 0  # the end cancels the carry-over
    ended = {x for x in active_before if stack.hget(keys.group(x), "status") == "cancelled"}
    assert active_before <= set(trained) | ended  # no carried-over group lost
    assert f"{run_id}-g1" in ended
    # the resumed step reports the carry-over its selection had, as if never interrupted
    rows = {r["step"]: r for r in map(json.loads, stack.lrange(keys.run_metrics(run_id), 0, -1))}
    assert sorted(rows) == [0, 1, 2, 3]
    assert (rows[2][CARRY + "n_prev_carry_over_rollouts"],
            rows[2][CARRY + "n_completed_rollouts"],
            rows[2][CARRY + "n_new_carry_over_rollouts"],
            rows[2][CARRY + "new_carry_over_age_max_steps"]) == (
        selected["prev_carry_over_rollouts"], 2, selected["new_carry_over_rollouts"],
        selected["carry_over_age_max"])
    assert rows[3][CARRY + "n_prev_carry_over_rollouts"] == selected["new_carry_over_rollouts"]


def test_a_group_whose_callback_never_ran_is_completed_though_no_wait_is_long(
        redis_client, tmp_path):
    """In async mode the other groups fill each batch, so no single wait lasts the
    reconcile interval: a complete group whose chord callback never ran (all its results
    stored) must still be found, or it holds its slot for good."""

    from app.driver.collector import Collector
    from app.state import carry as carry_state
    from app.state.records import GroupRecord

    cfg = make_cfg(tmp_path, [{}], "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=3")
    run = "orphan-cb"
    Collector.create_run(redis_client, run, cfg.to_dict(), "async")
    collector = Collector(redis_client, run, cfg)
    for gid, ready in (("orphan-cb-g0", False), ("orphan-cb-g1", True)):
        redis_client.hset(keys.group(gid), mapping=GroupRecord(gid, run, 0, n=2).to_hash())
        redis_client.zadd(keys.run_active(run), {gid: 0})
        for i in range(2):
            carry_state.store_sibling_result(redis_client, run, gid, i, SiblingResult(
                i, f"{gid}.{i}.x", "ok", float(i), 1, 0.1).to_json())
        if ready:
            redis_client.zadd(keys.run_ready(run), {gid: 0})
    # two short waits (a batch is ready at once), the interval passed between them
    collector.wait_ready(reconcile_every_s=0.2)
    time.sleep(0.3)
    collector.wait_ready(reconcile_every_s=0.2)
    assert redis_client.zscore(keys.run_ready(run), "orphan-cb-g0") is not None


def test_the_drops_of_a_quarantined_prompt_are_not_counted_as_re_queued(redis_client,
                                                                        tmp_path):
    """``data.max_prompt_failures: 2``: the first drop re-queues the prompt, the second
    quarantines it, and a third (a group dispatched before the quarantine) is dropped and
    re-queued by no one. The re-queue count is what was pushed: 1, not drops - quarantines."""

    from app.driver.collector import Collector
    from app.state.completion import finish_group
    from app.state.records import GroupRecord
    from workers.rollout.episode import store_result

    cfg = make_cfg(tmp_path, [{}], "data.max_prompt_failures=2")
    run = "requeue-count"
    Collector.create_run(redis_client, run, cfg.to_dict(), "async")
    before = Collector(redis_client, run, cfg).counters()
    answers = []
    for k in range(3):
        gid = f"{run}-g{k}"
        redis_client.hset(keys.group(gid), mapping=GroupRecord(gid, run, 0, n=1).to_hash())
        redis_client.zadd(keys.run_active(run), {gid: k})
        store_result(redis_client, gid, SiblingResult(0, f"{gid}.0.x", "failed", None, 1, 0.1,
                                                      error="boom"))
        answers.append(finish_group(redis_client, gid))
    after = Collector(redis_client, run, cfg).counters()
    assert answers == ["dropped"] * 3
    assert redis_client.lrange(keys.run_requeue(run), 0, -1) == ["0"]
    delta = {k: after[k] - before[k] for k in after}
    assert (delta["dropped"], delta["quarantined"], delta["requeued"]) == (3, 1, 1)
