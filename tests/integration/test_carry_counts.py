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
