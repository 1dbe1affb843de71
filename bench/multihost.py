"""A multi-host stack on one machine: each host a Linux network namespace of its own.

Hosts, as a deployment spreads the roles (``HOSTS``): Redis; the inference server and the
gateway; two rollout hosts (a groups and a rollout worker each); the trainer (its worker, and
the driver when one is run there); and an ``outside`` host that runs nothing and holds no
credentials. A ``<prefix>sw`` namespace holds a Linux bridge with one veth pair into each
host namespace, addresses from ``10.77.0.0/24``; nothing is created or changed in the root
namespace, so a stack on the default ports there is not touched. A partition is a host's
link set down on the switch side (:meth:`Cluster.cut`, :meth:`Cluster.heal`), or one pair of
hosts that no longer reach each other while both reach the rest (:meth:`Cluster.cut_pair`,
:meth:`Cluster.heal_pair`).

Each role is its own Procfile line, run in its host's namespace (and a UTS namespace, so
``%h`` and the hostname the roles record are the host's), under ``nice -n 19``, with one
config written into the run directory: the base config (``config/demo.yaml``) plus every
address, the Redis password on its namespace address, the gateway's admin token and the
inference server's API key (those three in the environment, never in the file). Namespaces
share the file system: each host's files (logs, the Redis data, the trainer's checkpoints and
runs) are kept apart in the run directory, and its ``$TMPDIR`` in a short path of its own
under /tmp (:meth:`Cluster.tmp_dir`: the inference server's RPC sockets go there, and a run
directory's path is often too long for a socket's); what the hosts share is the repository
(the model) and ``shared/weights`` (the weight exports of ``weight_sync: disk``).

``scripts/multihost.sh up|down|status|cut HOST [PEER]|heal HOST [PEER]|exec HOST CMD...``
drives it by hand; the multi-host tests use :class:`Cluster` directly. Needs root and ``ip``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
FAMILY = "co-"  # every stack's namespaces start so (`down --all` finds them)
PREFIX = os.environ.get("CARRYOVER_MH_PREFIX", FAMILY)
SUBNET = os.environ.get("CARRYOVER_MH_SUBNET", "10.77.0")  # a /24
RUN_DIR = Path(os.environ.get("CARRYOVER_MH_DIR")
               or Path(tempfile.gettempdir()) / "carryover-multihost")
BASE_CONFIG = Path(os.environ.get("CARRYOVER_MH_CONFIG") or REPO / "config" / "demo.yaml")
# A loaded 2-core machine under nice 19 has taken minutes to start the inference server.
START_TIMEOUT_S = float(os.environ.get("CARRYOVER_MH_START_TIMEOUT_S", "900"))
STOP_GRACE_S = 20.0
BRIDGE = "br0"
# A MAC address no host has: a frame sent to it is flooded by the bridge and dropped by every
# host, so a pair cut by it loses its packets silently (Cluster.cut_pair).
NOWHERE_MAC = "02:00:00:00:00:00"
# A run directory holds this file from the moment up() makes it: up() deletes a directory it
# finds only where it is empty or this harness's (multihost.yaml: one an older up() wrote).
MARKER = ".carryover-multihost"


@dataclass(frozen=True)
class Host:
    name: str
    octet: int  # its address: SUBNET.octet
    roles: tuple[str, ...]  # Procfile roles it runs
    credentials: bool = True  # gets the config and the secrets


HOSTS = (
    Host("redis", 2, ("redis",)),
    Host("infer", 3, ("inference", "gateway")),
    Host("roll1", 4, ("groups", "rollout")),
    Host("roll2", 5, ("groups", "rollout")),
    Host("trainer", 6, ("trainer",)),
    Host("outside", 9, (), credentials=False),
)
# A second inference server on a host of its own, for the tests of several servers behind one
# gateway: off by default (a vLLM server more to start and feed on every update).
INFER2 = Host("infer2", 7, ("inference",))
ALL_HOSTS = (*HOSTS[:2], INFER2, *HOSTS[2:])  # the order they start in
# gunicorn's settings in its environment, read after its config file: an access log line per
# answered request, "[time] status seconds path" (Cluster's access_log)
ACCESS_LOG = "--access-logfile - --access-logformat '%(t)s %(s)s %(L)s %(U)s'"
BY_NAME = {h.name: h for h in ALL_HOSTS}
# Celery node names the stack is up with (%h is the host's name)
WORKER_ROLES = ("groups", "rollout", "trainer")
SECRETS = ("REDIS_PASSWORD", "CARRYOVER_ADMIN_TOKEN", "CARRYOVER_INFERENCE_API_KEY")
REDIS_PORT, INFERENCE_PORT, GATEWAY_PORT = 6390, 8100, 8200
# the hosts an inference server's port admits besides its own: the trainer loads weights
# through its dev routes; the gateway, beside the first server, reaches infer2 from its host
ADMITTED_TO_INFERENCE = {"infer": ("trainer",), "infer2": ("trainer", "infer")}


class HarnessError(RuntimeError):
    pass


def procfile() -> dict[str, list[str]]:
    """The Procfile's command per role."""
    out = {}
    for line in (REPO / "Procfile").read_text().splitlines():
        if ":" in line and not line.lstrip().startswith("#"):
            role, cmd = line.split(":", 1)
            out[role.strip()] = shlex.split(cmd)
    return out


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The network namespaces whose names start with ``prefix``."""
    out = _ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


# what changes on its own while a stack runs: a DHCP address's lifetimes, a route's expiry
_LIFETIME = re.compile(r"\s+(?:valid_lft|preferred_lft|expires)\s+\S+")


def root_network() -> str:
    """The root namespace's links, addresses and routes (what the harness must not change),
    without what changes on its own: per link its name and flags, per address its link,
    family and address/prefix, each route without its expiry."""
    links = _ip("-o", "link", "show", check=False).stdout.splitlines()
    addrs = _ip("-o", "addr", "show", check=False).stdout.splitlines()
    routes = _ip("route", "show", "table", "all", check=False).stdout.splitlines()
    # a link's name and flags, without its counters or state changes' noise
    names = sorted(line.split(" link/")[0].split(" qdisc")[0] for line in links)
    # "2: eth0    inet 10.0.0.5/24 brd ... valid_lft 86313sec preferred_lft 86313sec"
    addresses = sorted(" ".join(line.split()[1:4]) for line in addrs if len(line.split()) >= 4)
    kept = sorted(" ".join(_LIFETIME.sub("", line).split()) for line in routes)
    return "\n".join([*names, *addresses, *kept])


def stack_prefixes(family: str = FAMILY) -> list[str]:
    """The prefixes of the stacks whose namespaces are there (``co-``, ``co-t<pid>-``)."""
    out = set()
    for name in namespaces(family):
        for suffix in ("sw", *BY_NAME):
            if name.endswith(suffix):
                out.add(name[:-len(suffix)])
    return sorted(out)


def missing_capability() -> str | None:
    """Why this machine cannot build the harness (None: it can): the namespaces, bridge and
    veth pairs need root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's ``ip``."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on PATH"
    if shutil.which("unshare") is None:
        return "no `unshare` command (util-linux) on PATH"
    if os.geteuid() != 0:
        return f"not root (uid {os.geteuid()}): network namespaces need CAP_NET_ADMIN"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails: {made.stderr.strip()}"
    try:
        bridge = _ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"cannot create a Linux bridge: {bridge.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class Cluster:
    """The hosts of one stack: namespaces named ``<prefix><host>``, files under ``run_dir``.
    ``infer2``: a second inference host (INFER2) that runs only the inference server, on
    its own address, which the gateway and the trainer reach beside the first
    (``inference.urls`` names both). ``access_log``: the gateway logs every request it
    answered (gunicorn's access log, in its log: time, status, seconds taken, path)."""

    def __init__(self, run_dir: Path = RUN_DIR, prefix: str = PREFIX,
                 base_config: Path = BASE_CONFIG, overrides: Iterable[str] = (),
                 start_timeout_s: float = START_TIMEOUT_S, infer2: bool = False,
                 access_log: bool = False):
        self.run_dir = Path(run_dir).resolve()
        self.hosts = tuple(h for h in ALL_HOSTS if h in HOSTS or (infer2 and h is INFER2))
        self.access_log = access_log
        self.prefix = prefix
        self.base_config = Path(base_config)
        self.overrides = list(overrides)
        self.start_timeout_s = start_timeout_s
        self.config = self.run_dir / "multihost.yaml"
        self.secrets_file = self.run_dir / "secrets.json"
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}  # (host, role): started
        self.root_before = ""  # the root namespace's network before up() (root_network)

    # -- names and addresses
    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    @staticmethod
    def address(host: str) -> str:
        return f"{SUBNET}.{BY_NAME[host].octet}"

    @staticmethod
    def port_name(host: str) -> str:
        """The switch side of ``host``'s veth pair."""
        return f"v-{host}"

    def host_dir(self, host: str) -> Path:
        return self.run_dir / host

    def log(self, host: str, role: str) -> Path:
        return self.host_dir(host) / "logs" / f"{role}.log"

    @property
    def tmp_root(self) -> Path:
        """The hosts' temporary directories: a short path under /tmp, named after the run
        directory, so that a socket's path in it (at most 107 bytes, ``app.services.
        rpc_sockets``) fits however deep the run directory is."""
        digest = hashlib.sha256(os.fsencode(self.run_dir)).hexdigest()[:12]
        return Path("/tmp") / f"co-mh-{digest}"

    def tmp_dir(self, host: str) -> Path:
        """``host``'s ``$TMPDIR``: the inference server's RPC sockets go there, apart from
        every other host's and stack's."""
        return self.tmp_root / host

    def _make_tmp(self, host: str) -> None:
        """``host``'s ``$TMPDIR``, made where missing; the directory above it must be ours
        (a predictable name under /tmp: another user could have made it first)."""
        root = self.tmp_root
        try:
            root.mkdir(mode=0o700)
        except FileExistsError:
            pass
        info = root.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise HarnessError(f"{root} is not a directory of this user's: remove it")
        self.tmp_dir(host).mkdir(exist_ok=True)

    def _remove_tmp(self) -> None:
        root = self.tmp_root
        try:
            info = root.lstat()
        except FileNotFoundError:
            return
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            shutil.rmtree(root, ignore_errors=True)

    @property
    def gateway_url(self) -> str:
        return f"http://{self.address('infer')}:{GATEWAY_PORT}"

    def inference_urls(self) -> list[str]:
        return [f"http://{self.address(h.name)}:{INFERENCE_PORT}" for h in self.hosts
                if "inference" in h.roles]

    # -- config and secrets
    def _secrets(self) -> dict[str, str]:
        try:
            return json.loads(self.secrets_file.read_text())
        except FileNotFoundError:
            raise HarnessError(f"no {self.secrets_file}: the stack is not up "
                               "(`scripts/multihost.sh up`)") from None

    def _write_config(self) -> None:
        import yaml

        base = yaml.safe_load(self.base_config.read_text()) or {}
        shared = self.run_dir / "shared"
        inference = self.address("infer")
        own = {
            "redis": {"host": self.address("redis"), "port": REDIS_PORT,
                      "dir": str(self.host_dir("redis") / "data")},
            "inference": {
                "host": inference, "port": INFERENCE_PORT,
                "urls": self.inference_urls(),
                "dev_routes_guard": "each inference host's policy routing drops a "
                                    "connection to the port but from the trainer host (and, "
                                    "on infer2, the gateway's) (bench/multihost.py)"},
            "gateway": {"host": inference, "port": GATEWAY_PORT, "url": self.gateway_url},
            "trainer": {"weights_dir": str(shared / "weights"),
                        "checkpoint_dir": str(self.host_dir("trainer") / "checkpoints")},
            "logging": {"dir": str(self.host_dir("trainer") / "runs")},
        }
        self.config.write_text(
            f"# written by bench/multihost.py from {self.base_config}\n"
            + yaml.safe_dump(_merge(base, own), sort_keys=False))

    def env(self, host: str) -> dict[str, str]:
        """The environment of a process on ``host``: its own $TMPDIR; with credentials, the
        stack's config and secrets (HarnessError when the stack is not up). Times in UTC on
        every host (log lines' included), whatever the caller's zone."""
        env = {"PATH": f"{BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8", "TZ": "UTC",
               "TMPDIR": str(self.tmp_dir(host)), "WANDB_MODE": "offline",
               "OMP_WAIT_POLICY": "PASSIVE"}
        if BY_NAME[host].credentials:
            env["CARRYOVER_CONFIG"] = str(self.config)
            # a second inference server binds its own host's address, not the config's
            own = [f"inference.host={self.address(host)}"] if host == INFER2.name else []
            if self.overrides or own:
                env["CARRYOVER_OVERRIDES"] = json.dumps([*self.overrides, *own])
            env.update(self._secrets())
        return env

    # -- processes
    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace, under its hostname, at nice
        19 (inherited by everything it starts)."""
        return ["nice", "-n", "19", "ip", "netns", "exec", self.ns(host),
                "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', host,
                *argv]

    def popen(self, host: str, argv: list[str], log: Path | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (in the repository, a session of its own); its output
        goes to ``log`` when given."""
        env = {**self.env(host), **kwargs.pop("env", {})}
        self._make_tmp(host)
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as out:
                return subprocess.Popen(self.argv(host, argv), cwd=REPO, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        **kwargs)
        return subprocess.Popen(self.argv(host, argv), cwd=REPO, env=env,
                                start_new_session=True, **kwargs)

    def run(self, host: str, argv: list[str], timeout: float | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to its end; output captured as text."""
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            out, err = proc.communicate()
            raise HarnessError(f"{argv} on {host} ran past {timeout} s:\n{out[-2000:]}"
                               f"\n{err[-2000:]}") from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def python(self, host: str, code: str, timeout: float | None = 300) -> Any:
        """Run ``code`` (which prints one JSON value last) in the project's Python on
        ``host``; returns that value."""
        out = self.run(host, [str(BIN / "python"), "-c", code], timeout=timeout)
        if out.returncode != 0:
            raise HarnessError(f"python on {host} exited {out.returncode}:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def pids(self, host: str) -> list[int]:
        out = _ip("netns", "pids", self.ns(host), check=False).stdout
        return [int(p) for p in out.split()]

    def existing(self) -> list[str]:
        """This stack's namespaces that are there."""
        mine = {self.switch, *(self.ns(h.name) for h in ALL_HOSTS)}
        return [n for n in namespaces(self.prefix) if n in mine]

    # -- the network
    def _create_network(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", sw, "link", "set", BRIDGE, "up")
        for host in self.hosts:
            ns = self.ns(host.name)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # made in the switch's namespace, the host's end moved straight into its own:
            # neither end ever exists in the root namespace
            _ip("-n", sw, "link", "add", self.port_name(host.name), "type", "veth",
                "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", self.port_name(host.name), "master", BRIDGE, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host.name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        for host in self.hosts:
            if "inference" in host.roles:
                self._guard_inference(host.name)

    def _guard_inference(self, server: str) -> None:
        """``inference.dev_routes_guard``'s network rule, kept on each inference host: a
        connection to the inference port from another host but the trainer (and, on infer2,
        the gateway's host) is dropped (vLLM's dev routes take no key). Policy routing, which
        needs no firewall tools: the rules are read before the local table (moved behind
        them), so an input route to the port is looked up there first. The gateway beside
        the first server reaches it over loopback."""
        ns, port = self.ns(server), str(INFERENCE_PORT)
        for host in ADMITTED_TO_INFERENCE[server]:
            _ip("-n", ns, "rule", "add", "pref", "10", "iif", "eth0", "from", self.address(host),
                "ipproto", "tcp", "dport", port, "lookup", "local")
        _ip("-n", ns, "rule", "add", "pref", "20", "iif", "eth0", "ipproto", "tcp", "dport", port,
            "prohibit")
        _ip("-n", ns, "rule", "add", "pref", "100", "lookup", "local")
        _ip("-n", ns, "rule", "del", "pref", "0")

    def cut(self, host: str) -> None:
        """Partition ``host`` from every other: its switch port down."""
        _ip("-n", self.switch, "link", "set", self.port_name(host), "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port_name(host), "up")

    def cut_pair(self, host: str, peer: str) -> None:
        """Partition ``host`` and ``peer`` from each other only, both ways: each sends the
        other's packets to NOWHERE_MAC (a permanent neighbour entry), so they are dropped
        without a word and a connection hangs, new or established, as across a real
        partition. A blackhole route would not do: a connect through one fails at once
        (EINVAL), which a client takes for a refusal and retries at once."""
        for src, dst in ((host, peer), (peer, host)):
            _ip("-n", self.ns(src), "neigh", "replace", self.address(dst), "lladdr",
                NOWHERE_MAC, "dev", "eth0", "nud", "permanent")

    def heal_pair(self, host: str, peer: str) -> None:
        """Undo :meth:`cut_pair`: the entries go, and ARP finds the peer again."""
        for src, dst in ((host, peer), (peer, host)):
            _ip("-n", self.ns(src), "neigh", "del", self.address(dst), "dev", "eth0",
                check=False)

    def link_up(self, host: str) -> bool:
        out = _ip("-n", self.switch, "-o", "link", "show", self.port_name(host),
                  check=False).stdout
        return "state UP" in out or ",UP" in out.split(">")[0]

    # -- the stack
    def _check_run_dir(self) -> None:
        """Refuses a run directory up() must not delete: one that is not a directory, or
        one with files in it that is not this harness's (no marker, no multihost.yaml)."""
        path = self.run_dir
        if not path.exists():
            return
        if not path.is_dir():
            raise HarnessError(f"run directory {path} is not a directory: set "
                               "CARRYOVER_MH_DIR to another path")
        if any(path.iterdir()) and not (path / MARKER).exists() and not self.config.exists():
            raise HarnessError(f"run directory {path} is not empty and is not a multi-host "
                               f"run's (no {MARKER} or multihost.yaml in it): not deleting it; "
                               "set CARRYOVER_MH_DIR to a new or empty directory")

    def up(self) -> None:
        """Build the network and start every role; returns once every role answers. A
        failure tears it all down again (the logs stay in the run directory, the secrets
        do not) and raises. The run directory is deleted first, only where it is empty or
        an earlier run's (HarnessError otherwise)."""
        self._check_run_dir()
        left = self.existing()
        if left:
            raise HarnessError(f"namespaces of a stack are there already ({', '.join(left)}): "
                               "`scripts/multihost.sh down` first")
        self.root_before = root_network()
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, mode=0o700)
        (self.run_dir / MARKER).write_text("a run directory of bench/multihost.py\n")
        self._remove_tmp()
        for host in self.hosts:
            (self.host_dir(host.name) / "logs").mkdir(parents=True)
        try:
            for host in self.hosts:
                self._make_tmp(host.name)
            fd = os.open(self.secrets_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({name: secrets.token_urlsafe(24) for name in SECRETS}, f)
            self._write_config()
            self._create_network()
            self._start(("redis",), "redis")
            self._wait(redis_only=True)
            for host in self.hosts:
                if host.name != "redis" and host.roles:
                    self._start(host.roles, host.name)
            self._wait()
        except BaseException:
            self.down()
            raise

    def _start(self, roles: Iterable[str], host: str) -> None:
        commands = procfile()
        for role in roles:
            env = {"GUNICORN_CMD_ARGS": ACCESS_LOG} if role == "gateway" and self.access_log \
                else {}
            self.procs[host, role] = self.popen(host, commands[role], log=self.log(host, role),
                                                env=env)

    def expected_nodes(self) -> set[str]:
        return {f"{role}@{h.name}" for h in self.hosts for role in h.roles
                if role in WORKER_ROLES}

    def _dead_roles(self) -> list[str]:
        """The hosts of the roles started here that exited."""
        return sorted({host for (host, _), proc in self.procs.items()
                       if proc.poll() is not None})

    def health(self, host: str = "trainer", timeout: float = 120) -> dict[str, Any]:
        """What ``host`` sees of the stack: each service's health check and the Celery
        nodes that answer (the project's own checks, ``app.services.health``)."""
        return self.python(host, _HEALTH_PROBE, timeout=timeout)

    def _wait(self, redis_only: bool = False) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        want = self.expected_nodes()
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            dead = self._dead_roles()
            if dead:
                raise HarnessError(f"roles on {', '.join(dead)} exited:\n{self.tails(dead)}")
            try:
                seen = self.health()
            except (HarnessError, ValueError) as exc:  # slow under load: looked at again
                seen = {"error": str(exc)[-500:]}
            if redis_only and seen.get("redis"):
                return
            if not redis_only and all(seen.get(p) for p in ("redis", "inference", "gateway")) \
                    and want <= set(seen.get("nodes", ())):
                return
            time.sleep(3)
        raise HarnessError(f"the stack was not up in {self.start_timeout_s:.0f} s "
                           f"(CARRYOVER_MH_START_TIMEOUT_S); last look: {seen}\n"
                           + self.tails([h.name for h in self.hosts if h.roles]))

    def tails(self, hosts: Iterable[str], lines: int = 20) -> str:
        out = []
        for host in hosts:
            for log in sorted((self.host_dir(host) / "logs").glob("*.log")):
                text = log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {host}/{log.name}\n" + "\n".join(text))
        return "\n".join(out)

    def down(self) -> list[str]:
        """Stop every process in the stack's namespaces (SIGTERM, then SIGKILL after a
        grace) and delete the namespaces, a crashed run's leftovers of the same names
        included; returns the namespaces deleted. The run directory (logs) stays, without
        the secrets."""
        found = self.existing()
        hosts = [n for n in found if n != self.switch]
        # the driver and workers first, Redis last, as `carryover up` stops them
        order = {self.ns(h.name): i for i, h in enumerate(reversed(ALL_HOSTS))}
        hosts.sort(key=lambda n: order.get(n, -1))
        for ns in hosts:
            _stop_namespace(ns, STOP_GRACE_S)
        for ns in [*hosts, *([self.switch] if self.switch in found else [])]:
            _ip("netns", "del", ns, check=False)
        self.secrets_file.unlink(missing_ok=True)
        self._remove_tmp()
        return found

    def status(self) -> str:
        """The namespaces, each host's processes and link, and what the trainer host sees."""
        found = set(self.existing())
        lines = []
        for host in self.hosts:
            ns = self.ns(host.name)
            if ns not in found:
                lines.append(f"{host.name:8} -")
                continue
            link = "up" if self.link_up(host.name) else "CUT"
            procs = []
            for pid in self.pids(host.name):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    procs.append(f"{pid} {Path(cmd[0].decode()).name} "
                                 + " ".join(c.decode() for c in cmd[1:4]))
                except OSError:
                    continue
            lines.append(f"{host.name:8} {self.address(host.name):12} link {link:4} "
                         f"{len(procs)} processes" + "".join(f"\n    {p}" for p in procs))
        if self.ns("trainer") in found and self.config.exists():
            try:
                lines.append(f"seen from trainer: {json.dumps(self.health(timeout=60))}")
            except HarnessError as exc:
                lines.append(f"seen from trainer: {exc}")
        return "\n".join(lines)


# Run on a host: the project's health checks, as `carryover status` makes them.
_HEALTH_PROBE = """
import json
from app.config import service_config
from app.services import health
from app.celery_app import celery_app
cfg = service_config()
out = {"redis": health.check_redis(cfg, timeout=2).ok,
       "inference": all(p.ok for p in health.check_inference(cfg, timeout=2)),
       "gateway": health.check_gateway(cfg, timeout=2).ok, "nodes": []}
if out["redis"]:
    try:
        replies = celery_app.control.inspect(timeout=3).ping() or {}
        out["nodes"] = sorted(replies)
    except Exception as exc:
        out["nodes_error"] = str(exc)
print(json.dumps(out))
"""


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) \
            and isinstance(out.get(key), dict) else value
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waits for its parent only
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _stop_namespace(ns: str, grace: float) -> None:
    """SIGTERM every process in ``ns``, SIGKILL those left after ``grace`` seconds."""
    def pids() -> list[int]:
        out = _ip("netns", "pids", ns, check=False).stdout
        return [p for p in map(int, out.split()) if _alive(p)]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10)
        while pids() and time.monotonic() < deadline:
            time.sleep(0.5)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def cluster(**kwargs: Any) -> Iterator[Cluster]:
    """An up stack, torn down on the way out whatever happened."""
    c = Cluster(**kwargs)
    c.up()
    try:
        yield c
    finally:
        c.down()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: scripts/multihost.sh up | down [--all] | status | cut HOST [PEER] | "
             "heal HOST [PEER] | exec HOST CMD... | env HOST\n"
             f"hosts: {', '.join(BY_NAME)}; run directory {RUN_DIR} ($CARRYOVER_MH_DIR)")
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    c = Cluster(run_dir=RUN_DIR, prefix=PREFIX)
    try:
        return _command(c, args[0], args[1:], usage)
    except HarnessError as exc:  # a stack that is not up, a run directory refused
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _command(c: Cluster, cmd: str, rest: list[str], usage: str) -> int:
    if cmd == "up":
        why = missing_capability()
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 1
        started = time.monotonic()
        c.up()
        print(f"up in {time.monotonic() - started:.0f} s; config {c.config}, logs under "
              f"{c.run_dir}/<host>/logs; gateway {c.gateway_url}\n"
              f"train: scripts/multihost.sh exec trainer carryover train")
        return 0
    if cmd == "down":
        found = c.down()
        if rest == ["--all"]:  # every stack's: test runs' (co-t<pid>-) too
            for prefix in stack_prefixes():
                found += Cluster(run_dir=c.run_dir, prefix=prefix).down()
        print(f"deleted: {', '.join(found)}" if found else "nothing to delete")
        return 0
    if cmd == "status":
        print(c.status())
        return 0
    if cmd in ("cut", "heal", "exec", "env") and (not rest or rest[0] not in BY_NAME):
        print(usage, file=sys.stderr)
        return 2
    if cmd in ("cut", "heal", "exec") and c.ns(rest[0]) not in c.existing():
        raise HarnessError(f"the stack is not up: no namespace {c.ns(rest[0])} "
                           "(`scripts/multihost.sh up`)")
    if cmd in ("cut", "heal") and len(rest) > 1:  # one pair of hosts only
        if len(rest) > 2 or rest[1] not in BY_NAME or rest[1] == rest[0]:
            print(usage, file=sys.stderr)
            return 2
        (c.cut_pair if cmd == "cut" else c.heal_pair)(rest[0], rest[1])
        return 0
    if cmd == "cut":
        c.cut(rest[0])
        return 0
    if cmd == "heal":
        c.heal(rest[0])
        return 0
    if cmd == "env":
        env = c.env(rest[0])
        for key in sorted(env):
            shown = "***" if key in SECRETS else env[key]
            print(f"{key}={shown}")
        return 0
    if cmd == "exec":
        if len(rest) < 2:
            print(usage, file=sys.stderr)
            return 2
        proc = c.popen(rest[0], rest[1:])  # HarnessError without the stack's secrets
        try:
            return proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGINT)
            return proc.wait()
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
