"""Security defaults: loopback binds, JSON-only Celery, Redis password end to end, agent and
admin tokens kept apart and never written to logs, the inference servers' /v1 behind a key,
and no server beyond loopback without its dev routes guarded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import redis
import requests

from app.config import load_config
from app.config.errors import ConfigError
from app.services.commands import command_for
from app.state import keys
from app.state.connection import connect, resolve_redis_url
from tests.conftest import INFERENCE_AUTH, REPO, free_port, standin_gateway


def test_every_service_binds_to_loopback_by_default():
    cfg = load_config(None, [])
    argv = {role: command_for(cfg, role).argv for role in
            ("redis", "inference", "flower")}
    assert argv["redis"][argv["redis"].index("--bind") + 1] == "127.0.0.1"
    assert "--protected-mode" in argv["redis"]
    assert argv["inference"][argv["inference"].index("--host") + 1] == "127.0.0.1"
    assert "--address=127.0.0.1" in argv["flower"]
    assert cfg.gateway.host == "127.0.0.1"  # gunicorn.conf.py binds gateway.host


def test_celery_accepts_json_only():
    from app.celery_app import celery_app

    conf = celery_app.conf
    assert conf.accept_content == ["json"] and conf.result_accept_content == ["json"]
    assert conf.task_serializer == "json" and conf.result_serializer == "json"


def test_redis_password_end_to_end(tmp_path, tmp_root):
    """A password-protected embedded Redis: refused without the password; the gateway and a
    Celery worker given it through the config work against it."""
    port = free_port()
    password = "s3cret/with:odd@chars"
    overrides = [f"redis.port={port}", f"redis.dir={tmp_path / 'redis'}",
                 f"redis.password={password}"]
    cfg = load_config(None, overrides)
    url = resolve_redis_url(cfg)
    server = subprocess.Popen(command_for(cfg, "redis").argv, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        client = connect(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        # the gateway, configured with the password, authenticates and captures
        from workers.rollout.episode import _start_attempt

        rid, token = _start_attempt(client, "pw-run", "pw-g0", 0, 1)
        with standin_gateway(tmp_root, "redis-password", *overrides) as (gw, _, _):
            r = requests.post(f"{gw}/rollout/{rid}/v1/chat/completions", timeout=10,
                              headers={"Authorization": f"Bearer {token}"},
                              json={"messages": [{"role": "user", "content": "abc"}]})
            assert r.status_code == 200, r.text
        assert client.llen(keys.rollout_calls(rid)) == 1
        # a Celery worker reaches the broker with the password from the same config
        env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(overrides),
               "PYTHONPATH": str(REPO)}
        env.pop("REDIS_URL", None)
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "app", "worker", "-Q", "groups", "-n",
             "pw@%h", "--pool", "solo"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        from celery import Celery

        probe = Celery(broker=url, backend=url)
        deadline = time.monotonic() + 60
        while not probe.control.ping(timeout=1.0):
            assert worker.poll() is None, "worker exited"
            assert time.monotonic() < deadline, "worker never answered through the password Redis"
    finally:
        if worker is not None:
            os.killpg(worker.pid, 9)
            worker.wait(10)
        server.terminate()
        server.wait(10)


def test_tokens_never_reach_the_logs(redis_client, tmp_root, new_rollout):
    with standin_gateway(tmp_root, "token-logs") as (gw, _, _):
        rid, token, base = new_rollout(gw)
        ok = requests.post(base + "/chat/completions", timeout=10,
                           headers={"Authorization": f"Bearer {token}"},
                           json={"messages": [{"role": "user", "content": "abc"}]})
        bad = requests.post(base + "/chat/completions", timeout=10,
                            headers={"Authorization": f"Bearer {token}x"},
                            json={"messages": [{"role": "user", "content": "abc"}]})
        admin_with_agent_token = requests.post(gw + "/admin/pause", timeout=10,
                                               headers={"Authorization": f"Bearer {token}"})
    assert ok.status_code == 200 and bad.status_code == 401
    assert admin_with_agent_token.status_code == 401  # agent tokens are not admin tokens
    admin = os.environ["CARRYOVER_ADMIN_TOKEN"]
    assert admin != token
    for path in (tmp_root / "logs").glob("*.log"):
        text = path.read_text(errors="replace")
        assert token not in text, f"agent token in {path}"
        assert admin not in text, f"admin token in {path}"
    # Redis holds only the token's hash
    assert token not in json.dumps(redis_client.hgetall(keys.rollout(rid)))


def test_the_inference_servers_openai_routes_need_their_key(vllm_service, cfg):
    """/v1 on the inference server asks for the key the gateway and the trainer send:
    an agent that found the server's port cannot bypass the gateway's leases, capture and
    sampling rules."""
    body = {"model": cfg.inference.served_model_name, "prompt": "abc", "max_tokens": 1}
    bare = requests.post(vllm_service + "/v1/completions", json=body, timeout=30)
    assert bare.status_code == 401, bare.text
    keyed = requests.post(vllm_service + "/v1/completions", json=body, timeout=30,
                          headers=INFERENCE_AUTH)
    assert keyed.status_code == 200, keyed.text
    # the key travels in the server's environment, never on its command line (ps shows it)
    command = command_for(cfg, "inference")
    assert command.env["VLLM_API_KEY"] == "test-inference-key"
    assert "test-inference-key" not in " ".join(command.argv)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "inference.internal"])
def test_an_inference_server_beyond_loopback_needs_its_dev_routes_guarded(host):
    with pytest.raises(ConfigError, match="inference.host: value .* dev routes, which no API "
                                          "key guards"):
        load_config(None, [f"inference.host={host}"])
    cfg = load_config(None, [f"inference.host={host}",
                             "inference.dev_routes_guard=a network policy admits the trainer only"])
    assert cfg.inference.host == host
    for loopback in ("127.0.0.1", "localhost", "::1"):
        load_config(None, [f"inference.host={loopback}"])
