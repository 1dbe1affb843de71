"""A run whose config differs from the running gateway's on what the gateway serves by (its
sampling, the model, the LoRA switch, the tokenizer) is refused before anything starts,
naming each key; a run that agrees goes on. ``carryover status`` shows the differences."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import ConfigError, load_config
from app.driver.loop import _require_gateway_agrees
from app.services.health import gateway_disagreements
from tests.conftest import free_port, standin_gateway


@pytest.fixture(scope="module")
def hot_gateway(redis_service, tmp_root):
    """A gateway started with a rollout temperature of 0.7."""
    with standin_gateway(tmp_root, "agreement-tests",
                         "actor_rollout_ref.rollout.temperature=0.7") as (url, _, upstreams):
        yield url, upstreams[0][0]


def _cfg(gateway: str, upstream: str, *overrides: str):
    return load_config(None, [*json.loads(os.environ["CARRYOVER_OVERRIDES"]),
                              f"gateway.url={gateway}", f"inference.urls=[{upstream}]",
                              *overrides])


def test_a_run_that_differs_from_the_gateway_is_refused(hot_gateway):
    gateway, upstream = hot_gateway
    run = _cfg(gateway, upstream, "actor_rollout_ref.rollout.temperature=1.0",
               "actor_rollout_ref.model.lora_rank=8")
    found = gateway_disagreements(run)
    assert found is not None
    refused, noted = found
    assert len(refused) == 2 and noted == []
    assert refused[0].startswith("actor_rollout_ref.rollout.temperature: the running "
                                 "gateway serves with 0.7, this run's config says 1.0")
    assert refused[1].startswith("actor_rollout_ref.model.lora_rank:")
    with pytest.raises(ConfigError, match="temperature.*\n.*lora_rank.*\n.*carryover up"):
        _require_gateway_agrees(run)


def test_a_run_the_stacks_servers_cannot_load_is_refused(hot_gateway):
    """The servers were started from the gateway's config: a run that sends its weights
    by transfer to servers started without it, in another dtype, or as a LoRA adapter of a
    rank above theirs failed at its first weight load. A run may ask less of them than they
    offer."""
    from app.config.serving import disagreements, gateway_view

    gateway, upstream = hot_gateway
    run = _cfg(gateway, upstream, "actor_rollout_ref.rollout.temperature=0.7",
               "inference.weight_sync=transfer", "inference.dtype=bfloat16")
    refused, _ = gateway_disagreements(run)
    assert [line.split(":")[0] for line in refused] == [
        "inference.weight_sync", "inference.transfer_engine", "inference.dtype"]
    assert "serves with 'float32', this run's config says 'bfloat16'" in refused[2]

    def refused_keys(run: list[str], stack: list[str]) -> list[str]:
        found, _ = disagreements(gateway_view(load_config(None, run)),
                                 gateway_view(load_config(None, stack)))
        return [line.split(":")[0] for line in found]

    transfer, lora = "inference.weight_sync=transfer", "actor_rollout_ref.model.lora_rank="
    assert refused_keys([], [transfer]) == []  # disk loads into any server
    assert refused_keys([transfer, "inference.transfer_engine=shm"], [transfer]) == [
        "inference.transfer_engine"]  # as written: auto may pick another on another host
    # --max-lora-rank is vLLM's next value at or above the stack's rank: 16 for 10
    assert refused_keys([lora + "16"], [lora + "10"]) == []
    assert refused_keys([lora + "8"], [lora + "16"]) == []
    assert refused_keys([lora + "20"], [lora + "16"]) == ["inference.max_lora_rank"]
    # auto is the dtype vLLM serves the checkpoint in (the tiny model's float32: bfloat16)
    assert refused_keys(["inference.dtype=auto"], ["inference.dtype=bfloat16"]) == []


def test_a_run_that_agrees_goes_on(hot_gateway):
    gateway, upstream = hot_gateway
    run = _cfg(gateway, upstream, "actor_rollout_ref.rollout.temperature=0.70")
    assert gateway_disagreements(run) == ([], [])
    _require_gateway_agrees(run)
    # the default max_tokens (what a call gets when its agent sets none) is only reported
    longer = _cfg(gateway, upstream, "actor_rollout_ref.rollout.temperature=0.7",
                  "actor_rollout_ref.rollout.max_tokens=64")
    assert gateway_disagreements(longer) == ([], [
        "actor_rollout_ref.rollout.max_tokens: the running gateway serves with 16, this "
        "run's config says 64"])
    _require_gateway_agrees(longer)
    # a gateway that does not answer is not a disagreement (the run reports it as down)
    assert gateway_disagreements(_cfg(f"http://127.0.0.1:{free_port()}", upstream)) is None


def test_status_shows_where_the_config_differs(hot_gateway):
    gateway, upstream = hot_gateway
    carryover = Path(sys.executable).parent / "carryover"
    env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps([
        *json.loads(os.environ["CARRYOVER_OVERRIDES"]), f"gateway.url={gateway}",
        f"inference.urls=[{upstream}]"])}
    out = subprocess.run([str(carryover), "status", "actor_rollout_ref.rollout.temperature=1.0"],
                         env=env, capture_output=True, text=True, timeout=120).stdout
    assert ("config differs (carryover train would refuse it): "
            "actor_rollout_ref.rollout.temperature: the running gateway serves with 0.7, "
            "this run's config says 1.0") in out


@pytest.mark.parametrize("override,message", [
    ("data.train_files={bad}", "data.train_files: {bad}:2: not UTF-8 text (byte 24)"),
    ("data.val_files={missing}", "data.val_files: cannot read {missing} (No such file"),
    ("controller.agent=examples.reverse.agent:nosuch",
     "controller.agent: value 'examples.reverse.agent:nosuch': module"),
])
def test_a_bad_data_file_or_agent_stops_a_run_before_it_is_recorded(
        hot_gateway, redis_client, tmp_path, override, message):
    from app.driver.loop import train
    from app.state import keys

    gateway, upstream = hot_gateway
    bad, missing = tmp_path / "bad.jsonl", tmp_path / "missing.jsonl"
    bad.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    run = _cfg(gateway, upstream, "actor_rollout_ref.rollout.temperature=0.7",
               override.format(bad=bad, missing=missing))
    run_id = f"refused-{tmp_path.name}"
    with pytest.raises(ConfigError) as info:
        train(run, run_id=run_id)
    assert info.value.problems[0].startswith(message.format(bad=bad, missing=missing))
    assert not redis_client.exists(keys.run(run_id))
