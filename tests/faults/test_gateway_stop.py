"""A gateway stopped with SIGTERM (a restart, ``carryover up`` ending) answers the request it
is serving, with ``Connection: close``, and does not wait for idle keep-alive connections:
an agent's SDK keeps one open between its calls, and gunicorn's gevent worker waited for it
for the whole ``graceful_timeout``."""

from __future__ import annotations

import http.client
import json
import threading
import time

import requests

from tests.conftest import standin_gateway


def test_a_stop_answers_the_call_in_flight_and_does_not_wait_for_idle_connections(
        redis_service, tmp_root, new_rollout, monkeypatch):
    # a long grace and a longer keep-alive, so that waiting either out cannot pass for a
    # prompt stop
    monkeypatch.setenv("GUNICORN_CMD_ARGS", "--graceful-timeout 60 --keep-alive 120")
    with standin_gateway(tmp_root, "gateway-stop") as (url, master, upstreams):
        host, port = url.removeprefix("http://").split(":")
        idle = http.client.HTTPConnection(host, int(port), timeout=30)
        idle.request("GET", "/healthz")
        first = idle.getresponse()
        assert first.status == 200 and first.read() and not first.will_close  # kept open

        rid, token, base = new_rollout(url)
        call = http.client.HTTPConnection(host, int(port), timeout=30)
        out: dict = {}

        def slow_call() -> None:
            call.request("POST", base.removeprefix(url) + "/chat/completions",
                         body=json.dumps({"messages": [{"role": "user", "content": rid}],
                                          "standin_delay_s": 8}),
                         headers={"Authorization": f"Bearer {token}",
                                  "Content-Type": "application/json"})
            resp = call.getresponse()
            out["status"], out["close"], out["body"] = resp.status, resp.will_close, resp.read()

        thread = threading.Thread(target=slow_call)
        thread.start()
        deadline = time.monotonic() + 30
        while (requests.get(upstreams[0][0] + "/standin/last", timeout=5).json() or {}).get(
                "messages", [{}])[0].get("content") != rid:  # the call is in the stand-in
            assert time.monotonic() < deadline, "the call never reached the stand-in"
            time.sleep(0.05)
        t = time.monotonic()
        master.terminate()
        master.wait(timeout=50)
        stopped_s = time.monotonic() - t
        thread.join(30)
        assert out["status"] == 200, out["body"]  # answered, not cut
        assert out["close"]  # "Connection: close": the client does not reuse the connection
        assert idle.sock.recv(1) == b""  # the idle one was closed, not left hanging
        assert stopped_s < 30  # not the 60 s grace
