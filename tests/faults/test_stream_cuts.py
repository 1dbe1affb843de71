"""An inference server that fails in the middle of a streamed answer (and a body that
cannot be sent to one).

The gateway (in this process, Flask's test client) sits in front of a scripted server that
sends one chunk and then closes the connection, or goes silent. The agent must get an error
in its protocol's stream, never an answer that just stops and looks finished; nothing is
captured; and the server is routed around."""

from __future__ import annotations

import http.server
import json
import os
import socket
import time

import pytest

from app.state import keys
from app.state.connection import resolve_redis_url
from gateway import create_app
from gateway.settings import GatewaySettings
from tests.conftest import serving

MODE = {"kind": "whole"}


def _chunk(text: str, ids: list[int], finish: str | None = None) -> bytes:
    c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                      "token_ids": ids, "finish_reason": finish,
                      "logprobs": {"content": [{"token": text, "logprob": -0.1,
                                                "top_logprobs": []}]}}]}
    if finish is None:
        c["prompt_token_ids"] = [1, 2, 3]
    return b"data: " + json.dumps(c).encode() + b"\n\n"


class Server(http.server.BaseHTTPRequestHandler):
    """Streams "h", then (``MODE``) "i" and [DONE], or closes the connection, or hangs; or
    (``slow-body``) answers a whole call with headers and a stalled body."""
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the http.server interface
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        if MODE["kind"] == "slow-body":  # a whole answer whose body stalls after its headers
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b'{"id": "c')
            self.wfile.flush()
            time.sleep(3)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        send(_chunk("h", [5]))
        if MODE["kind"] == "slow":    # the rest comes after a while (Redis dies meanwhile)
            time.sleep(MODE.get("gap_s", 1.0))
        if MODE["kind"] == "close":   # the server dies mid-answer
            time.sleep(0.1)
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if MODE["kind"] == "hang":    # the server stops answering
            time.sleep(3)
            return
        send(_chunk("i", [6], "stop") + b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def gateway(redis_client, cfg):
    with serving(Server) as url:
        settings = GatewaySettings(
            redis_url=resolve_redis_url(cfg), upstreams=(url,), model="m", admin_token="a",
            lease_ttl_s=30, hold=False, hold_timeout_s=1, retry_after_s=1,
            max_body_bytes=1 << 20, max_concurrent_per_rollout=8, upstream_timeout_s=1.0,
            upstream_health_s=0, default_max_tokens=8, default_temperature=1.0,
            context_check=False, token_continuity=False)
        yield create_app(settings).test_client(), url


def _stream(client, new_rollout, path: str, body: dict) -> tuple[str, str]:
    rid, token, _ = new_rollout()
    resp = client.post(f"/rollout/{rid}{path}", json={**body, "stream": True},
                       headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 200  # the stream had begun: errors come inside it
    return rid, resp.get_data(as_text=True)


CHAT = ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
MESSAGES = ("/v1/messages", {"model": "m", "max_tokens": 8,
                             "messages": [{"role": "user", "content": "x"}]})
RESPONSES = ("/v1/responses", {"model": "m", "input": "x"})


def test_a_whole_stream_is_captured(gateway, new_rollout, redis_client):
    client, _ = gateway
    MODE["kind"] = "whole"
    rid, text = _stream(client, new_rollout, *CHAT)
    assert text.rstrip().endswith("data: [DONE]")
    assert redis_client.llen(keys.rollout_calls(rid)) == 1


@pytest.mark.parametrize("kind", ["close", "hang"])
@pytest.mark.parametrize("route", [CHAT, MESSAGES, RESPONSES], ids=["chat", "messages",
                                                                      "responses"])
def test_a_stream_cut_by_the_server_ends_in_an_error(gateway, new_rollout, redis_client, kind,
                                                     route):
    client, url = gateway
    MODE["kind"] = kind
    rid, text = _stream(client, new_rollout, *route)
    assert "upstream_unavailable" in text, text  # an error event, in the route's shape
    if route is CHAT:
        assert "[DONE]" not in text
        last = json.loads(text.strip().split("\n\n")[-1].removeprefix("data: "))
        assert last["error"]["code"] == "upstream_unavailable"
    elif route is MESSAGES:
        assert "event: error" in text and "message_stop" not in text
    else:
        assert "response.completed" not in text
    assert redis_client.llen(keys.rollout_calls(rid)) == 0  # nothing half captured
    # a server that closed mid-answer may be restarting with its initial weights: stale
    assert redis_client.sismember(keys.upstreams_stale(), url) == (kind == "close")


def test_a_whole_answer_that_stalls_is_slow_not_a_restarted_server(gateway, new_rollout,
                                                                    redis_client):
    """A non-streamed answer whose body stops past ``upstream_timeout_s`` after its headers:
    the agent gets a retryable error and the server is routed around, but, as for a slow
    first byte, it is not marked stale (which would have its weights reloaded)."""
    client, url = gateway
    MODE["kind"] = "slow-body"
    rid, token, _ = new_rollout()
    resp = client.post(f"/rollout/{rid}{CHAT[0]}", json=CHAT[1],
                       headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 503, resp.get_data(as_text=True)
    assert resp.get_json()["error"]["code"] == "upstream_unavailable"
    assert not redis_client.sismember(keys.upstreams_stale(), url)


def test_a_stream_cut_during_a_weight_update_is_the_updates_doing(gateway, new_rollout,
                                                                  redis_client):
    """vLLM ends the calls a weight update aborts; this gateway process may learn of its
    lease's cancel only later: the agent gets the usual retryable cancel, and the server,
    which is fine, is not marked stale."""
    client, url = gateway
    MODE["kind"] = "close"
    rid, token, _ = new_rollout()
    resp = client.post(f"/rollout/{rid}/v1/chat/completions", json={**CHAT[1], "stream": True},
                       headers={"Authorization": f"Bearer {token}"})
    redis_client.set(keys.paused(), "update")  # the call was admitted; then the update began
    try:
        text = resp.get_data(as_text=True)
    finally:
        redis_client.delete(keys.paused())
    assert "cancelled_by_update" in text and "upstream_unavailable" not in text
    assert not redis_client.sismember(keys.upstreams_stale(), url)


def test_a_body_nested_past_what_can_be_sent_on_is_a_400(gateway, new_rollout, redis_client):
    """orjson reads 1024 levels of nesting but writes 254: such a body passes the reader
    and is refused when it would go upstream, as a 400 (a 500 would be retried), with
    its lease released."""
    client, _ = gateway
    rid, token, _ = new_rollout()
    deep = "[" * 300 + "]" * 300
    raw = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": ' \
        + deep + "}"
    resp = client.post(f"/rollout/{rid}/v1/chat/completions", data=raw,
                       content_type="application/json",
                       headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 400, resp.get_json()
    assert "cannot be sent on" in resp.get_json()["error"]["message"]
    assert redis_client.zcard(keys.leases()) == 0


def test_redis_lost_in_the_middle_of_a_stream_ends_it_in_an_error_event(
        tmp_path, monkeypatch, cfg):
    """The gateway reads Redis as a stream goes (the policy version, the pause): when Redis
    is gone past the reconnect budget, the agent gets an error in its protocol's stream,
    not a connection that drops without one."""
    import subprocess
    import sys
    from pathlib import Path

    import redis

    from app.state.connection import connect
    from tests.conftest import free_port
    from workers.rollout.episode import _start_attempt

    # every client this process builds from here on gives up after 5 s of outage
    overrides = json.loads(os.environ["CARRYOVER_OVERRIDES"]) + ["redis.reconnect_s=5"]
    monkeypatch.setenv("CARRYOVER_OVERRIDES", json.dumps(overrides))
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "redis-server"), "--port",
                               str(port), "--bind", "127.0.0.1", "--save", "",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        plain = redis.Redis(port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                plain.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        rid, token = _start_attempt(connect(url), "test-run", "g-redis-lost", 0, 1)
        MODE.update(kind="slow", gap_s=1.0)
        with serving(Server) as upstream:
            settings = GatewaySettings(
                redis_url=url, upstreams=(upstream,), model="m", admin_token="a",
                lease_ttl_s=30, hold=False, hold_timeout_s=1, retry_after_s=1,
                max_body_bytes=1 << 20, max_concurrent_per_rollout=8, upstream_timeout_s=5.0,
                upstream_health_s=0, default_max_tokens=8, default_temperature=1.0,
                context_check=False, token_continuity=False)
            client = create_app(settings).test_client()
            resp = client.post(f"/rollout/{rid}{CHAT[0]}", json={**CHAT[1], "stream": True},
                               headers={"Authorization": f"Bearer {token}"}, buffered=False)
            assert resp.status_code == 200
            server.kill()  # while the server holds its second chunk back
            server.wait(10)
            text = resp.get_data(as_text=True)
    finally:
        MODE.pop("gap_s", None)
        if server.poll() is None:
            server.kill()
            server.wait(10)
    assert "[DONE]" not in text
    last = json.loads(text.strip().split("\n\n")[-1].removeprefix("data: "))
    assert last["error"]["code"] == "state_unavailable", text
