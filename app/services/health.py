"""Health checks of every part of the stack, used by ``carryover status`` and the supervisor.

Each check returns a :class:`PartStatus`; none raises. The checks use plain HTTP and Redis
calls with short timeouts so a down part is reported, not waited on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import requests

from app.config.schema import Config
from app.config.secrets import inference_api_key
from app.state.connection import connect, redact, resolve_redis_url
from app.state.records import RoleExit

if TYPE_CHECKING:
    from pathlib import Path

log = logging.getLogger(__name__)

WORKER_QUEUES = ("rollout", "groups", "trainer")
EXITS_SHOWN = 5  # the role exits `carryover status` lists, newest last


@dataclass
class PartStatus:
    part: str
    ok: bool
    detail: str
    version: str = ""
    url: str = ""    # an inference server's: the one ``inference.urls`` names
    label: str = ""  # its STATUS when neither "up" nor "DOWN" says it (``UNROUTED``)


def check_redis(cfg: Config, timeout: float = 2.0) -> PartStatus:
    url = resolve_redis_url(cfg)
    try:
        client = connect(url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=None)
        client.ping()
        info = client.info("server")
        persistence = client.config_get("appendonly").get("appendonly", "?")
        return PartStatus("redis", True, f"{redact(url)} (aof={persistence})",
                          info.get("redis_version", ""))
    except Exception as exc:  # noqa: BLE001 - any failure means "down"
        return PartStatus("redis", False, f"{redact(url)}: {exc}")


def check_inference(cfg: Config, timeout: float = 2.0) -> list[PartStatus]:
    out = []
    for url in cfg.inference.urls:
        url = url.rstrip("/")
        try:
            requests.get(url + "/health", timeout=timeout).raise_for_status()
            models = requests.get(url + "/v1/models", timeout=timeout, headers={
                "Authorization": f"Bearer {inference_api_key(cfg)}"}).json()
            names = [m["id"] for m in models.get("data", [])]
            version = requests.get(url + "/version", timeout=timeout).json().get("version", "")
            expected = cfg.inference.served_model_name
            ok = expected in names
            detail = f"{url} model={','.join(names)}" + ("" if ok else f" (expected {expected})")
            held = weights_held(url, inference_api_key(cfg), timeout)
            if held is not None:
                detail += f" weights={held}"
            out.append(PartStatus("inference", ok, detail, f"vllm {version}", url=url))
        except Exception as exc:  # noqa: BLE001
            out.append(PartStatus("inference", False, f"{url}: {exc.__class__.__name__}",
                                  url=url))
    return out


def weights_held(url: str, api_key: str = "", timeout: float = 2.0) -> str | None:
    """What the server at ``url`` says it serves (vLLM's ``/weight_info``, which a trainer's
    load sets to the policy version): ``policy version N``, or ``base model`` for the
    weights it started with ("default"); None where it does not say."""
    try:
        resp = requests.get(url.rstrip("/") + "/weight_info", timeout=timeout,
                            headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        held = str(resp.json()["weight_version"]) if resp.status_code == 200 else None
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return None
    if held is None:
        return None
    return f"policy version {held}" if held.isdigit() else \
        "base model" if held == "default" else held


def unroutable(cfg: Config, timeout: float = 2.0) -> dict[str, str]:
    """The servers of ``inference.urls`` the gateway routes no call to, each with why and
    what ends it: those Redis marks stale (``keys.upstreams_stale``: down or restarted, and
    not yet given the run's weights), and those the running gateway's health checks skip
    (its ``/admin/state``, one worker process's view). {} where neither answers."""
    from app.state import keys
    from app.state.policy import current_version

    urls = [u.rstrip("/") for u in cfg.inference.urls]
    out: dict[str, str] = {}
    try:
        client = connect(resolve_redis_url(cfg), socket_timeout=timeout,
                         socket_connect_timeout=timeout, retry=None)
        stale = client.smembers(keys.upstreams_stale())
        need = client.get(keys.upstreams_need_weights())
        published = client.hgetall(keys.policy_published())
        current = current_version(client)
    except Exception:  # noqa: BLE001 - status reports what it can
        stale, need, published, current = set(), None, {}, 0
    for url in urls:
        if url in stale:
            out[url] = _why_stale(cfg, url, need, published, current)
    known, routed = _gateway_routes(cfg, timeout)
    for url in urls:
        if url in known and url not in routed and url not in out:
            out[url] = ("the gateway skips it: its health check failed, or the engine was left "
                        "paused or asleep with no pause held (the trainer worker's upstream "
                        "keeper takes it back); the gateway's log says which")
    return out


def _why_stale(cfg: Config, url: str, need: str | None, published: dict[str, str],
               current: int) -> str:
    """Why a stale server waits, and for what."""
    model = cfg.inference.served_model_name
    mine = bool(published) and published.get("model") == model \
        and str(published.get("version", "")).isdigit()
    version = int(published["version"]) if mine else None
    if need is not None:  # said of one server ("<url>: why"); the others wait for the same
        why = need[len(url) + 2:] if need.startswith(url + ": ") else need
        return ("stale, and the trainer worker's upstream keeper cannot give it the run's "
                f"weights ({why}): it waits for a run, whose driver has the trainer serve "
                "the run's weights (`carryover train`: a new run's, the base model; "
                "--resume RUN_ID: that run's last checkpoint)")
    if version is not None and current > version:
        return (f"stale: policy version {current} was loaded but never verified (its step "
                f"failed) and the last verified one is {version}; the next update loads it")
    if version is not None:
        return (f"stale (it went down or restarted): the trainer worker's upstream keeper "
                f"loads policy version {version} into it once it answers")
    return ("stale (it went down or restarted): the trainer worker's upstream keeper takes it "
            "back with the weights it started with (no weights of "
            f"{model!r} were published)")


def _gateway_routes(cfg: Config, timeout: float) -> tuple[set[str], set[str]]:
    """(the servers the running gateway knows, those it routes to), from its
    ``/admin/state``; both empty where it does not answer."""
    from app.config.secrets import admin_token

    try:
        resp = requests.get(cfg.gateway.url.rstrip("/") + "/admin/state", timeout=timeout,
                            headers={"Authorization": f"Bearer {admin_token(cfg)}"})
        body = resp.json() if resp.status_code == 200 else {}
    except (requests.RequestException, ValueError):
        return set(), set()
    known, healthy = body.get("upstreams"), body.get("upstreams_healthy")
    if not isinstance(known, list) or not isinstance(healthy, list):
        return set(), set()
    return {str(u).rstrip("/") for u in known}, {str(u).rstrip("/") for u in healthy}


class RoutingWatch:
    """For ``carryover up``: says, as it changes, which inference servers the gateway routes
    no call to and why (``unroutable``), so a stack that serves nothing until a run comes
    says so instead of only "all parts up". Looks every ``every_s`` at most."""

    def __init__(self, cfg: Config, say: Callable[[str], None], every_s: float = 5.0,
                 timeout: float = 1.0) -> None:
        self.cfg, self.say, self.every_s, self.timeout = cfg, say, every_s, timeout
        self.said: dict[str, str] = {}
        self._next = float("-inf")

    def __call__(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        try:
            found = unroutable(self.cfg, self.timeout)
        except Exception as exc:  # noqa: BLE001 - never stops the supervisor's watch
            log.debug("could not tell which servers the gateway routes to: %s", exc)
            return
        for url, why in found.items():
            if self.said.get(url) != why:
                self.say(f"inference {url} gets no call from the gateway: {why}")
        for url in self.said.keys() - found.keys():
            self.say(f"inference {url} is routed again")
        self.said = found


def mark_unroutable(rows: list[PartStatus], routes: dict[str, str]) -> None:
    """The inference rows of servers that answer but get no call say ``UNROUTED``."""
    for row in rows:
        if row.part == "inference" and row.ok and row.url.rstrip("/") in routes:
            row.label = "UNROUTED"


def recent_exits(cfg: Config, count: int = EXITS_SHOWN, timeout: float = 2.0
                 ) -> tuple[list[RoleExit], int]:
    """The last ``count`` role exits the supervisors recorded (``keys.role_exits``), oldest
    first, one whose record was written twice (a lost reply) once; and how many the stream
    holds in all. ([], 0) if Redis is down."""
    from app.state import keys

    try:
        client = connect(resolve_redis_url(cfg), socket_timeout=timeout,
                         socket_connect_timeout=timeout, retry=None)
        # a few more than asked: duplicates are dropped after the read
        raw = client.xrevrange(keys.role_exits(), count=2 * count)
        total = int(client.xlen(keys.role_exits()))
    except Exception:  # noqa: BLE001 - status reports what it can
        return [], 0
    seen: dict[tuple[str, int, float], RoleExit] = {}
    for _, fields in raw:
        rec = RoleExit.from_hash(fields)
        seen.setdefault((rec.host, rec.pid, rec.at), rec)
    newest = list(seen.values())[:count]
    return newest[::-1], total


def check_gateway(cfg: Config, timeout: float = 2.0) -> PartStatus:
    url = cfg.gateway.url.rstrip("/")
    try:
        body = requests.get(url + "/healthz", timeout=timeout).json()
        ok = body.get("status") == "ok"
        detail = f"{url} paused={body.get('paused')} upstreams={body.get('upstreams_healthy')}"
        return PartStatus("gateway", ok, detail, f"carryover {body.get('version', '')}")
    except Exception as exc:  # noqa: BLE001
        return PartStatus("gateway", False, f"{url}: {exc.__class__.__name__}")


def gateway_disagreements(cfg: Config, timeout: float = 5.0
                          ) -> tuple[list[str], list[str]] | None:
    """Where the running gateway serves by other values than ``cfg`` says
    (app/config/serving.py): one line per key, (refusing the run, only noted); None when
    the gateway does not answer (the run reports a gateway that is down on its own)."""
    from app.config.secrets import admin_token
    from app.config.serving import disagreements, gateway_view

    url = cfg.gateway.url.rstrip("/")
    try:
        resp = requests.get(url + "/admin/state", timeout=timeout,
                            headers={"Authorization": f"Bearer {admin_token(cfg)}"})
        if resp.status_code in (401, 403):
            log.warning("the gateway at %s refused this process's admin token (%d): this "
                        "run's config is not compared with what the gateway serves by", url,
                        resp.status_code)
        serves = resp.json().get("serves") if resp.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None
    return disagreements(gateway_view(cfg), serves) if isinstance(serves, dict) else None


def check_workers(timeout: float = 2.0) -> list[PartStatus]:
    import celery

    from app.celery_app import celery_app

    try:
        replies = celery_app.control.inspect(timeout=timeout).active_queues() or {}
    except Exception as exc:  # noqa: BLE001
        return [PartStatus(f"worker:{q}", False, f"inspect failed: {exc}") for q in WORKER_QUEUES]
    by_queue: dict[str, list[str]] = {q: [] for q in WORKER_QUEUES}
    for worker, queues in replies.items():
        for q in queues:
            by_queue.setdefault(q["name"], []).append(worker)
    return [
        PartStatus(f"worker:{q}", bool(by_queue[q]),
                   ", ".join(sorted(by_queue[q])) or "no worker consumes this queue",
                   f"celery {celery.__version__}")
        for q in WORKER_QUEUES
    ]


def check_flower(cfg: Config, timeout: float = 2.0) -> PartStatus:
    url = f"http://127.0.0.1:{cfg.services.flower_port}"
    try:
        import flower

        resp = requests.get(url + "/healthcheck", timeout=timeout)
        return PartStatus("flower", resp.ok and resp.text.strip() == "OK", url,
                          f"flower {flower.__version__}")
    except Exception as exc:  # noqa: BLE001
        return PartStatus("flower", False, f"{url}: {exc.__class__.__name__}")


def role_restarts(cfg: Config, timeout: float = 2.0) -> dict[str, int]:
    """Times the supervisors started each role again after it exited ({} if Redis is
    down)."""
    from app.state import keys

    try:
        client = connect(resolve_redis_url(cfg), socket_timeout=timeout,
                         socket_connect_timeout=timeout, retry=None)
        totals: dict[str, int] = {}
        # one field per supervisor that restarted the role
        for field, n in client.hgetall(keys.role_restarts()).items():
            role = keys.role_of_restarts_field(field)
            totals[role] = totals.get(role, 0) + int(n)
        return totals
    except Exception:  # noqa: BLE001 - status reports what it can
        return {}


class Outage(TypedDict):
    """A Redis outage as ``carryover status`` lists it: the processes' overlapping records
    merged."""

    down_at: float
    up_at: float
    roles: set[str]
    seconds: float


def redis_outages(cfg: Config, timeout: float = 2.0) -> list[Outage]:
    """The Redis outages the stack's processes rode out, oldest first, each
    ``{"down_at", "up_at", "seconds", "roles"}``: the processes' records
    (``keys.redis_outages``) merged where they overlap ([] if Redis is down)."""
    from app.state import keys
    from app.state.records import OutageRecord

    try:
        client = connect(resolve_redis_url(cfg), socket_timeout=timeout,
                         socket_connect_timeout=timeout, retry=None)
        raw = client.lrange(keys.redis_outages(), 0, -1)
    except Exception:  # noqa: BLE001 - status reports what it can
        return []
    merged: list[tuple[float, float, set[str]]] = []  # (down_at, up_at, roles)
    for rec in sorted((OutageRecord.from_json(r) for r in raw), key=lambda r: r.down_at):
        if merged and rec.down_at <= merged[-1][1] + 1.0:
            down_at, up_at, roles = merged[-1]
            merged[-1] = (down_at, max(up_at, rec.up_at), roles | {rec.role})
        else:
            merged.append((rec.down_at, rec.up_at, {rec.role}))
    return [{"down_at": down_at, "up_at": up_at, "roles": roles, "seconds": up_at - down_at}
            for down_at, up_at, roles in merged]


def environment(repo: str | Path | None = None) -> list[tuple[str, str]]:
    """(what, value) of the host and the two environments, read without importing torch or
    vLLM: the device, torch's build and CUDA version, the vLLM build."""
    import re
    from importlib import metadata
    from pathlib import Path

    from app.config.loader import REPO_ROOT
    from app.services.device import host_device

    root = Path(repo or REPO_ROOT)
    rows = [("device", host_device())]
    try:
        dist = metadata.distribution("torch")
        text = Path(dist.locate_file("torch/version.py")).read_text()
        cuda = re.search(r"^cuda: .*= '?([\w.]+|None)'?", text, re.M)
        rows.append(("torch", f"{dist.version} (CUDA {cuda.group(1) if cuda else '?'})"))
    except (metadata.PackageNotFoundError, OSError):
        rows.append(("torch", "not installed"))
    builds = sorted((root / ".venv-vllm").glob("lib/python*/site-packages/vllm*.dist-info"))
    if builds:
        name, _, version = builds[0].name.removesuffix(".dist-info").partition("-")
        rows.append(("vllm", f"{name.replace('_', '-')} {version} (.venv-vllm)"))
    else:
        rows.append(("vllm", "not installed (.venv-vllm missing)"))
    return rows


def check_all(cfg: Config) -> list[PartStatus]:
    return [check_redis(cfg), *check_inference(cfg), check_gateway(cfg), *check_workers(),
            check_flower(cfg)]


def format_table(rows: list[PartStatus]) -> str:
    header = ("PART", "STATUS", "VERSION", "DETAIL")
    lines = [(r.part, r.label or ("up" if r.ok else "DOWN"), r.version, r.detail) for r in rows]
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(3)]
    return "\n".join(
        "  ".join(col.ljust(w) for col, w in zip(x[:3], widths, strict=True)) + "  " + x[3]
        for x in [header, *lines])
