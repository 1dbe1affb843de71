"""What a host outside the multi-host stack (``bench/multihost.py``) gets from every port the
stack opens, without credentials.

Every TCP socket listening in a host's namespace is found (``ss -ltnp``), so a port a role
opens later is probed too; each known port is tried as an attacker would (the gateway's
rollout and admin routes, the inference server's ``/v1`` and dev routes, Redis without and
with a wrong password, Flower's API) from the ``outside`` host, and the inference server's
``/v1`` also from the trainer host (which the network admits) without its key. An answer is
a refusal when it is 401/403 (or the probe's own expected code), NOAUTH/WRONGPASS, or no
connection at all; a non-loopback listener the probe does not know is a failure of its own.

``python -m bench.multihost_probe`` probes a stack ``scripts/multihost.sh up`` started (Flower
started on the trainer host by its Procfile line where it is not running) and prints the
table in markdown; it exits 1 when anything was not refused.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.multihost import BIN, HOSTS, PREFIX, RUN_DIR, Cluster, HarnessError, procfile

FLOWER_HOST = "trainer"  # where the probe runs Flower: a host with the stack's config
# answers that are no connection at all: a refusal whatever the port
NO_CONNECTION = ("refused", "dropped", "unreachable")
# a made-up rollout id and token: what an attacker without any would send
FAKE_ID, FAKE_TOKEN = "0123456789abcdef0123456789abcdef", "not-a-token"


@dataclass(frozen=True)
class Listener:
    host: str
    addr: str
    port: int
    process: str

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.addr.strip("[]").split("%")[0]).is_loopback
        except ValueError:  # "*": every address
            return False


@dataclass
class Probe:
    host: str  # whose port
    port: int
    role: str
    what: str  # as the table shows it
    kind: str = "http"  # http | redis | tcp (a connection only)
    method: str = "GET"
    path: str = "/"
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    line: str = ""  # a Redis command
    accept: tuple[int, ...] = (401, 403)  # HTTP codes that refuse (kind http)
    source: str = "outside"
    answer: str = ""

    @property
    def refused(self) -> bool:
        if self.answer in NO_CONNECTION:
            return True
        if self.kind == "http":
            return self.answer.split()[0] in {str(c) for c in self.accept}
        if self.kind == "redis":
            return self.answer.startswith(("NOAUTH", "WRONGPASS"))
        return False


def listeners(cluster: Cluster, host: str) -> list[Listener]:
    """The TCP sockets listening in ``host``'s namespace."""
    out = subprocess.run(["ip", "netns", "exec", cluster.ns(host), "ss", "-ltnpH"],
                         capture_output=True, text=True, timeout=60)
    found = []
    for line in out.stdout.splitlines():
        cols = line.split()
        if len(cols) < 4:
            continue
        addr, _, port = cols[3].rpartition(":")
        proc = cols[5].split('"')[1] if len(cols) > 5 and '"' in cols[5] else "?"
        found.append(Listener(host, addr, int(port), proc))
    return found


def all_listeners(cluster: Cluster) -> set[Listener]:
    return {s for h in HOSTS if h.roles or h.name == FLOWER_HOST
            for s in listeners(cluster, h.name)}


def _config(cluster: Cluster) -> Any:
    """The stack's config as its roles read it (the defaults under the written file)."""
    from app.config import load_config

    return load_config(cluster.config, cluster.overrides)


def known_ports(cluster: Cluster) -> dict[tuple[str, int], str]:
    """(host, port) -> role, from the stack's config."""
    cfg = _config(cluster)
    return {("redis", int(cfg.redis.port)): "redis",
            ("infer", int(cfg.inference.port)): "inference (vLLM)",
            ("infer", int(cfg.gateway.port)): "gateway",
            (FLOWER_HOST, int(cfg.services.flower_port)): "flower"}


def _gateway(port: int, rollout: str | None) -> list[Probe]:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    wrong = {"Authorization": f"Bearer {FAKE_TOKEN}"}
    out = [Probe("infer", port, "gateway", "GET /healthz (public: liveness)", path="/healthz",
                 accept=(200,)),
           Probe("infer", port, "gateway", "POST /v1/chat/completions (no rollout id)",
                 method="POST", path="/v1/chat/completions", body=chat, accept=(401, 403, 404)),
           Probe("infer", port, "gateway", "POST /rollout/<made-up id>/v1/chat/completions, "
                 "no token", method="POST", path=f"/rollout/{FAKE_ID}/v1/chat/completions",
                 body=chat),
           Probe("infer", port, "gateway", "POST /rollout/<made-up id>/v1/chat/completions, "
                 "a wrong token", method="POST", headers=wrong,
                 path=f"/rollout/{FAKE_ID}/v1/chat/completions", body=chat,
                 accept=(401, 403, 404))]
    if rollout:
        base = f"/rollout/{rollout}"
        for method, path, body, hdrs in [
                ("POST", "/v1/chat/completions", chat, {}),
                ("POST", "/v1/chat/completions", chat, wrong),
                ("POST", "/v1/completions", {"model": "m", "prompt": "hi"}, wrong),
                ("POST", "/v1/responses", {"model": "m", "input": "hi"}, wrong),
                ("POST", "/v1/messages", {"model": "m", "max_tokens": 8, "messages":
                                          chat["messages"]}, {"x-api-key": FAKE_TOKEN}),
                ("GET", "/v1/models", None, wrong), ("POST", "/reward", {"reward": 1.0}, wrong)]:
            token = "no token" if not hdrs else "a wrong token"
            out.append(Probe("infer", port, "gateway",
                             f"{method} /rollout/<a real id>{path}, {token}", method=method,
                             path=base + path, body=body, headers=hdrs))
    for method, path in [("GET", "/admin/state"), ("POST", "/admin/pause"),
                         ("POST", "/admin/drain"), ("POST", "/admin/resume")]:
        for hdrs, token in [({}, "no token"), (wrong, "a wrong token")]:
            out.append(Probe("infer", port, "gateway", f"{method} {path}, {token}",
                             method=method, path=path, headers=hdrs))
    return out


# vLLM's routes: /v1 takes the key; the dev routes (VLLM_SERVER_DEV_MODE) and the rest none
_V1 = [("GET", "/v1/models", None),
       ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user",
                                                                      "content": "hi"}]}),
       ("POST", "/v1/completions", {"model": "m", "prompt": "hi"}),
       ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"})]
_OPEN = [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/version", None),
         ("POST", "/tokenize", {"model": "m", "prompt": "hi"}), ("GET", "/is_sleeping", None),
         ("POST", "/reset_prefix_cache", None),
         ("POST", "/collective_rpc", {"method": "no_such_method"}),
         ("POST", "/init_weight_transfer_engine", {}), ("POST", "/update_weights", {}),
         ("POST", "/pause", None), ("POST", "/resume", None), ("POST", "/wake_up", None),
         ("POST", "/sleep?level=1", None)]  # last: it would stop the engine if it got in


def _inference(port: int) -> list[Probe]:
    role = "inference (vLLM)"
    # from outside: no connection at all (the network rule), whatever the route
    out = [Probe("infer", port, role, f"{m} {p}", method=m, path=p, body=b, accept=())
           for m, p, b in [*_V1, *_OPEN]]
    # from the trainer host, which the network admits: /v1 still wants the key
    out += [Probe("infer", port, role, f"{m} {p} (from the trainer host, no key)", method=m,
                  path=p, body=b, accept=(401,), source="trainer") for m, p, b in _V1]
    return out


def _redis(port: int) -> list[Probe]:
    return [Probe("redis", port, "redis", f"`{line}`", kind="redis", line=line)
            for line in ("PING", "KEYS *", "CONFIG GET requirepass", "AUTH wrong-password",
                         "AUTH default wrong-password", "HELLO 3 AUTH default wrong-password")]


def _flower(port: int) -> list[Probe]:
    return [Probe(FLOWER_HOST, port, "flower", f"{m} {p}", method=m, path=p)
            for m, p in [("GET", "/"), ("GET", "/api/workers"),
                         ("POST", "/api/worker/shutdown/trainer@trainer"),
                         ("POST", f"/api/task/revoke/{FAKE_ID}")]]


def plan(cluster: Cluster, found: set[Listener], rollout: str | None
         ) -> tuple[list[Probe], list[Listener]]:
    """The probes of every known port and of every listener found; and the listeners beyond
    loopback that the probe does not know how to judge (each still tried: a connection)."""
    known = known_ports(cluster)
    by_role = {"gateway": lambda p: _gateway(p, rollout), "inference (vLLM)": _inference,
               "redis": _redis, "flower": _flower}
    probes = [p for (_, port), role in known.items() for p in by_role[role](port)]
    unknown = sorted({s for s in found if (s.host, s.port) not in known and not s.loopback},
                     key=lambda s: (s.host, s.port))
    # a loopback-only listener: the host's address must not answer on its port either
    seen = set()
    for s in sorted(found, key=lambda s: (s.host, s.port)):
        if (s.host, s.port) in known or (s.host, s.port) in seen:
            continue
        seen.add((s.host, s.port))
        where = f"loopback only ({s.addr})" if s.loopback else f"UNKNOWN on {s.addr}"
        probes.append(Probe(s.host, s.port, f"{s.process}, {where}", "a TCP connection",
                            kind="tcp"))
    return probes, unknown


# Run on a host: each probe (JSON, argv[1]) against its host's address; the answers, in order.
_RUN = r"""
import concurrent.futures, http.client, json, socket, sys

def connect(host, port):
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except ConnectionRefusedError:
        return None, "refused"
    except TimeoutError:
        return None, "dropped"
    except OSError as exc:
        return None, "unreachable" if exc.errno in (101, 113) else f"error {exc}"
    sock.settimeout(120)  # a loaded machine's server is slow to answer, not refusing
    return sock, ""

def one(p):
    sock, why = connect(p["addr"], p["port"])
    if sock is None:
        return why
    try:
        if p["kind"] == "tcp":
            return "accepted a connection"
        if p["kind"] == "redis":
            sock.sendall(p["line"].encode() + b"\r\n")
            reply = sock.recv(4096).decode(errors="replace").splitlines() or ["closed"]
            return reply[0].lstrip("-+")[:80]
        conn = http.client.HTTPConnection(p["addr"], p["port"])
        conn.sock = sock
        body = None if p["body"] is None else json.dumps(p["body"])
        headers = {**p["headers"], **({"Content-Type": "application/json"} if body else {})}
        conn.request(p["method"], p["path"], body=body, headers=headers)
        resp = conn.getresponse()
        return f"{resp.status} {resp.read(300).decode(errors='replace')}"
    except Exception as exc:
        return f"error {exc.__class__.__name__}: {exc}"
    finally:
        sock.close()

probes = json.loads(sys.argv[1])
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    print(json.dumps(list(pool.map(one, probes))))
"""


def run(cluster: Cluster, probes: list[Probe]) -> list[Probe]:
    """Send ``probes`` from their sources; each gets its answer."""
    for source in sorted({p.source for p in probes}):
        mine = [p for p in probes if p.source == source]
        sent = [{**asdict(p), "addr": cluster.address(p.host)} for p in mine]
        out = cluster.run(source, [str(BIN / "python"), "-c", _RUN, json.dumps(sent)],
                          timeout=600)
        if out.returncode != 0:
            raise HarnessError(f"the probe on {source} exited {out.returncode}:\n"
                               + out.stderr[-3000:])
        for p, answer in zip(mine, json.loads(out.stdout.strip().splitlines()[-1]), strict=True):
            p.answer = " ".join(answer.split())
    return probes


def short(answer: str) -> str:
    """An answer as the table shows it."""
    if answer in NO_CONNECTION:
        return {"refused": "connection refused", "dropped": "no answer (dropped)",
                "unreachable": "no route to host"}[answer]
    code, _, body = answer.partition(" ")
    if code.isdigit():
        try:
            err = json.loads(body).get("error", {})
            detail = err.get("code") or err.get("type") if isinstance(err, dict) else err
        except (ValueError, AttributeError):
            detail = ""
        return f"{code} {detail}".strip() if detail else code
    return answer[:60]


def _ports(ports: list[int]) -> str:
    ports = sorted(set(ports))
    return ", ".join(map(str, ports)) if len(ports) <= 3 \
        else f"{len(ports)} ports, {ports[0]}-{ports[-1]}"


def table(probes: list[Probe]) -> str:
    """Markdown: one row per port, role and answer, the probes that got it joined; the
    connections to the ports a process listens on beyond the known ones (ephemeral, another
    each start) one row per process and answer."""
    rows: dict[tuple, tuple[list[int], list[str]]] = {}
    for p in probes:
        key = (p.port if p.kind != "tcp" else None, p.role, p.host, short(p.answer), p.refused)
        ports, what = rows.setdefault(key, ([], []))
        ports.append(p.port)
        if p.what not in what:
            what.append(p.what)
    lines = ["| port | role (host) | tried from outside | answered |", "|---|---|---|---|"]
    for (_, role, host, answer, refused), (ports, what) in rows.items():
        mark = "" if refused else " **NOT REFUSED**"
        lines.append(f"| {_ports(ports)} | {role} ({host}) | {'; '.join(what)} | "
                     f"{answer}{mark} |")
    return "\n".join(lines)


def start_flower(cluster: Cluster, timeout: float = 300) -> None:
    """Flower on ``FLOWER_HOST`` as the Procfile starts it (`carryover serve flower`), unless
    it listens there already; returns once it does. Asked, through Flower's own variable, to
    bind every address: its API is open (FLOWER_UNAUTHENTICATED_API), so the project's
    command line must keep it on loopback whatever the environment says."""
    port = int(_config(cluster).services.flower_port)
    if any(s.port == port for s in listeners(cluster, FLOWER_HOST)):
        return
    proc = cluster.popen(FLOWER_HOST, procfile()["flower"], log=cluster.log(FLOWER_HOST, "flower"),
                         env={"FLOWER_ADDRESS": "0.0.0.0"})
    cluster.procs[FLOWER_HOST, "flower"] = proc
    deadline = time.monotonic() + timeout
    while not any(s.port == port for s in listeners(cluster, FLOWER_HOST)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise HarnessError(f"Flower did not listen on {FLOWER_HOST}:{port}:\n"
                               + cluster.tails([FLOWER_HOST]))
        time.sleep(2)


_A_ROLLOUT = """
import json
from app.config import service_config
from app.state import keys
from app.state.connection import connect, resolve_redis_url
c = connect(resolve_redis_url(service_config()))
prefix = keys.rollout("")
ids = [k[len(prefix):] for k in map(lambda k: k.decode() if isinstance(k, bytes) else k,
       c.scan_iter(match=prefix + "*", count=1000)) if ":" not in k[len(prefix):]]
print(json.dumps(next((i for i in ids if c.hget(keys.rollout(i), "token_sha256")), None)))
"""


def a_rollout(cluster: Cluster) -> str | None:
    """A rollout id the stack knows (one of a run's), read on the trainer host."""
    return cluster.python("trainer", _A_ROLLOUT, timeout=120)


def probe(cluster: Cluster, seen: set[Listener] = frozenset()
          ) -> tuple[list[Probe], list[Listener]]:
    """Every port probed (the listeners found now, and ``seen`` earlier, e.g. during a run);
    returns the probes answered and the unknown listeners beyond loopback."""
    start_flower(cluster)
    probes, unknown = plan(cluster, all_listeners(cluster) | set(seen), a_rollout(cluster))
    return run(cluster, probes), unknown


def main() -> int:
    cluster = Cluster(run_dir=RUN_DIR, prefix=PREFIX)
    try:
        probes, unknown = probe(cluster)
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(table(probes))
    for s in unknown:
        print(f"unknown listener beyond loopback: {s.host} {s.addr}:{s.port} ({s.process})")
    return 0 if all(p.refused for p in probes) and not unknown else 1


if __name__ == "__main__":
    sys.exit(main())
