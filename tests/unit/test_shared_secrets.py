"""A role bound beyond loopback serves other hosts, so its secret must be one every host
knows: started without it (config or environment), the role is refused with one line naming
the key to set."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import ConfigError, load_config
from app.services.commands import command_for

GUARD = "inference.dev_routes_guard=a network policy admits the gateway and trainer only"

# role -> (its bind key, the secret's key, the secret's variable)
ROLES = {
    "redis": ("redis.host", "redis.password", "REDIS_PASSWORD"),
    "inference": ("inference.host", "inference.api_key", "CARRYOVER_INFERENCE_API_KEY"),
    "gateway": ("gateway.host", "gateway.admin_token", "CARRYOVER_ADMIN_TOKEN"),
}


@pytest.fixture(autouse=True)
def _no_secrets_in_the_environment(monkeypatch):
    for _, _, env in ROLES.values():
        monkeypatch.delenv(env, raising=False)


def _cfg(*overrides: str):
    return load_config(None, [GUARD, *overrides])


@pytest.mark.parametrize("role", sorted(ROLES))
@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "node-1.internal"])
def test_a_role_beyond_loopback_without_its_shared_secret_is_refused(role, host):
    bind, secret, env = ROLES[role]
    with pytest.raises(ConfigError) as err:
        command_for(_cfg(f"{bind}={host}"), role)
    [line] = err.value.problems
    assert line.startswith(f"{secret}: not set, and {bind} {host!r} opens the {role} server "
                           "beyond this machine")
    assert f"set {secret} (or ${env})" in line


@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_secret_from_the_config_or_the_environment_lets_it_start(role, monkeypatch):
    bind, secret, env = ROLES[role]
    command_for(_cfg(f"{bind}=0.0.0.0", f"{secret}=one-for-every-host"), role)
    monkeypatch.setenv(env, "one-for-every-host")
    command_for(_cfg(f"{bind}=0.0.0.0"), role)


@pytest.mark.parametrize("role", sorted(ROLES))
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_a_role_on_loopback_needs_no_shared_secret(role, host):
    bind, _, _ = ROLES[role]
    command_for(_cfg(f"{bind}={host}"), role)


def test_redis_bound_to_loopback_and_another_address_needs_its_password():
    with pytest.raises(ConfigError, match=r"^redis\.password: not set"):
        command_for(_cfg("redis.host=127.0.0.1 10.1.2.3"), "redis")
    command_for(_cfg("redis.host=127.0.0.1 -::1"), "redis")


def test_an_external_redis_is_not_started_here_and_not_checked():
    cmd = command_for(_cfg("redis.host=0.0.0.0", "redis.url=redis://10.1.2.3:6379/0"), "redis")
    assert cmd.idle_reason


def test_carryover_serve_refuses_it_with_one_line(capsys):
    from app.cli import main

    assert main(["serve", "gateway", GUARD, "gateway.host=0.0.0.0"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("config error: gateway.admin_token: not set, and gateway.host")


def test_carryover_up_refuses_it_before_any_role_starts(tmp_path):
    from app.services.supervisor import Supervisor

    sup = Supervisor(_cfg("redis.host=0.0.0.0"), log_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^redis\.password: not set"):
        sup.start()
    assert sup.procs == {}


def test_the_gateway_started_by_gunicorn_itself_refuses_it_too(monkeypatch):
    """The Procfile starts the gateway with gunicorn, not through ``carryover serve``."""
    import json
    import runpy

    from app.config.loader import REPO_ROOT, env_overrides

    conf = str(REPO_ROOT / "gateway" / "gunicorn.conf.py")
    monkeypatch.setenv("CARRYOVER_OVERRIDES", json.dumps([*env_overrides(), GUARD,
                                                          "gateway.host=0.0.0.0"]))
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(conf)
    assert str(stopped.value.code).startswith(
        "config error: gateway.admin_token: not set, and gateway.host '0.0.0.0'")
    monkeypatch.setenv("CARRYOVER_ADMIN_TOKEN", "one-for-every-host")
    assert runpy.run_path(conf)["bind"].startswith("0.0.0.0:")


@pytest.mark.parametrize("role", ["gateway", "trainer"])
def test_a_role_calling_a_server_on_another_host_needs_the_servers_key(role, monkeypatch):
    far = "inference.urls=[http://127.0.0.1:8100,http://10.1.2.3:8100]"
    with pytest.raises(ConfigError) as err:
        command_for(_cfg(far), role)
    [line] = err.value.problems
    assert line.startswith("inference.api_key: not set, and inference.urls names a server on "
                           f"another host (http://10.1.2.3:8100), which would refuse the "
                           f"{role}'s calls")
    command_for(_cfg(far, "inference.api_key=the-servers-key"), role)
    command_for(_cfg("inference.urls=[http://127.0.0.1:8100,http://localhost:8101]"), role)
    monkeypatch.setenv("CARRYOVER_INFERENCE_API_KEY", "the-servers-key")
    command_for(_cfg(far), role)


def test_the_roles_that_call_no_server_need_no_key():
    far = "inference.urls=[http://10.1.2.3:8100]"
    for role in ("rollout", "groups", "flower", "redis"):
        command_for(_cfg(far), role)


def test_a_gateway_beyond_loopback_and_before_a_far_server_is_told_both():
    with pytest.raises(ConfigError) as err:
        command_for(_cfg("gateway.host=0.0.0.0", "inference.urls=[http://10.1.2.3:8100]"),
                    "gateway")
    assert [line.split(":")[0] for line in err.value.problems] == ["gateway.admin_token",
                                                                   "inference.api_key"]


def test_the_trainer_worker_started_by_celery_itself_refuses_it_too(monkeypatch, tmp_path):
    """The Procfile starts the trainer with plain ``celery``: it stops before taking a task,
    with the same line, instead of being refused by the far servers at its first load."""
    import json
    import os
    import subprocess
    import sys

    from app.config.loader import REPO_ROOT, env_overrides

    env = {k: v for k, v in os.environ.items() if k != "CARRYOVER_INFERENCE_API_KEY"}
    env["CARRYOVER_OVERRIDES"] = json.dumps([*env_overrides(),
                                             "inference.urls=[http://10.1.2.3:8100]"])
    celery = str(Path(sys.executable).parent / "celery")
    argv = [celery, "-A", "app", "worker", "-Q", "trainer", "-n", f"trainer-check-{os.getpid()}@%h",
            "--pool", "solo"]
    try:
        done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("the trainer worker started without the far servers' key") from exc
    assert done.returncode != 0
    assert "config error: inference.api_key: not set, and inference.urls names a server on " \
           "another host (http://10.1.2.3:8100)" in done.stderr
