"""A gateway stopped with SIGTERM (a restart, ``carryover up`` ending) answers the request it
is serving and does not wait for idle keep-alive connections: an agent's SDK keeps one open
between its calls, and gunicorn's gevent worker waited for it for the whole
``graceful_timeout``."""

from __future__ import annotations

import http.client
import json
import threading
import time

from tests.conftest import standin_gateway


def test_a_stop_answers_the_call_in_flight_and_does_not_wait_for_idle_connections(
        redis_service, tmp_root, new_rollout, monkeypatch):
    # a long grace, so that waiting it out cannot pass for a prompt stop
    monkeypatch.setenv("GUNICORN_CMD_ARGS", "--graceful-timeout 60")
    with standin_gateway(tmp_root, "gateway-stop") as (url, master, _):
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
                         body=json.dumps({"messages": [{"role": "user", "content": "a"}],
                                          "standin_delay_s": 3}),
                         headers={"Authorization": f"Bearer {token}",
                                  "Content-Type": "application/json"})
            resp = call.getresponse()
            out["status"], out["body"] = resp.status, resp.read()

        thread = threading.Thread(target=slow_call)
        thread.start()
        time.sleep(1)  # the call is in the stand-in
        t = time.monotonic()
        master.terminate()
        master.wait(timeout=30)  # well inside the 60 s grace
        stopped_s = time.monotonic() - t
        thread.join(30)
        assert out["status"] == 200, out["body"]  # answered, not cut
        assert call.sock.recv(1) == b""  # then its connection was closed
        assert idle.sock.recv(1) == b""  # the idle one was closed, not left hanging
        assert stopped_s < 30
