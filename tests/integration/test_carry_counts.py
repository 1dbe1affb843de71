"""What a step carries over, counted exactly (``app.state.carry``): unfinished rollouts are
active groups x n minus the sibling results stored while their group was active, whatever
the order of results, cancels, drops and selections."""

from __future__ import annotations

from app.state import carry, keys
from app.state.records import SiblingResult

RUN = "carry"
N = 4


def add_group(r, i: int) -> str:
    gid = f"{RUN}-g{i}"
    r.hset(keys.group(gid), mapping={"run_id": RUN, "status": "active"})
    r.zadd(keys.run_active(RUN), {gid: i})
    return gid


def result(r, gid: str, i: int) -> bool:
    return carry.store_sibling_result(r, RUN, gid, i, SiblingResult(i, f"{gid}.{i}", "ok", 1.0,
                                                                    1, 0.1).to_json())


def test_counts_follow_results_cancels_and_late_siblings(redis_client):
    r = redis_client
    g = [add_group(r, i) for i in range(3)]
    assert carry.carried(r, RUN, N) == (12, 0, 0)
    assert result(r, g[0], 0) and result(r, g[0], 1) and result(r, g[1], 0)
    assert not result(r, g[0], 1)  # a redelivered sibling overwrites: counted once
    assert carry.carried(r, RUN, N) == (9, 3, 0)
    for i in (2, 3):
        result(r, g[0], i)
    r.zadd(keys.run_ready(RUN), {g[0]: 0})  # g0 complete, not selected
    assert carry.carried(r, RUN, N) == (7, 5, 4)
    assert carry.cancel_group(r, RUN, g[1], 1)  # its one finished sibling leaves the count
    assert not carry.cancel_group(r, RUN, g[1], 1)
    assert carry.carried(r, RUN, N) == (4, 4, 4)
    result(r, g[1], 2)  # a late sibling of the cancelled group: not carried
    assert carry.carried(r, RUN, N) == (4, 4, 4)
    assert r.hget(keys.run(RUN), "n_cancelled") == "1"
    assert r.lrange(keys.run_requeue(RUN), 0, -1) == ["1"]


def new_run(r, run: str, tmp_path):
    """A run of 4 prompts, groups of 2, one group a step, two active."""

    from app.config import load_config
    from app.driver.collector import Collector

    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"text": "s{i}"}}\n' for i in range(4)))
    cfg = load_config(None, [f"data.train_files={data}", "actor_rollout_ref.rollout.n=2",
                             "data.train_batch_size=1",
                             "agentlightning.async_rollout.async_train_batch_size=2"])
    Collector.create_run(r, run, cfg.to_dict(), "async")
    return Collector(r, run, cfg)


def test_a_selection_whose_figures_were_not_recorded_has_them_read_at_resume(redis_client,
                                                                            tmp_path):
    """The driver died between the selection's transaction and the record of its figures:
    the resumed step reported none of the carry-over metrics, and the next step's
    ``n_prev_carry_over_rollouts`` was the step before's."""
    r, run = redis_client, "carry-resumed-selection"
    collector = new_run(r, run, tmp_path)
    for i, dispatched in enumerate((1, 2)):
        gid = f"{run}-g{i}"
        r.hset(keys.group(gid), mapping={"run_id": run, "status": "active",
                                         "dispatch_step": dispatched})
        r.zadd(keys.run_active(run), {gid: i})
    for i in range(2):
        carry.store_sibling_result(r, run, f"{run}-g0", i, SiblingResult(
            i, f"{run}-g0.{i}", "ok", 1.0, 1, 0.1).to_json())
    r.zadd(keys.run_ready(run), {f"{run}-g0": 0})
    assert collector.selected(3) is None  # nothing selected for step 3 yet
    made = collector.select(3, prev_carry_over_rollouts=5, wait_seconds=1.0)
    r.hdel(keys.run(run), "last_selection", "carry_unfinished")  # died before recording them
    again = collector.selected(3)
    assert again is not None and again.group_ids == made.group_ids == [f"{run}-g0"]
    assert again.consumed_ages == [2] and again.new_carry_over_rollouts == 2
    assert again.carry_over_age_max == 1


def test_groups_sent_after_an_unrecorded_update_count_their_age_from_its_weights(
        redis_client, tmp_path):
    """A driver that died after the trainer stored step 2's result and before the step was
    recorded resumes at step 2, and its first top-up starts groups on the new weights: their
    age counts from step 3, not 2, or they are cancelled as stale a step early."""
    r, run = redis_client, "carry-unrecorded-update"
    collector = new_run(r, run, tmp_path)
    collector._send = lambda gid: None  # no workers here: the record is what is checked
    collector.set_step(2)
    assert collector.top_up(5) == 2
    assert {r.hget(keys.group(f"{run}-g{i}"), "dispatch_step") for i in (0, 1)} == {"2"}
    r.zrem(keys.run_active(run), f"{run}-g1")
    r.set(keys.run_step_result(run, 2), "{}")  # step 2's update done, not yet recorded
    assert collector.top_up(6) == 1
    assert r.hget(keys.group(f"{run}-g2"), "dispatch_step") == "3"
    r.zrem(keys.run_active(run), f"{run}-g2")
    assert collector.top_up(6, dispatch_step=2) == 1  # an explicit step is kept as given
    assert r.hget(keys.group(f"{run}-g3"), "dispatch_step") == "2"
