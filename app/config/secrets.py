"""Secrets the processes of one deployment share: the gateway's admin token and the key the
inference servers demand on their OpenAI routes. Each is the config value, else an
environment variable, else generated once into a file under var/ (mode 0600) that every
process on this machine reads."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from app.config.loader import REPO_ROOT

ADMIN_TOKEN_FILE = REPO_ROOT / "var" / "admin-token"
INFERENCE_KEY_FILE = REPO_ROOT / "var" / "inference-api-key"


def shared_secret(value: str | None, env: str, file: Path) -> str:
    """``value`` > ``$env`` > the token in ``file`` (generated there the first time)."""
    token = value or os.environ.get(env)
    if token:
        return token
    path = Path(file)
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # written whole under another name, then linked into place: a process starting at the
    # same moment sees no file or the whole token, never an empty one
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    try:
        os.link(tmp, path)
    except FileExistsError:  # another process linked its own first: use theirs
        token = path.read_text().strip()
    finally:
        tmp.unlink()
    return token


def admin_token(cfg: Any) -> str:
    """``gateway.admin_token`` > $CARRYOVER_ADMIN_TOKEN > var/admin-token."""
    return shared_secret(cfg.gateway.admin_token, "CARRYOVER_ADMIN_TOKEN", ADMIN_TOKEN_FILE)


def inference_api_key(cfg: Any) -> str:
    """The key the inference servers demand on ``/v1`` (vLLM's ``VLLM_API_KEY``), sent by
    the gateway and the trainer and never given to agents: ``inference.api_key`` >
    $CARRYOVER_INFERENCE_API_KEY > var/inference-api-key."""
    return shared_secret(cfg.inference.get("api_key"), "CARRYOVER_INFERENCE_API_KEY",
                         INFERENCE_KEY_FILE)
