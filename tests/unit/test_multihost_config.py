"""The multi-host harness's config (bench/multihost.py) is a valid deployment: every role's
own command, built from it as `carryover serve` builds it, binds the host's namespace
address, and the clients reach each service there; no secret is written into the file."""

from __future__ import annotations

import json

from app.config import load_config
from app.services.commands import command_for
from bench.multihost import HOSTS, SECRETS, Cluster, procfile


def test_config_places_each_service_on_its_host(tmp_path, monkeypatch):
    cluster = Cluster(run_dir=tmp_path / "run", prefix="co-unit-")
    cluster.run_dir.mkdir()
    cluster.secrets_file.write_text(json.dumps({name: "s3cret-" + name for name in SECRETS}))
    for name, value in json.loads(cluster.secrets_file.read_text()).items():
        monkeypatch.setenv(name, value)  # as each host's roles get them
    cluster._write_config()
    text = cluster.config.read_text()
    assert "s3cret" not in text
    cfg = load_config(cluster.config)  # validated: the inference host needs its guard
    redis, infer = cluster.address("redis"), cluster.address("infer")
    assert not redis.startswith("127.") and not infer.startswith("127.")
    argv = command_for(cfg, "redis").argv
    assert argv[argv.index("--bind") + 1] == redis
    assert argv[argv.index("--dir") + 1].startswith(str(cluster.host_dir("redis")))
    argv = command_for(cfg, "inference").argv
    assert argv[argv.index("--host") + 1] == infer
    assert cfg.inference.urls == [f"http://{infer}:8100"]
    assert cfg.gateway.host == infer and cfg.gateway.url == cluster.gateway_url
    assert str(cfg.trainer.weights_dir).startswith(str(cluster.run_dir / "shared"))
    # the demo's settings underneath
    assert cfg.actor_rollout_ref.rollout.n == 8 and cfg.services.rollout_concurrency == 256


def test_hosts_run_procfile_roles_and_the_outside_host_gets_nothing(tmp_path):
    roles = procfile()
    for host in HOSTS:
        assert set(host.roles) <= set(roles), host
    cluster = Cluster(run_dir=tmp_path / "run", prefix="co-unit-")
    cluster.run_dir.mkdir()
    cluster.secrets_file.write_text(json.dumps({name: "x" for name in SECRETS}))
    env = cluster.env("outside")
    assert not set(env) & {*SECRETS, "CARRYOVER_CONFIG", "CARRYOVER_OVERRIDES"}
    assert set(SECRETS) <= set(cluster.env("roll1"))
    # one veth port name per host fits the kernel's 15 characters
    assert all(len(cluster.port_name(h.name)) <= 15 for h in HOSTS)


def test_a_machine_without_the_capability_is_told_what_it_lacks(monkeypatch):
    import bench.multihost as mh

    monkeypatch.setattr(mh.os, "geteuid", lambda: 1000)
    assert "not root" in (mh.missing_capability() or "")
    real = mh.shutil.which
    monkeypatch.setattr(mh.shutil, "which", lambda name: None if name == "ip" else real(name))
    assert "no `ip` command" in (mh.missing_capability() or "")
