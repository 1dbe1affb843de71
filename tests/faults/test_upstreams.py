"""Several inference servers behind one gateway: stickiness, health checks, failover.

Two instant stand-ins behind a gunicorn gateway that checks their ``/health`` every 0.5 s.
Which server served a call is read from the call's capture record (``upstream``)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
import time

import pytest
import requests

from app.state import keys
from gateway.upstream import STALE_REFRESH_S, Upstreams
from tests.conftest import free_port, serving, standin_gateway

CHECK_S = 0.5
ROLLOUTS = 16
# the model these tests' weights are published for: not the session's, so the session
# trainer's keeper (which watches the session's server) never acts on them
MODEL = "keeper-test-model"


@pytest.fixture
def two_upstreams(tmp_root, redis_client):
    with standin_gateway(tmp_root, "two-upstreams", f"gateway.upstream_health_s={CHECK_S}",
                         standins=2) as (gw, _, standins):
        yield gw, standins


def _call(gw: str, rid: str, token: str) -> requests.Response:
    return requests.post(f"{gw}/rollout/{rid}/v1/chat/completions", timeout=10,
                         headers={"Authorization": f"Bearer {token}"},
                         json={"model": "m", "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]})


def _served_by(redis_client, rid: str) -> list[str]:
    return [json.loads(c)["upstream"] for c in redis_client.lrange(keys.rollout_calls(rid), 0, -1)]


def _rollouts(new_rollout, gw, urls):
    """-> [(rollout id, token, the server its ranking puts first)]"""
    ranking = Upstreams(urls)
    out = []
    for _ in range(ROLLOUTS):
        rid, token, _ = new_rollout(gw)
        out.append((rid, token, ranking.ranking(rid)[0]))
    return out


def test_a_rollout_sticks_to_one_server_and_rollouts_spread(two_upstreams, new_rollout,
                                                            redis_client):
    gw, standins = two_upstreams
    urls = [u for u, _ in standins]
    rollouts = _rollouts(new_rollout, gw, urls)
    for rid, token, _ in rollouts:
        for _ in range(3):
            assert _call(gw, rid, token).status_code == 200
    for rid, _, first in rollouts:
        assert _served_by(redis_client, rid) == [first] * 3
    assert {first for _, _, first in rollouts} == set(urls)   # both servers got rollouts


def _wait_until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _settled(gw, redis_client, rollouts, expected) -> None:
    """Calls, until every rollout's goes to ``expected(first)`` twice in a row, two checks
    apart (every gateway worker has run its health checks since: on a loaded machine a
    worker's check may come late, and one pass's calls may all meet the same worker)."""
    deadline = time.monotonic() + 30
    clean = 0
    while True:
        served = []
        for rid, token, first in rollouts:
            assert _call(gw, rid, token).status_code == 200
            served.append(_served_by(redis_client, rid)[-1] == expected(first))
        clean = clean + 1 if all(served) else 0
        if clean == 2:
            return
        assert time.monotonic() < deadline, "the gateway workers did not follow the checks"
        time.sleep(2 * CHECK_S)


def test_an_unhealthy_server_is_skipped_until_it_passes_again(two_upstreams, new_rollout,
                                                               redis_client):
    gw, standins = two_upstreams
    (sick, _), (well, _) = standins
    rollouts = _rollouts(new_rollout, gw, [sick, well])
    requests.post(f"{sick}/standin/health", json={"ok": False}, timeout=5)
    # two failed checks in a row, in every gateway worker
    _settled(gw, redis_client, rollouts, lambda first: well)
    for rid, token, _ in rollouts:
        assert _call(gw, rid, token).status_code == 200
        assert _served_by(redis_client, rid)[-1] == well   # no call went to the sick one
    requests.post(f"{sick}/standin/health", json={"ok": True}, timeout=5)
    _settled(gw, redis_client, rollouts, lambda first: first)
    for rid, token, first in rollouts:
        assert _call(gw, rid, token).status_code == 200
        assert _served_by(redis_client, rid)[-1] == first   # back to its own server
    assert not redis_client.sismember(keys.upstreams_stale(), sick)   # alive throughout


def test_a_dead_server_is_skipped_by_every_gateway_process_once_marked_stale(
        two_upstreams, new_rollout, redis_client):
    """Once one gateway process has marked a dead server stale, every process skips it
    within the shared set's refresh time, before any of its rollouts' calls fail there."""
    gw, standins = two_upstreams
    (dead, proc), (alive, _) = standins
    rollouts = _rollouts(new_rollout, gw, [dead, alive])
    # only a server some gateway process has seen healthy is stale when it goes away (one
    # never seen up is still starting): every process has looked at least once by now
    time.sleep(3 * CHECK_S)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)
    # a refused health check marks it stale for every gateway process (it may come back
    # with its initial weights: the trainer's keeper reloads them before it is used again)
    _wait_until(lambda: redis_client.sismember(keys.upstreams_stale(), dead), 5)
    # a process that read the set just before the mark reads it again within the refresh
    # time; until then its calls may still go to the dead server (and get a retryable 503)
    time.sleep(STALE_REFRESH_S + 0.1)
    for rid, token, _ in rollouts:
        r = _call(gw, rid, token)
        assert r.status_code == 200, r.text
        assert _served_by(redis_client, rid)[-1] == alive


def test_a_server_still_starting_is_skipped_but_not_marked_stale(redis_client):
    """A gateway that comes up before its inference server skips it until it answers, and
    does not mark it stale: stale means "came back, perhaps with its initial weights"."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ups = Upstreams([url], client=redis_client)
    assert ups.check_health(timeout_s=10) == {url: False}
    assert ups.pick("r1") is None
    assert not redis_client.sismember(keys.upstreams_stale(), url)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert ups.check_health(timeout_s=10) == {url: True}
        assert ups.pick("r1") == url
    finally:
        server.shutdown()
        server.server_close()
    # now it has been up: going away marks it stale for every gateway process
    assert ups.check_health(timeout_s=10) == {url: False}
    assert ups.pick("r1") is None
    assert redis_client.sismember(keys.upstreams_stale(), url)


def test_the_keeper_never_loads_another_models_weights(redis_client, tmp_path):
    """A server that comes back while the last published weights are of another model (a
    run of another config on this Redis) is put back in rotation with its initial model:
    loading them would fail, and can leave the server unable to load the next run's."""
    from workers.trainer.keeper import UpstreamKeeper

    posts: list[str] = []

    class Server(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:  # noqa: N802
            posts.append(self.path)
            self.send_response(500)  # vLLM asked to load weights of another shape
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    with serving(Server) as url:
        redis_client.hset(keys.policy_published(), mapping={
            "version": 7, "path": str(tmp_path), "model": "another-model",
            "probe": "[]", "probe_ids": "[]"})
        redis_client.sadd(keys.upstreams_stale(), url)
        keeper = UpstreamKeeper(redis_client, [url], MODEL, 0.1)
        assert keeper.tick() == [url]
        assert posts == [] and not redis_client.sismember(keys.upstreams_stale(), url)
        # the same model's weights are loaded (here the load fails: the server stays stale,
        # and the keeper goes on with its other servers instead of raising)
        redis_client.hset(keys.policy_published(), "model", MODEL)
        redis_client.sadd(keys.upstreams_stale(), url)
        assert keeper.tick() == []
        assert posts == ["/collective_rpc"]
        assert redis_client.sismember(keys.upstreams_stale(), url)
        # a failed load is not what a trainer could fix: the driver is not asked
        assert not redis_client.exists(keys.upstreams_need_weights())


def test_a_server_whose_proxy_answers_502_is_marked_stale(redis_client):
    """In front of a restarting server, a proxy answers 502 (or 504): the server may come
    back with its initial weights, so twice in a row it is stale for every gateway until the
    keeper has reloaded it. vLLM's own 503 (a dead engine) only skips it."""
    status = {"code": 200}

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            self.send_response(status["code"])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    with serving(Proxy) as url:
        ups = Upstreams([url], client=redis_client)
        assert ups.check_health(timeout_s=10) == {url: True}
        status["code"] = 503
        ups.check_health(timeout_s=10)
        ups.check_health(timeout_s=10)
        assert not redis_client.sismember(keys.upstreams_stale(), url)
        status["code"] = 200
        ups.check_health(timeout_s=10)
        status["code"] = 502   # once may be the proxy's hiccup; twice in a row, a restart
        ups.check_health(timeout_s=10)
        assert not redis_client.sismember(keys.upstreams_stale(), url)
        ups.check_health(timeout_s=10)
        assert redis_client.sismember(keys.upstreams_stale(), url)
        status["code"] = 200
        ups.check_health(timeout_s=10)
        assert ups.pick("r1") is None   # healthy again, but not until it is reloaded
        redis_client.srem(keys.upstreams_stale(), url)




class _Engine(http.server.BaseHTTPRequestHandler):
    """A server as the keeper sees it: its health, the weight version it says it holds, and
    the probe's log-probs; the POSTs it got are recorded."""
    state: dict = {}

    def _send(self, code: int, body: dict | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the http.server interface
        if self.path == "/health":
            self._send(self.state["health"])
        elif self.path == "/weight_info":
            self._send(200, {"weight_version": self.state["version"]})
        else:
            self._send(404)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.state["posts"].append(self.path)
        if self.path == "/v1/completions":  # the probe: ids 1, 2, 3
            self._send(200, {"choices": [{"prompt_logprobs": [
                None, {"2": {"logprob": -1.0}}, {"3": {"logprob": -2.0}}]}]})
        else:
            self._send(500)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def engine(redis_client, tmp_path):
    _Engine.state = {"health": 200, "version": "7", "posts": []}
    with serving(_Engine) as url:
        redis_client.hset(keys.policy_published(), mapping={
            "version": 7, "path": str(tmp_path), "model": MODEL,
            "probe": "[-1.0, -2.0]", "probe_ids": "[1, 2, 3]"})
        yield url, _Engine.state
        redis_client.srem(keys.upstreams_stale(), url)
        redis_client.delete(keys.policy_published())


def test_a_server_that_missed_one_look_is_not_taken_out(engine, redis_client):
    """A busy engine answers /health slowly or with an error once: the keeper (as the
    gateway) needs two misses in a row before it calls it down; a refused connection is
    down at once."""
    from workers.trainer.keeper import UpstreamKeeper

    url, state = engine
    keeper = UpstreamKeeper(redis_client, [url], MODEL, 0.1)
    state["health"] = 500
    keeper.tick()
    assert not redis_client.sismember(keys.upstreams_stale(), url)
    keeper.tick()
    assert redis_client.sismember(keys.upstreams_stale(), url)
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens
    try:
        UpstreamKeeper(redis_client, [gone], MODEL, 0.1).tick()
        assert redis_client.sismember(keys.upstreams_stale(), gone)
    finally:
        redis_client.srem(keys.upstreams_stale(), gone)


def test_health_checks_carry_the_servers_key(redis_client):
    """A proxy in front of the servers may ask for their key on every route, /health too:
    checked without it, every server failed every look and all were skipped."""
    class Guarded(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            ok = self.headers.get("Authorization") == "Bearer k3y"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    with serving(Guarded) as url:
        assert Upstreams([url], client=redis_client, api_key="k3y").check_health(
            timeout_s=1) == {url: True}


def test_a_server_marked_stale_while_redis_is_away_is_shared_once_it_is_back(redis_client):
    """A stream cut by a restarting server while Redis does not answer: this gateway process
    routes around the server at once, and tells the others (and the keeper, which reloads
    it) at its first read of the stale set that reaches Redis."""
    import redis as redis_lib

    url = f"http://127.0.0.1:{free_port()}"
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    away = redis_lib.Redis(port=free_port(), socket_connect_timeout=0.2,
                           retry=Retry(NoBackoff(), 0))
    ups = Upstreams([url], client=away)
    ups.stale_refresh_s = 0.0
    try:
        ups.mark_down(url, restarted=True)
        assert url in ups.stale()  # known here though Redis did not answer
        ups.client = redis_client  # Redis back
        assert url in ups.stale()
        assert redis_client.sismember(keys.upstreams_stale(), url)
    finally:
        redis_client.srem(keys.upstreams_stale(), url)
