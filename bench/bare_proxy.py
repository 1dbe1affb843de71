"""The reference point for the gateway benchmark: a bare Flask proxy under gunicorn.

It forwards the body to the stand-in and returns the answer, nothing else: no
authentication, admission, lease, capture or validation. What it costs over calling the
stand-in directly is the floor that Flask + gunicorn + one upstream call set on this
machine; the gateway's figures are read against it. Serve with gunicorn:
``gunicorn -k gevent 'bench.bare_proxy:create_app("http://127.0.0.1:PORT")'``.
"""

from __future__ import annotations

import http.client
import threading
from urllib.parse import urlsplit

from flask import Flask, Response, request


def create_app(upstream: str) -> Flask:
    u = urlsplit(upstream)
    local = threading.local()  # one keep-alive connection per greenlet (agent connection)
    app = Flask(__name__)

    @app.post("/rollout/<rollout_id>/v1/chat/completions")
    def chat(rollout_id: str) -> Response:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(u.hostname, u.port)
        conn.request("POST", "/v1/chat/completions", request.get_data(),
                     {"Content-Type": "application/json"})
        answer = conn.getresponse()
        return Response(answer.read(), status=answer.status, mimetype="application/json")

    @app.get("/health")
    def health() -> str:
        return ""

    return app
