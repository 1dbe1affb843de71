"""Secrets the processes of one deployment share: the gateway's admin token and the key the
inference servers demand on their OpenAI routes. Each is the config value, else an
environment variable, else generated once into a file under var/ (mode 0600) that every
process on this machine reads."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from app.config.errors import ConfigError
from app.config.loader import REPO_ROOT
from app.config.schema import Config
from app.config.validate import is_loopback

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


def admin_token(cfg: Config) -> str:
    """``gateway.admin_token`` > $CARRYOVER_ADMIN_TOKEN > var/admin-token."""
    return shared_secret(cfg.gateway.admin_token, "CARRYOVER_ADMIN_TOKEN", ADMIN_TOKEN_FILE)


def inference_api_key(cfg: Config) -> str:
    """The key the inference servers demand on ``/v1`` (vLLM's ``VLLM_API_KEY``), sent by
    the gateway and the trainer and never given to agents: ``inference.api_key`` >
    $CARRYOVER_INFERENCE_API_KEY > var/inference-api-key."""
    return shared_secret(cfg.inference.api_key, "CARRYOVER_INFERENCE_API_KEY",
                         INFERENCE_KEY_FILE)


def _beyond_loopback(host: str) -> bool:
    """``host`` (a bind address; Redis takes several, space-separated, each perhaps marked
    optional with a leading ``-``) lets other machines in."""
    return any(not is_loopback(h.lstrip("-")) for h in (str(host).split() or [""]))


# role -> (its bind address, the secret every host must share, its variable, the file a
# host generates its own into when neither is set, who on other hosts needs it)
_SHARED_SECRETS = {
    "redis": ("redis.host", "redis.password", "REDIS_PASSWORD", None,
              "anyone who reaches its port could read and rewrite every run's state"),
    "inference": ("inference.host", "inference.api_key", "CARRYOVER_INFERENCE_API_KEY",
                  "var/inference-api-key",
                  "the gateway and the trainer on other hosts would be refused"),
    "gateway": ("gateway.host", "gateway.admin_token", "CARRYOVER_ADMIN_TOKEN",
                "var/admin-token",
                "`carryover status` and `carryover train` on another host would be refused "
                "its admin routes"),
}
# the roles that call the inference servers, with the servers' key
_KEY_SENDERS = ("gateway", "trainer")


def shared_secret_problems(cfg: Config, role: str) -> list[str]:
    """What ``role`` lacks to start on this host beside others, one line each. A role bound
    beyond loopback serves other hosts, which must know its secret: the config (or the
    environment) names it, one for every host; a secret generated into var/ is this
    machine's alone, and Redis without a password would be open to all. A role that calls
    an inference server on another host sends it that server's key, which therefore must be
    named too."""
    out = []
    if role in _SHARED_SECRETS:
        bind, secret, env, generated, without = _SHARED_SECRETS[role]
        host = str(cfg.select(f"{role}.host"))
        if _beyond_loopback(host) and not cfg.select(secret) \
                and not os.environ.get(env):
            mine = f" (the one generated into {generated} is this machine's alone)" \
                if generated else ""
            out.append(f"{secret}: not set, and {bind} {host!r} opens the {role} server "
                       f"beyond this machine: {without}{mine}; set {secret} (or ${env}) to "
                       f"the same value on every host, or bind {bind} to 127.0.0.1")
    far = [u for u in cfg.inference.urls if not is_loopback(urlsplit(u).hostname or "")]
    if role in _KEY_SENDERS and far and not cfg.inference.api_key \
            and not os.environ.get("CARRYOVER_INFERENCE_API_KEY"):
        out.append(f"inference.api_key: not set, and inference.urls names a server on another "
                   f"host ({', '.join(far)}), which would refuse the {role}'s calls made with "
                   "this machine's own key (generated into var/inference-api-key); set "
                   "inference.api_key (or $CARRYOVER_INFERENCE_API_KEY) to the servers' key")
    return out


def check_shared_secret(cfg: Config, role: str) -> None:
    """Raise ``ConfigError`` with ``shared_secret_problems``, if any."""
    problems = shared_secret_problems(cfg, role)
    if problems:
        raise ConfigError(problems)
