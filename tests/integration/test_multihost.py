"""The demo task trained across hosts: Redis, the inference server with the gateway, two
rollout hosts and the trainer each in a network namespace of their own (bench/multihost.py),
every role started by its Procfile command on a non-loopback address. The run finishes its
steps with captured calls and carry-over as on one host, both rollout hosts run siblings,
every group trains once and whole, and the root namespace's network is left as it was."""

from __future__ import annotations

import pytest

from app.driver.metrics import CARRY_METRICS
from bench.multihost import root_network
from tests.multihost import (
    SMALL_RUN,
    TEST_TIMEOUT_S,
    assert_trained_once_and_whole,
    metrics_rows,
    multihost,  # noqa: F401 - fixture
    run_id_of,
    run_state,
    train,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]

STEPS = 3


def test_run_across_hosts(multihost):  # noqa: F811
    assert root_network() == multihost.root_before, "the harness changed the root namespace"
    out = train(multihost, f"trainer.total_steps={STEPS}", *SMALL_RUN)
    run_id = run_id_of(out.stdout)
    rows = metrics_rows(multihost, run_id)
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        for name in CARRY_METRICS:
            assert name in r and r[name] is not None, name
        # every trained rollout came with the calls the gateway captured (token ids and
        # the engine's log-probs), and the probe saw the exported weights served
        assert r["batch/rollouts"] == 8 and r["batch/rowless_rollouts"] == 0, r
        assert r["batch/samples"] >= 8 and r["batch/trained_tokens"] > 0, r
        assert abs(r["weight_sync/probe_gap"]) < 1e-3, r
    assert [r["policy/version"] for r in rows] == sorted({r["policy/version"] for r in rows})
    assert any(r["training/async/n_new_carry_over_rollouts"] > 0 for r in rows[:-1])
    assert any(r["training/async/n_prev_carry_over_rollouts"] > 0 for r in rows[1:])
    # the exports went through the hosts' shared folder
    assert list((multihost.run_dir / "shared" / "weights").glob("v*"))

    state = run_state(multihost, run_id, STEPS)
    assert_trained_once_and_whole(state, STEPS, per_step=2, n=4)
    tasks = state["tasks"]
    for host in ("roll1", "roll2"):
        assert tasks.get(f"rollout@{host}", {}).get("workers.rollout.tasks.run_rollout"), tasks
    assert sum(tasks.get(f"groups@{h}", {}).get("workers.rollout.tasks.finish_group", 0)
               for h in ("roll1", "roll2")) >= 2 * STEPS, tasks
    trained = tasks.get("trainer@trainer", {}).get("workers.trainer.tasks.train_step", 0)
    assert trained >= STEPS, tasks
    assert root_network() == multihost.root_before


def test_outside_host_reaches_the_services_but_holds_no_credentials(multihost):  # noqa: F811
    """The outside host is on the network (the gateway's health answers it) and gets neither
    config nor secrets: Redis and the gateway's admin routes refuse it, and the inference
    server's port does not answer it at all (the dev routes guard); the trainer host reaches
    that port, whose /v1 wants the key."""
    env = multihost.env("outside")
    assert not {"CARRYOVER_CONFIG", "REDIS_PASSWORD", "CARRYOVER_ADMIN_TOKEN",
                "CARRYOVER_INFERENCE_API_KEY"} & set(env)

    def http(url: str, host: str = "outside") -> str:
        out = multihost.run(host, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                   "--connect-timeout", "5", "--max-time", "30", url],
                            timeout=120)
        return out.stdout.strip()

    gateway, inference = multihost.gateway_url, f"http://{multihost.address('infer')}:8100"
    assert http(f"{gateway}/healthz") == "200"
    assert http(f"{gateway}/admin/state") in ("401", "403")
    assert http(f"{inference}/v1/models") == "000"  # no connection
    assert http(f"{inference}/v1/models", host="trainer") == "401"
    redis = multihost.run("outside", ["redis-cli", "-h", multihost.address("redis"), "-p",
                                      "6390", "ping"], timeout=120)
    assert "NOAUTH" in redis.stdout + redis.stderr, redis
