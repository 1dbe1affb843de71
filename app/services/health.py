"""Health checks of every part of the stack, used by ``carryover status`` and the supervisor.

Each check returns a :class:`PartStatus`; none raises. The checks use plain HTTP and Redis
calls with short timeouts so a down part is reported, not waited on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import requests

from app.config.secrets import inference_api_key
from app.state.connection import connect, redact, resolve_redis_url

log = logging.getLogger(__name__)

WORKER_QUEUES = ("rollout", "groups", "trainer")


@dataclass
class PartStatus:
    part: str
    ok: bool
    detail: str
    version: str = ""


def check_redis(cfg: Any, timeout: float = 2.0) -> PartStatus:
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


def check_inference(cfg: Any, timeout: float = 2.0) -> list[PartStatus]:
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
            out.append(PartStatus("inference", ok, detail, f"vllm {version}"))
        except Exception as exc:  # noqa: BLE001
            out.append(PartStatus("inference", False, f"{url}: {exc.__class__.__name__}"))
    return out


def check_gateway(cfg: Any, timeout: float = 2.0) -> PartStatus:
    url = cfg.gateway.url.rstrip("/")
    try:
        body = requests.get(url + "/healthz", timeout=timeout).json()
        ok = body.get("status") == "ok"
        detail = f"{url} paused={body.get('paused')} upstreams={body.get('upstreams_healthy')}"
        return PartStatus("gateway", ok, detail, f"carryover {body.get('version', '')}")
    except Exception as exc:  # noqa: BLE001
        return PartStatus("gateway", False, f"{url}: {exc.__class__.__name__}")


def gateway_disagreements(cfg: Any, timeout: float = 5.0
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


def check_flower(cfg: Any, timeout: float = 2.0) -> PartStatus:
    url = f"http://127.0.0.1:{cfg.services.flower_port}"
    try:
        import flower

        resp = requests.get(url + "/healthcheck", timeout=timeout)
        return PartStatus("flower", resp.ok and resp.text.strip() == "OK", url,
                          f"flower {flower.__version__}")
    except Exception as exc:  # noqa: BLE001
        return PartStatus("flower", False, f"{url}: {exc.__class__.__name__}")


def role_restarts(cfg: Any, timeout: float = 2.0) -> dict[str, int]:
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


def redis_outages(cfg: Any, timeout: float = 2.0) -> list[dict[str, Any]]:
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
    merged: list[dict[str, Any]] = []
    for rec in sorted((OutageRecord.from_json(r) for r in raw), key=lambda r: r.down_at):
        if merged and rec.down_at <= merged[-1]["up_at"] + 1.0:
            last = merged[-1]
            last["up_at"] = max(last["up_at"], rec.up_at)
            last["roles"].add(rec.role)
        else:
            merged.append({"down_at": rec.down_at, "up_at": rec.up_at, "roles": {rec.role}})
    for outage in merged:
        outage["seconds"] = outage["up_at"] - outage["down_at"]
    return merged


def environment(repo: Any = None) -> list[tuple[str, str]]:
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


def check_all(cfg: Any) -> list[PartStatus]:
    return [check_redis(cfg), *check_inference(cfg), check_gateway(cfg), *check_workers(),
            check_flower(cfg)]


def format_table(rows: list[PartStatus]) -> str:
    header = ("PART", "STATUS", "VERSION", "DETAIL")
    lines = [(r.part, "up" if r.ok else "DOWN", r.version, r.detail) for r in rows]
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(3)]
    return "\n".join(
        "  ".join(col.ljust(w) for col, w in zip(x[:3], widths, strict=True)) + "  " + x[3]
        for x in [header, *lines])
