"""The Procfile (``honcho start``) and the commands ``carryover up`` runs agree, so the two
ways of starting the stack give the same workers."""

from __future__ import annotations

import shlex

import pytest

from app.config import load_config
from app.services.commands import worker_command
from tests.conftest import REPO


def options(argv: list[str]) -> dict[str, str | None]:
    """Celery worker options as a mapping (order-free; flags map to None)."""
    out: dict[str, str | None] = {}
    i = argv.index("worker") + 1
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = None
            i += 1
    out.pop("--loglevel", None)
    return out


def procfile() -> dict[str, list[str]]:
    lines = (REPO / "Procfile").read_text().splitlines()
    return {role: shlex.split(cmd) for role, cmd in (ln.split(":", 1) for ln in lines if ln)}


@pytest.mark.parametrize("role", ["rollout", "groups", "trainer"])
def test_procfile_workers_match_the_role_commands(role):
    cfg = load_config(None, [])
    assert options(procfile()[role]) == options(worker_command(cfg, role).argv)


def test_procfile_names_every_role():
    from app.services.commands import ROLES

    assert set(procfile()) == set(ROLES)


@pytest.mark.parametrize("given, queues, slots", [
    (None, ["rollout"], 7),       # no -c: the config's slots
    (3, ["rollout"], None),       # -c given: left alone, the CLI value wins
    (None, ["groups"], None),     # other roles: Celery's own default
    (None, "rollout,groups", 7),
])
def test_a_rollout_worker_without_c_takes_the_configs_slots(given, queues, slots, monkeypatch):
    import json
    from types import SimpleNamespace

    from app.celery_app import rollout_slots

    monkeypatch.setenv("CARRYOVER_OVERRIDES", json.dumps(["services.rollout_concurrency=7"]))
    conf = SimpleNamespace(worker_concurrency=None)
    rollout_slots(conf=conf, options={"concurrency": given, "queues": queues})
    assert conf.worker_concurrency == slots
