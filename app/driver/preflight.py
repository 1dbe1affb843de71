"""What a run is checked for before it is recorded or its stack started: inputs that every
rollout or step would otherwise fail on, one at a time, long after the command returned."""

from __future__ import annotations

import importlib
import logging
import os
import sys

from app.config.errors import ConfigError
from app.config.loader import REPO_ROOT
from app.config.schema import Config
from app.driver.dataset import check_files

log = logging.getLogger(__name__)


def check_agent(cfg: Config) -> None:
    """``controller.agent`` of the python backend names a callable the driver can import.

    The agent runs in the rollout workers; the driver imports it once to find the mistakes
    that would fail every rollout (a module or function that does not exist, an object that
    is not callable), so ``carryover train`` runs where the agent's module is importable, as
    the project's own are. A module that exists but fails to import here (a package or an
    environment variable only the workers have) is let through, with a warning."""
    if str(cfg.controller.backend) != "python":
        return
    ref = str(cfg.controller.agent)
    module_name, _, name = ref.partition(":")
    # looked for where the workers look: Celery puts its working directory (the
    # repository, as `carryover up` and the Procfile start them) on the path
    added = [p for p in (os.getcwd(), str(REPO_ROOT)) if p not in sys.path]
    sys.path[:0] = added
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError([f"controller.agent: value {ref!r}: no module {missing!r} on "
                               "this host's path (module:function, importable here and on "
                               "the rollout workers)"]) from None
        log.warning("controller.agent %r not checked: importing it here needs %r, which "
                    "this process lacks (the rollout workers must have it)", ref, missing)
        return
    except Exception as exc:  # noqa: BLE001 - its import fails here, perhaps not there
        log.warning("controller.agent %r not checked: importing it here raised %s: %s (the "
                    "rollout workers must be able to)", ref, exc.__class__.__name__, exc)
        return
    finally:
        for p in added:
            sys.path.remove(p)
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError([f"controller.agent: value {ref!r}: module {module_name!r} has no "
                           f"{name!r}"])
    if not callable(fn):
        raise ConfigError([f"controller.agent: value {ref!r} is a {type(fn).__name__}, not a "
                           "function the workers can call with (sample, llm, **agent)"])


def preflight(cfg: Config) -> list[dict[str, object]]:
    """Every check above; returns the training samples (``data.train_files``), read once."""
    samples = check_files(cfg)
    check_agent(cfg)
    return samples
