"""The multi-host harness's config (bench/multihost.py) is a valid deployment: every role's
own command, built from it as `carryover serve` builds it, binds the host's namespace
address, and the clients reach each service there; no secret is written into the file. And
what the harness does without building a network: the run directory it refuses to delete,
the secrets it leaves nowhere, what it says when the stack is not up, each host's $TMPDIR,
the root namespace's network as compared, the Celery nodes asked again."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

import bench.multihost as mh
from app.config import load_config
from app.services.commands import command_for
from app.services.rpc_sockets import rpc_dir
from bench.multihost import HOSTS, SECRETS, Cluster, HarnessError, procfile
from tests.multihost import node_stats


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
    assert cfg.inference.urls == (f"http://{infer}:8100",)
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
    # the commands stubbed, so that the test holds on any machine (one without iproute2)
    monkeypatch.setattr(mh.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(mh.shutil, "which", lambda name: f"/usr/sbin/{name}")
    assert "not root" in (mh.missing_capability() or "")
    monkeypatch.setattr(mh.shutil, "which",
                        lambda name: None if name == "ip" else f"/usr/bin/{name}")
    assert "no `ip` command" in (mh.missing_capability() or "")


@pytest.fixture
def no_network(monkeypatch):
    """No `ip` is run: no namespace of this stack is there, the root namespace's network is
    a constant, and any other `ip` call fails the test."""
    def refused(*args, **kwargs):
        raise AssertionError(f"ip {args} run by a unit test")

    monkeypatch.setattr(mh, "_ip", refused)
    monkeypatch.setattr(mh, "namespaces", lambda prefix=mh.PREFIX: [])
    monkeypatch.setattr(mh, "root_network", lambda: "")


def test_up_refuses_to_delete_a_directory_that_is_not_a_run_directory(tmp_path, no_network):
    repo = tmp_path / "repo"
    (repo / "app").mkdir(parents=True)
    (repo / "README.md").write_text("mine")
    cluster = Cluster(run_dir=repo, prefix="co-unit-")
    with pytest.raises(HarnessError) as refused:
        cluster.up()
    message = str(refused.value)
    assert "not deleting" in message and str(repo) in message and "\n" not in message
    assert (repo / "README.md").read_text() == "mine" and (repo / "app").is_dir()
    # a file is refused too
    (tmp_path / "file").write_text("x")
    with pytest.raises(HarnessError, match="not a directory"):
        Cluster(run_dir=tmp_path / "file", prefix="co-unit-").up()
    assert (tmp_path / "file").read_text() == "x"


def test_up_takes_an_empty_or_an_earlier_run_directory(tmp_path, no_network, monkeypatch):
    def no_network_here(self):
        raise RuntimeError("no network in a unit test")

    monkeypatch.setattr(Cluster, "_create_network", no_network_here)
    for prepared in ("empty", "marked", "older"):
        run = tmp_path / prepared
        run.mkdir()
        if prepared == "marked":
            (run / mh.MARKER).write_text("")
            (run / "roll1").mkdir()
        elif prepared == "older":  # an up() before the marker: its multihost.yaml
            (run / "multihost.yaml").write_text("")
            (run / "roll1").mkdir()
        with pytest.raises(RuntimeError, match="no network"):
            Cluster(run_dir=run, prefix="co-unit-").up()
        assert (run / mh.MARKER).exists() and (run / "roll1" / "logs").is_dir(), prepared


def test_a_failed_up_leaves_no_secrets(tmp_path, no_network, monkeypatch):
    def broken(self):
        raise RuntimeError("config not written")

    monkeypatch.setattr(Cluster, "_write_config", broken)
    cluster = Cluster(run_dir=tmp_path / "run", prefix="co-unit-")
    with pytest.raises(RuntimeError, match="config not written"):
        cluster.up()
    assert not cluster.secrets_file.exists()
    assert not cluster.tmp_root.exists()


def test_exec_and_env_without_the_stack_say_it_is_not_up(tmp_path, no_network, monkeypatch,
                                                         capsys):
    monkeypatch.setattr(mh, "RUN_DIR", tmp_path / "run")
    monkeypatch.setattr(mh, "PREFIX", "co-unit-")
    spawned = []
    monkeypatch.setattr(mh.subprocess, "Popen", lambda *a, **k: spawned.append(a))
    assert mh.main(["exec", "trainer", "true"]) == 1
    assert mh.main(["env", "trainer"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") and "not up" in line
                                 for line in err), err
    assert not spawned


def test_status_of_a_stack_without_its_secrets_says_so(tmp_path, monkeypatch):
    cluster = Cluster(run_dir=tmp_path / "run", prefix="co-unit-")
    cluster.run_dir.mkdir()
    cluster.config.write_text("")
    # the namespaces are there (another run directory's stack), this one's secrets are not
    monkeypatch.setattr(mh, "namespaces", lambda prefix=mh.PREFIX: [cluster.ns("trainer")])
    monkeypatch.setattr(Cluster, "link_up", lambda self, host: True)
    monkeypatch.setattr(Cluster, "pids", lambda self, host: [])
    spawned = []
    monkeypatch.setattr(mh.subprocess, "Popen", lambda *a, **k: spawned.append(a))
    out = cluster.status()
    assert f"seen from trainer: no {cluster.secrets_file}: the stack is not up" in out, out
    assert not spawned


def _ip_output(lifetime: int, extra_address: str = "") -> dict[str, str]:
    return {
        "link": "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\\    "
                "link/loopback 00:00:00:00:00:00\n"
                "2: eth0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq state UP\\    "
                "link/ether 52:54:00:12:34:56\n",
        "addr": "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever "
                "preferred_lft forever\n"
                f"2: eth0    inet 10.0.2.15/24 brd 10.0.2.255 scope global dynamic eth0\\"
                f"       valid_lft {lifetime}sec preferred_lft {lifetime}sec\n"
                f"2: eth0    inet6 2001:db8::5/64 scope global dynamic mngtmpaddr \\"
                f"       valid_lft {lifetime + 7}sec preferred_lft {lifetime - 7}sec\n"
                + extra_address,
        "route": "default via 10.0.2.2 dev eth0 proto dhcp src 10.0.2.15 metric 100\n"
                 f"2001:db8::/64 dev eth0 proto ra metric 100 expires {lifetime}sec "
                 "pref medium\n",
    }


def test_the_root_network_compares_without_lifetimes(monkeypatch):
    outputs = _ip_output(86390)

    def ip(*args, check=True):
        kind = next(a for a in args if a in outputs)
        return subprocess.CompletedProcess(["ip", *args], 0, outputs[kind], "")

    monkeypatch.setattr(mh, "_ip", ip)
    before = mh.root_network()
    assert "10.0.2.15/24" in before and "2001:db8::/64" in before
    outputs = _ip_output(86117)  # the DHCP lease and the router advertisement aged
    assert mh.root_network() == before
    # a change that is one still shows
    outputs = _ip_output(86117, "2: eth0    inet 10.77.0.4/24 scope global eth0\\       "
                                "valid_lft forever preferred_lft forever\n")
    assert mh.root_network() != before


def test_each_host_has_a_tmpdir_of_its_own_that_holds_the_rpc_sockets(tmp_path, monkeypatch):
    # as deep as a test session's run directory (tests/multihost.py)
    run = tmp_path / "carryover-test-0123456789ab" / "multihost-test_multihost_partition"
    cluster = Cluster(run_dir=run, prefix="co-unit-")
    run.mkdir(parents=True)
    cluster.secrets_file.write_text(json.dumps({name: "x" for name in SECRETS}))
    dirs = {h.name: Path(cluster.env(h.name)["TMPDIR"]) for h in HOSTS}
    assert len(set(dirs.values())) == len(HOSTS)
    socket_dir = dirs["infer"] / f"carryover-vllm-rpc-{os.getuid()}"
    # vLLM names a socket <dir>/<uuid4> (37 bytes); a socket's path holds 107 at most
    assert len(os.fsencode(socket_dir)) + 37 <= 107, socket_dir
    cluster._make_tmp("infer")
    try:
        monkeypatch.setenv("TMPDIR", str(dirs["infer"]))
        monkeypatch.setattr(tempfile, "tempdir", None)
        assert rpc_dir() == socket_dir  # not the /tmp directory every stack shares
        assert (cluster.tmp_root.stat().st_mode & 0o777) == 0o700
    finally:
        cluster._remove_tmp()
    assert not cluster.tmp_root.exists()


def test_the_celery_nodes_are_asked_until_every_one_answered():
    replies = iter([{}, {"rollout@roll2": {"total": 1}},
                    {"rollout@roll2": {"total": 2}, "trainer@trainer": {"total": 3}},
                    {"rollout@roll1": {"total": 4}}])
    asked = []

    def ask():
        asked.append(1)
        return next(replies)

    want = {"rollout@roll1", "rollout@roll2", "trainer@trainer"}
    out = node_stats(ask, want, bound_s=60, pause_s=0)
    assert set(out) == want and len(asked) == 4
    assert out["rollout@roll2"] == {"total": 2}  # the latest reply kept
    # within its bound: a node that never answers is left out, for the caller to name
    out = node_stats(lambda: {"rollout@roll2": {}}, want, bound_s=0.2, pause_s=0.05)
    assert set(out) == {"rollout@roll2"}
