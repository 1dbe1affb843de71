"""An instant OpenAI-compatible upstream for benchmarks and fault tests.

Answers ``/v1/chat/completions`` and ``/v1/completions`` with token ids and log-probs (so the
gateway's capture path runs) without a model. A request may carry ``standin_delay_s`` to be
slow on purpose (``standin_overflow: true``: refused as vLLM refuses a prompt too long),
``POST /standin/health {"ok": false}`` makes ``/health`` answer 503 (or ``"status"``),
``GET /standin/last`` returns the last request body it received, vLLM's sleep routes
behave as ``POST /standin/sleep`` says, and its pause, weight-load and weight-version routes
answer as vLLM's do, each call recorded in order (``GET /standin/events``). State is per
worker process: tests run it with one. Serve
with gunicorn: ``gunicorn -k gevent 'bench.standin:create_app()'``.
"""

from __future__ import annotations

import os
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
            prompt = body.get("prompt")
            if body.get("prompt_logprobs") is not None and isinstance(prompt, list):
                # the weight-sync probe's question: every prompt token at -1 (a test that
                # drives a whole step through a stand-in sets a tolerance that admits it)
                choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": -1.0}}
                                                      for t in prompt[1:]]
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
    # makes /sleep work, answer 200 while staying awake, or answer 404 (no sleep mode).
    # As in vLLM, /wake_up?tags=weights wakes only the weights: the engine is awake once
    # no tag sleeps.
    sleep: dict = {"mode": "ok", "tags": set()}
    events: list[str] = []  # the engine-control routes in the order they were called

    @app.post("/sleep")
    def do_sleep():
        events.append("sleep")
        if sleep["mode"] == "refused":
            return ("Not Found", 404)
        if sleep["mode"] == "ok":
            sleep["tags"] = {"weights", "kv_cache"}
        return ""

    @app.post("/wake_up")
    def wake_up():
        tags = request.args.getlist("tags")
        events.append("wake_up" + (":" + ",".join(tags) if tags else ""))
        sleep["tags"] = sleep["tags"] - set(tags) if tags else set()
        return jsonify({"status": "sleeping" if sleep["tags"] else "awake"})

    @app.get("/is_sleeping")
    def is_sleeping():
        return jsonify({"is_sleeping": bool(sleep["tags"])})

    @app.post("/standin/sleep")
    def set_sleep():
        body = request.get_json(force=True)
        sleep["mode"] = body.get("mode", sleep["mode"])
        if "asleep" in body:  # left asleep, as by a trainer that died mid-update
            sleep["tags"] = {"weights", "kv_cache"} if body["asleep"] else set()
        if body.get("clear_events"):
            events.clear()
        return ""

    @app.get("/standin/events")
    def get_events():
        return jsonify(events)

    # vLLM's weight routes, as the trainer drives them: a load (slow on purpose with
    # POST /standin/reload {"delay_s": s}), the prefix-cache reset, the weight version
    engine = {"paused": False, "reload_delay_s": 0.0, "version": "default"}

    @app.post("/collective_rpc")
    def collective_rpc():
        body = request.get_json(force=True)
        events.append("collective_rpc:" + body["method"])
        time.sleep(engine["reload_delay_s"])
        path = (body.get("kwargs") or {}).get("weights_path")
        if path is not None and not os.path.isdir(path):  # as vLLM fails to load them
            return jsonify({"error": f"weights path {path} does not exist"}), 500
        return jsonify({"results": [None]})

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():
        events.append("reset_prefix_cache")
        return jsonify({"success": True})

    @app.post("/update_weight_version")
    def update_weight_version():
        engine["version"] = request.get_json(force=True)["new_version"]
        return jsonify({"success": True, "new_version": engine["version"]})

    @app.get("/weight_info")
    def weight_info():
        return jsonify({"weight_version": engine["version"]})

    @app.post("/standin/reload")
    def set_reload():
        engine["reload_delay_s"] = float(request.get_json(force=True)["delay_s"])
        return ""

    @app.post("/pause")
    def pause():
        events.append("pause")
        engine["paused"] = True
        return jsonify({"status": "paused"})

    @app.post("/resume")
    def resume():
        events.append("resume")
        engine["paused"] = False
        return jsonify({"status": "resumed"})

    @app.get("/is_paused")
    def is_paused():
        # as vLLM's: sleeping pauses the scheduler, and only a whole wake resumes it
        return jsonify({"is_paused": engine["paused"] or bool(sleep["tags"])})

    healthy = {"ok": True, "status": 503}

    @app.get("/health")
    def health():
        return ("", 200) if healthy["ok"] else ("engine dead", healthy["status"])

    @app.post("/standin/health")
    def set_health():  # {"ok": false, "status": 502}: a proxy with no server behind it
        body = request.get_json(force=True)
        healthy.update(ok=bool(body.get("ok")), status=int(body.get("status", 503)))
        return ""

    return app
