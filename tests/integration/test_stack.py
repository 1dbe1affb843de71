"""The whole stack from the Procfile: honcho brings every role up, ``carryover status`` says so,
vLLM serves the tiny model with log-probs and token ids, and Ctrl-C leaves nothing running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from tests.conftest import INFERENCE_AUTH, REPO, stack_overrides

BIN = Path(sys.executable).parent


def _env(overrides: list[str]) -> dict[str, str]:
    env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(overrides),
           "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    return env


def _status(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "carryover"), "status"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def _ours(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("CARRYOVER_OVERRIDES") == marker:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_status_names_the_parts_that_are_down(tmp_path):
    result = _status(_env(stack_overrides(tmp_path)))
    assert result.returncode == 1
    assert "down: redis, inference, gateway, worker:rollout, worker:groups, worker:trainer, " \
           "flower" in result.stderr
    assert "DOWN" in result.stdout


@pytest.mark.slow
def test_honcho_brings_up_every_role_and_stops_cleanly(tmp_path):
    # the Procfile names no slot count: the rollout worker takes the config's
    overrides = [*stack_overrides(tmp_path), "services.rollout_concurrency=5"]
    env = _env(overrides)
    marker = env["CARRYOVER_OVERRIDES"]
    log = open(tmp_path / "honcho.log", "wb")  # noqa: SIM115
    honcho = subprocess.Popen([str(BIN / "honcho"), "start"], cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        result = _status(env)
        while result.returncode != 0 and time.monotonic() < deadline:
            assert honcho.poll() is None, (tmp_path / "honcho.log").read_text()[-3000:]
            time.sleep(3)
            result = _status(env)
        assert result.returncode == 0, result.stdout + result.stderr
        rows = [line.split()[:2] for line in result.stdout.splitlines()[1:]]
        assert {part for part, state in rows if state == "up"} == {
            "redis", "inference", "gateway", "worker:rollout", "worker:groups",
            "worker:trainer", "flower"}

        # The tiny model answers a chat completion with log-probs and token ids.
        url = [o.split("=", 1)[1] for o in overrides if o.startswith("inference.urls=")][0]
        url = url.strip("[]")
        resp = requests.post(url + "/v1/chat/completions", json={
            "model": "tiny-qwen2", "messages": [{"role": "user", "content": "abc"}],
            "max_tokens": 4, "logprobs": True, "return_token_ids": True}, timeout=60,
            headers=INFERENCE_AUTH).json()
        choice = resp["choices"][0]
        assert resp["prompt_token_ids"] and len(choice["token_ids"]) >= 1
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        assert all(item["logprob"] <= 0 for item in choice["logprobs"]["content"])
        assert len(_ours(marker)) >= 7
        assert "concurrency: 5 (thread)" in (tmp_path / "honcho.log").read_text()
    finally:
        os.killpg(honcho.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        honcho.wait(timeout=60)
        log.close()
    deadline = time.monotonic() + 15
    while _ours(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [(p.pid, " ".join(p.cmdline())[:80]) for p in _ours(marker)]
    assert left == [], f"still running after Ctrl-C: {left}"


def test_a_port_already_in_use_is_a_clear_start_error(tmp_path):
    import socket

    from app.config import load_config
    from app.services.supervisor import StartupError, Supervisor

    cfg = load_config(None, stack_overrides(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", int(cfg.services.flower_port)))
        busy.listen()
        sup = Supervisor(cfg, log_dir=tmp_path / "logs")
        with pytest.raises(StartupError, match=r"flower: port \d+ on 127.0.0.1 is already in "
                                               r"use.*services.flower_port"):
            sup.start(["flower"])
    assert sup.procs == {}  # nothing was started
