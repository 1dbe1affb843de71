"""The RL recipe around the asynchronous core, on the real stack (Redis, Celery workers, the
gateway, vLLM and the trainer) with scripted agents: dynamic sampling, poison prompts and a
group baseline over every rollout."""

from __future__ import annotations

import re
import threading
import time

import pytest

from app.driver.loop import TrainingFailed
from app.state import keys
from tests.integration.test_collector import REPO_LOG_DIR, make_cfg, run, stack  # noqa: F401

pytestmark = pytest.mark.slow
ASYNC = "training/async/"
EQUAL = {"reward": 1.0}  # every sibling scores the same: GRPO advantages all zero


def _groups(client, run_id: str) -> list[dict]:
    out, seq = [], 0
    while client.exists(keys.group(f"{run_id}-g{seq}")):
        out.append(client.hgetall(keys.group(f"{run_id}-g{seq}")))
        seq += 1
    return out


def _open_when(client, gate: str, ready) -> threading.Thread:
    def wait() -> None:
        deadline = time.monotonic() + 120
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        client.set(f"test:gate:{gate}", 1)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def test_dynamic_sampling_trains_only_informative_groups(stack, tmp_path):  # noqa: F811
    # half the prompts give equal rewards; the informative ones are held until both equal
    # groups were filtered, and the refills of the freed slots never finish
    samples = [EQUAL, EQUAL, {"gate": "go"}, {"gate": "go"}, {"gate": "never"},
               {"gate": "never"}]
    cfg = make_cfg(tmp_path, samples, "data.train_batch_size=2",
                   "agentlightning.async_rollout.async_train_batch_size=4",
                   "algorithm.filter_groups.enable=true", "trainer.total_steps=1")
    def filtered() -> bool:  # the test's run is the only one (redis_client starts clean)
        runs = [k for k in stack.scan_iter(keys.run("*")) if k.count(":") == 2]
        return any(int(stack.hget(k, "n_filtered") or 0) >= 2 for k in runs)

    _open_when(stack, "go", filtered)
    result, rows = run(cfg)
    run_id = result["run_id"]
    groups = _groups(stack, run_id)
    status = {g["sample_index"]: g["status"] for g in groups
              if g["sample_index"] in {"0", "1", "2", "3"}}
    assert status == {"0": "filtered", "1": "filtered", "2": "selected", "3": "selected"}
    assert rows[0][ASYNC + "n_filtered_groups"] == 2
    assert rows[0][ASYNC + "filtered_group_share"] == 0.5
    assert rows[0]["batch/groups"] == 2 and rows[0][ASYNC + "n_completed_rollouts"] == 4
    # the freed slots were refilled at once: 4 active groups + 2 filtered were dispatched
    assert int(stack.hget(keys.run(run_id), "n_dispatched")) == 6
    assert rows[0][ASYNC + "n_requeued_groups"] == 0  # a filtered prompt is not re-queued


def test_dynamic_sampling_that_starves_a_step_fails_it_with_the_figures(stack, tmp_path):  # noqa: F811
    cfg = make_cfg(tmp_path, [EQUAL] * 4, "data.train_batch_size=2",
                   "agentlightning.async_rollout.async_train_batch_size=3",
                   "algorithm.filter_groups.enable=true",
                   "algorithm.filter_groups.max_num_gen_batches=2", "trainer.total_steps=1")
    with pytest.raises(TrainingFailed, match=r"starved the step: 0 of 2 informative groups "
                                             r"ready .* (\d+) complete groups filtered") as err:
        run(cfg)
    filtered = int(re.search(r"(\d+) complete groups filtered", str(err.value)).group(1))
    assert filtered >= 4 and "max_num_gen_batches=2 (4 groups)" in str(err.value)


def test_a_prompt_that_always_fails_is_quarantined_and_the_run_finishes(stack, tmp_path):  # noqa: F811
    samples = [{"fail": "always"}, {}, {}]
    cfg = make_cfg(tmp_path, samples, "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=2",
                   "controller.max_attempts=1", "data.max_prompt_failures=2",
                   "trainer.total_steps=6")
    result, rows = run(cfg)
    run_id = result["run_id"]
    assert result["steps"] == 6
    poisoned = [g for g in _groups(stack, run_id) if g["sample_index"] == "0"]
    # quarantined when its second group was dropped: no group of it is dispatched after
    # that (not re-queued, skipped in later epochs); one dispatched before it (a later epoch's
    # while the first drop's re-queue ran) still runs and is dropped too
    assert len(poisoned) >= 2 and all(g["status"] == "dropped" for g in poisoned)
    quarantined_at = sorted(float(g["completed_at"]) for g in poisoned)[1]
    assert all(float(g["dispatched_at"]) <= quarantined_at for g in poisoned)
    assert int(stack.hget(keys.run(run_id), "n_quarantined")) == 1
    assert "scripted failure of s0" in stack.hget(keys.run_quarantined(run_id), "0")
    epochs = int(stack.hget(keys.run(run_id), "epoch"))
    assert epochs >= 2  # the run went round the data after the quarantine
    assert sum(r[ASYNC + "n_quarantined_prompts"] for r in rows) == 1
    log = (REPO_LOG_DIR() / "groups.log").read_text(errors="replace").splitlines()
    assert any("prompt 0 quarantined" in line and f"group {run_id}-g" in line
               and "scripted failure of s0" in line for line in log)  # this run's line


def test_a_rollout_that_failed_before_its_first_call_is_in_the_baseline(stack, tmp_path):  # noqa: F811
    # sibling 2 fails before any call and scores 0 (zero_reward): rewards 1, 0, 0
    samples = [{"fail_before_call": [2], "sibling_reward": [1.0, 0.0, 0.0], "max_tokens": 1},
               {"gate": "never"}]
    cfg = make_cfg(tmp_path, samples, "actor_rollout_ref.rollout.n=3",
                   "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=2",
                   "controller.on_failure=zero_reward", "controller.max_attempts=1",
                   "trainer.total_steps=1")
    _, rows = run(cfg)
    row = rows[0]
    assert row["batch/rowless_rollouts"] == 1 and row["batch/failed_rollouts_zero_reward"] == 1
    assert row["batch/rows"] == 2 and row["batch/trained_tokens"] == 2
    # by hand: mean 1/3, sample std sqrt(1/3); advantages 2/3 / std and -1/3 / std, one token
    # each, so their mean magnitude is 0.5 / std = 0.866 (over the two survivors alone, as
    # before: +-0.707)
    std = (1 / 3) ** 0.5
    assert row["actor/advantage_abs_mean"] == pytest.approx(0.5 / std, rel=1e-4)


def test_only_the_equal_reward_prompt_is_filtered_in_every_epoch(stack, tmp_path):  # noqa: F811
    cfg = make_cfg(tmp_path, [EQUAL, {}, {}], "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=2",
                   "algorithm.filter_groups.enable=true", "trainer.total_steps=4")
    result, rows = run(cfg)
    run_id = result["run_id"]
    reported = sum(r[ASYNC + "n_filtered_groups"] for r in rows)
    groups = _groups(stack, run_id)
    filtered = [g for g in groups if g["status"] == "filtered"]
    assert {g["sample_index"] for g in filtered} == {"0"}
    # 4 steps of 1 group go round the data twice: each epoch's group of prompt 0 was
    # filtered (or, the last, may still run)
    zeros = [g["status"] for g in groups if g["sample_index"] == "0"]
    assert len(zeros) >= 2 and set(zeros) <= {"filtered", "active"} and reported >= 1
    assert int(stack.hget(keys.run(run_id), "n_filtered")) >= reported


def test_age_cap_wait_trains_the_overdue_group_and_reports_the_wait(stack, tmp_path):  # noqa: F811
    # g0 is held until step 1 is done, then takes 3 s more: at step 2 it is 2 steps old,
    # past the cap of 1, so step 2 waits for it instead of cancelling it
    samples = [{"gate": "slow", "sleep": 3}] + [{} for _ in range(8)]
    cfg = make_cfg(tmp_path, samples, "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=2",
                   "agentlightning.async_rollout.max_carry_over_age_steps=1",
                   "agentlightning.async_rollout.max_carry_over_age_strategy=wait",
                   "trainer.total_steps=3")
    result, rows = run(cfg, {1: ["slow"]}, stack)
    run_id = result["run_id"]
    assert [r[ASYNC + "n_cancelled_groups"] for r in rows] == [0, 0, 0]
    assert stack.lrange(keys.run_step_groups(run_id, 2), 0, -1) == [f"{run_id}-g0"]
    assert rows[2][ASYNC + "consumed_age_max_steps"] == 2
    waits = [r["timing/wait_for_overdue_seconds"] for r in rows]
    # (how much of g0's 3 s is left when step 2 begins depends on the machine's speed)
    assert waits[0] == waits[1] == 0.0 and 0 < waits[2] <= rows[2]["timing/wait_for_data_seconds"]


@pytest.mark.parametrize("policy", ["end", "fail"])
def test_context_overflow_ends_the_rollout_or_fails_it(stack, tmp_path, policy):  # noqa: F811
    # each rollout makes one call that fits, then one whose prompt exceeds max_model_len,
    # and does not catch the 400
    cfg = make_cfg(tmp_path, [{"overflow": True}, {"gate": "never"}],
                   "data.train_batch_size=1",
                   "agentlightning.async_rollout.async_train_batch_size=2",
                   f"controller.on_context_overflow={policy}", "controller.overflow_reward=0.25",
                   "controller.max_attempts=1", "controller.on_failure=zero_reward",
                   "trainer.total_steps=1")
    _, rows = run(cfg)
    row = rows[0]
    # the first calls are trained either way; end: with overflow_reward, fail: scored 0
    assert row["batch/samples"] == 2 and row["batch/rollouts"] == 2
    if policy == "end":
        assert row["reward/mean"] == 0.25 and row["batch/failed_rollouts_zero_reward"] == 0
    else:
        assert row["reward/mean"] == 0.0 and row["batch/failed_rollouts_zero_reward"] == 2
