"""An instant OpenAI-compatible upstream for benchmarks and fault tests.

Answers ``/v1/chat/completions`` and ``/v1/completions`` with token ids and log-probs (so the
gateway's capture path runs) without a model. A request may carry ``standin_delay_s`` to be
slow on purpose (``standin_overflow: true``: refused as vLLM refuses a prompt too long),
``POST /standin/health {"ok": false}`` makes ``/health`` answer 503,
``GET /standin/last`` returns the last request body it received, and vLLM's sleep routes
behave as ``POST /standin/sleep`` says (per worker process: tests run it with one). Serve
with gunicorn: ``gunicorn -k gevent 'bench.standin:create_app()'``.
"""

from __future__ import annotations

import time

from flask import Flask, jsonify, request


def create_app() -> Flask:
    app = Flask(__name__)

    last: dict = {}

    def answer(endpoint: str):
        body = request.get_json(force=True)
        last["body"] = body
        if body.get("standin_overflow"):  # vLLM's own refusal of a prompt too long
            return jsonify({"error": {
                "message": "This model's maximum context length is 512 tokens. However, you "
                           "requested 900 tokens (890 in the messages, 10 in the completion).",
                "type": "BadRequestError", "param": None, "code": 400}}), 400
        delay = float(body.get("standin_delay_s", 0))
        if delay:
            time.sleep(delay)
        n = int(body.get("max_tokens") or 4)
        ids = [3 + (i % 4) for i in range(n)]
        lps = [-0.5 - 0.01 * i for i in range(n)]
        if endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": "abcd"[:n]},
                      "logprobs": {"content": [{"token": "a", "logprob": v, "bytes": [97],
                                                "top_logprobs": []} for v in lps]},
                      "finish_reason": "length", "token_ids": ids}
            out = {"object": "chat.completion", "prompt_token_ids": [1, 2, 3]}
        else:
            choice = {"index": 0, "text": "abcd"[:n], "finish_reason": "length",
                      "logprobs": {"token_logprobs": lps, "tokens": ["a"] * n},
                      "token_ids": ids, "prompt_token_ids": [1, 2, 3]}
            out = {"object": "text_completion"}
        out.update({"id": "standin", "created": int(time.time()), "model": body.get("model"),
                    "choices": [choice],
                    "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}})
        return jsonify(out)

    @app.post("/v1/chat/completions")
    def chat():
        return answer("chat")

    @app.post("/v1/completions")
    def completions():
        return answer("completions")

    @app.get("/standin/last")
    def last_body():
        return jsonify(last.get("body"))

    # vLLM's sleep-mode routes; POST /standin/sleep {"mode": "ok" | "ignored" | "refused"}
    # makes /sleep work, answer 200 while staying awake, or answer 404 (no sleep mode)
    sleep = {"mode": "ok", "asleep": False}

    @app.post("/sleep")
    def do_sleep():
        if sleep["mode"] == "refused":
            return ("Not Found", 404)
        sleep["asleep"] = sleep["mode"] == "ok"
        return ""

    @app.post("/wake_up")
    def wake_up():
        sleep["asleep"] = False
        return ""

    @app.get("/is_sleeping")
    def is_sleeping():
        return jsonify({"is_sleeping": sleep["asleep"]})

    @app.post("/standin/sleep")
    def set_sleep():
        sleep["mode"] = request.get_json(force=True)["mode"]
        return ""

    healthy = {"ok": True}

    @app.get("/health")
    def health():
        return ("", 200) if healthy["ok"] else ("engine dead", 503)

    @app.post("/standin/health")
    def set_health():
        healthy["ok"] = bool(request.get_json(force=True).get("ok"))
        return ""

    return app
