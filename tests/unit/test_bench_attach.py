"""A benchmark attached to a running stack (``$CARRYOVER_BENCH_ATTACH``) starts nothing: it
uses the stack ``$CARRYOVER_OVERRIDES`` describes, and refuses, naming them, roles that are
not up."""

from __future__ import annotations

import json
import os

import pytest

from bench import stack
from bench.stack import ATTACH_ENV, bench_stack, free_port


def test_attaching_to_a_stack_whose_roles_are_down_names_them(tmp_path, monkeypatch):
    monkeypatch.setenv(ATTACH_ENV, str(tmp_path / "bench"))
    monkeypatch.setenv("CARRYOVER_OVERRIDES", json.dumps([f"redis.port={free_port()}"]))
    monkeypatch.setattr(stack, "ATTACH_WAIT_S", 1.5)  # a few looks, not half a minute
    with pytest.raises(RuntimeError, match=r"not up: redis$"), bench_stack(["redis"]):
        pass


def test_attaching_yields_the_running_stack_and_the_given_directory(tmp_path, monkeypatch,
                                                                    redis_service):
    monkeypatch.setenv(ATTACH_ENV, str(tmp_path / "bench"))
    with bench_stack(["redis"], "services.rollout_concurrency=4") as (base, tmp):
        assert base == json.loads(os.environ["CARRYOVER_OVERRIDES"])  # the session's
        assert tmp == tmp_path / "bench" and tmp.is_dir()
    assert tmp.is_dir()  # kept: the stack may still read what a benchmark wrote there


def test_a_carryover_up_that_exits_at_start_is_reported_with_its_log(tmp_path, monkeypatch):
    """``carryover up`` refusing to start (its Redis port taken) ends the wait at once with
    the log's tail, not with an error from stopping a process that is gone."""
    import socket

    from bench.stack import carryover_up, stack_overrides

    monkeypatch.delenv("REDIS_URL", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        overrides = stack_overrides(tmp_path, f"redis.port={port}",
                                    f"logging.dir={tmp_path / 'runs'}")
        with pytest.raises(RuntimeError, match=r"carryover up exited:\n(.|\n)*already in use"), \
                carryover_up(overrides, tmp_path / "up.log", timeout=120):
            pytest.fail("carryover up came up on a taken port")
