"""Each benchmark runs in a tiny configuration and prints well-formed JSON. (The figures
themselves are not asserted: timing goals belong to the benchmarks, not to tests.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.stack import ATTACH_ENV
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def run_bench(*args: str, attach: Path | None = None, overrides: list[str] | None = None
              ) -> dict:
    """``attach``: a directory for the benchmark, which then runs on the session's stack
    (bench.stack's ATTACH_ENV) instead of starting every role of its own; ``overrides``:
    the stack's, when not the session's own."""
    env = {**os.environ, ATTACH_ENV: str(attach)} if attach else None
    if env is not None and overrides is not None:
        env["CARRYOVER_OVERRIDES"] = json.dumps(overrides)
    out = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    start = 0 if text.startswith("{") else text.index("\n{\n") + 1
    return json.loads(text[start: text.index("\n}\n", start) + 2])


@pytest.fixture
def session_stack(celery_workers, gateway_service, vllm_service, redis_client) -> None:
    """Every role of the session's stack up, and a clean slate of the project's keys, for a
    benchmark to attach to."""


def test_gateway_bench_json():
    # enough calls per load that each process's CPU time spans many clock ticks (10 ms)
    r = run_bench("bench.gateway", "--requests", "400", "--rounds", "1")
    assert r["benchmark"] == "gateway"
    for key in ("direct@1", "gateway@1", "bare_proxy@1", "direct@8", "gateway@8",
                "bare_proxy@8"):
        assert set(r["results"][key]) == {"rps", "p50_ms", "p99_ms"}
        assert r["results"][key]["rps"] > 0
    assert {"added_p50_ms@1", "added_p99_ms@8", "gateway_rps@8", "bare_proxy_added_p50_ms@1",
            "bare_proxy_rps@8"} <= set(r)
    ratio = r["gateway_rps@8"] / r["bare_proxy_rps@8"]
    assert r["gateway_rps_vs_bare_proxy@8"] == pytest.approx(ratio)
    # each proxy's own CPU per call was measured, and the upstream's
    assert r["gateway_cpu_ms_per_request@8"] > 0 and r["bare_proxy_cpu_ms_per_request@8"] > 0
    for conns in (1, 8):
        for name in ("gateway", "bare_proxy", "standin_via_gateway"):
            assert r[f"{name}_cpu_ms_per_request@{conns}"] >= 0
    assert r["captured_calls"] >= 900  # every call through the gateway was captured


def test_weight_sync_bench_json(tmp_path, session_stack, vllm_service, redis_client):
    from app.state.pause import Pause
    from workers.trainer import weights

    try:
        r = run_bench("bench.weight_sync", "--cycles", "2", "--samples", "16",
                      attach=tmp_path / "bench")
    finally:  # the session's gateway resumed, its server back on the model's weights
        Pause(redis_client).resume()
        weights.reload_weights(vllm_service, REPO / "var" / "models" / "tiny-qwen2")
    assert r["benchmark"] == "weight_sync" and r["cycles"] == 2
    assert set(r["median_seconds"]) == {"pause_drain", "update", "save", "reload", "probe",
                                        "resume", "cycle"}
    med = r["median_seconds"]
    # each cycle timed its phases in turn (medians of each, so the sum only roughly)
    assert all(med[k] > 0 for k in ("update", "save", "reload", "probe", "cycle"))
    assert med["cycle"] >= max(med["update"], med["reload"])
    assert set(r["reference_median_seconds"]) == set(r["median_seconds"])
    assert r["update_tokens_per_s"]["engine"] > 0 and r["update_tokens_per_s"]["reference"] > 0


def test_async_vs_sync_bench_json(tmp_path, session_stack):
    r = run_bench("bench.async_vs_sync", "--quick", "--out", str(tmp_path),
                  attach=tmp_path / "bench")
    assert r["benchmark"] == "async_vs_sync" and "ideal_formula" in r and "warmup_rule" in r
    assert {x["mode"] for x in r["results"]} == {"sync", "async x2", "async x2 cap 1 cancel",
                                                 "async x2 cap 1 wait"}
    for x in r["results"]:
        assert x["steps_timed"] == 3 and x["warmup_steps"] >= 1
        assert x["trained_rollouts_per_s"] > 0 and x["steps_per_min"] > 0
        # the attached stack's slots make the ideal far above what quick mode's few groups
        # can reach: a mode above it is an error, tested in test_bench_ideal
        assert x["fraction_of_ideal"] == pytest.approx(
            x["trained_rollouts_per_s"] / x["ideal_rollouts_per_s"]) and x["fraction_of_ideal"] > 0
        g = x["groups"]  # every dispatched group accounted for
        assert g["dispatched"] == g["trained"] + g["cancelled"] + g["dropped"] + g["in_flight"]
        assert 0 <= x["slot_utilisation"] <= 1.0 + 1e-6 and x["waste_slot_s"] >= 0
        assert x["unfinished_rollouts_mean"] >= 0 and 0 <= x["time_unfinished_below_slots"] <= 1
        age = x["sample_age_versions"]
        assert 0 <= age["mean"] <= age["max"] and age["p90"] <= age["max"]
        assert x["sample_version_lag_mean"] >= 0
    sync = next(x for x in r["results"] if x["mode"] == "sync")
    assert sync["speedup_vs_sync"] == 1.0 and sync["groups"]["cancelled"] == 0
    capped = next(x for x in r["results"] if x["mode"] == "async x2 cap 1 cancel")
    assert capped["sample_age_versions"]["max"] <= 1  # the cap bounds what is trained
    waiting = next(x for x in r["results"] if x["mode"] == "async x2 cap 1 wait")
    # nothing is cancelled: a group past the cap is trained by the step that waits for it;
    # with twice a batch active, at most two batches are overdue at once, so a trained group
    # is at most cap + 2 = 3 versions old
    assert waiting["groups"]["cancelled"] == 0 and waiting["waste_slot_s"] == 0
    assert waiting["sample_age_versions"]["max"] <= 3 and waiting["wait_for_overdue_s_mean"] >= 0
    png = (tmp_path / "async_vs_sync.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_overhead_bench_json():
    r = run_bench("bench.overhead", "--steps", "4", "--warmup", "1", "--tbs", "2", "--n", "2",
                  "--slots", "4")
    assert r["benchmark"] == "overhead"
    assert r["groups_selected"] == 8 and r["rollouts"] == 16
    lat = r["dispatch_to_selected_ms"]
    assert 0 < lat["p50"] <= lat["p99"]
    # every rollout costs Redis work (broker, result backend, our records)
    assert r["redis_commands_per_rollout"] > 5
    assert r["celery_tasks_per_s"] > 0 and r["rollouts_per_s"] > 0


def test_scale_bench_json():
    r = run_bench("bench.scale", "--sizes", "20,60", "--steps", "3", "--tbs", "4", "--n", "2",
                  "--slots", "32", "--median-s", "0.05")
    assert r["benchmark"] == "scale"
    assert [x["active_groups"] for x in r["results"]] == [20, 60]
    for x in r["results"]:
        assert x["active_rollouts"] == 2 * x["active_groups"]
        assert x["fill_s"] > 0 and x["bookkeeping_ms_per_selected_group"] > 0
        # a number, not asserted positive: at 20-60 groups the allocator's noise dominates
        assert isinstance(x["redis_bytes_per_active_rollout"], float)
        assert x["completed_to_selected_ms"]["p50"] <= x["completed_to_selected_ms"]["p99"]
    assert r["results"][0]["bookkeeping_vs_smallest"] == 1.0


def test_gpu_trainer_bench_tiny_json(tmp_path):
    r = run_bench("bench.gpu_trainer", "--tiny", "--kl", "--dynamic-bsz", "--steps", "3",
                  "--ipc", "--out", str(tmp_path))
    assert r["benchmark"] == "gpu_trainer" and r["device"] == "cpu" and r["failed"] == []
    assert r["master_dtype"] == "float32" and r["compute_dtype"] == "bfloat16"
    assert len(r["update_seconds"]) == 3 and r["trained_tokens_per_s"] > 0
    assert r["skipped_steps"] == 0
    # the SFT gave the model peaked logits (a uniform one scores ln 512 = 6.24 nats)
    assert r["sft_loss"]["last"] < r["sft_loss"]["first"] - 1
    # bf16 compute against an fp32 forward of the same weights: close, not equal
    assert 0 < r["logprob_gap_engine_vs_hf"]["mean"] < 0.05
    # the reference path: no KL before the first step moved the actor, some after
    assert len(r["kl_loss"]) == 3 and r["kl_loss"][0] == 0 and r["kl_loss"][-1] > 0
    assert r["export"]["tensors"] > 0 and r["export"]["differing_tensors"] == 0
    assert r["export"]["changed_tensors"] > 0  # the updates moved the exported weights
    assert r["ipc"] == {"skipped": "CUDA IPC needs a GPU"}  # on the GPU: two syncs, checked
    assert set(r["memory_gb"]) >= {"after_update_allocated_gb",
                                   "before_kv_cache_wake_allocated_gb"}
    # a threshold the figures miss fails the run, naming the figure
    out = subprocess.run([sys.executable, "-m", "bench.gpu_trainer", "--tiny", "--steps", "1",
                          "--max-gap", "1e-6", "--out", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1
    assert "FAILED logprob_gap_engine_vs_hf.mean" in out.stderr
    # an SFT too short to peak the logits fails the run too (its gap would mean little)
    out = subprocess.run([sys.executable, "-m", "bench.gpu_trainer", "--tiny", "--steps", "1",
                          "--sft-steps", "2", "--out", str(tmp_path / "flat")], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env={
                             **os.environ, "OUT": str(tmp_path)})
    assert out.returncode == 1 and "FAILED sft_loss.last" in out.stderr
    # the figures so far were written phase by phase
    partial = json.loads((tmp_path / "gpu_trainer.partial.json").read_text())
    assert partial["failed"] and partial["sft_loss"]["last"] > 3


def test_checkpoint_cost_bench_json():
    r = run_bench("bench.checkpoint_cost", "--tiny")
    assert r["benchmark"] == "checkpoint_cost" and r["checkpoint_bytes"] > 0
    modes = r["modes"]
    assert set(modes) == {"none", "sync", "background"}
    assert all(len(m["trainer_step_s"]) == 2 for m in modes.values())
    assert modes["none"]["write_s_median"] == 0.0
    assert modes["sync"]["write_s_median"] > 0 and modes["background"]["write_s_median"] > 0


def test_rerender_bench_json(tmp_path, tmp_root, smollm2_server, redis_client):
    """On the session's SmolLM2 server (served as config/arith.yaml serves it), behind a
    gateway on that config, as the benchmark's own stack would be."""
    from urllib.parse import urlsplit

    from tests.conftest import SMOLLM2_SESSION_SERVING, gateway_process

    arith = REPO / "config" / "arith.yaml"
    served = [f"inference.port={urlsplit(smollm2_server).port}", *SMOLLM2_SESSION_SERVING]
    with gateway_process(tmp_root, "gateway-rerender", [smollm2_server], *served,
                         config=arith) as (gateway, _):
        overrides = [*json.loads(os.environ["CARRYOVER_OVERRIDES"]), *served,
                     f"inference.urls=[{smollm2_server}]", f"gateway.url={gateway}",
                     f"gateway.port={urlsplit(gateway).port}"]
        r = run_bench("bench.rerender", "--rollouts", "1", "--kinds", "openai-chat",
                      attach=tmp_path / "bench", overrides=overrides)
    assert r["benchmark"] == "rerender" and r["model"] == "smollm2-135m-instruct"
    kinds = r["kinds"]["openai-chat"]
    assert set(kinds) == {"continuity", "rendered"}
    for row in kinds.values():
        assert row["rollouts"] == 1 and row["calls"] >= 1
    assert kinds["continuity"]["packed_calls"] >= kinds["rendered"]["packed_calls"]


def test_drain_modes_bench_json(tmp_path, session_stack):
    r = run_bench("bench.drain_modes", "--quick", attach=tmp_path)
    assert r["benchmark"] == "drain_modes"
    assert [x["drain_mode"] for x in r["results"]] == ["wait", "keep", "abort", "continue"]
    for x in r["results"]:
        assert x["steps_timed"] == 2 and x["trained_rollouts_per_s"] > 0
        assert {"pause_s_per_step", "gateway_paused_s_per_step", "frozen_calls_per_step",
                "aborted_calls_per_step", "continued_calls_per_step", "trainer_idle_fraction",
                "mixed_version_samples_per_step"} <= set(x)
    wait, keep, abort, carry = r["results"]
    # only keep freezes calls, only abort ends them, only continue carries them on
    assert wait["frozen_calls_per_step"] == abort["frozen_calls_per_step"] == 0
    assert carry["frozen_calls_per_step"] == 0
    assert wait["aborted_calls_per_step"] == keep["aborted_calls_per_step"] == 0
    assert carry["aborted_calls_per_step"] == 0
    assert wait["continued_calls_per_step"] == keep["continued_calls_per_step"] == 0
    assert abort["continued_calls_per_step"] == 0


def test_sync_modes_bench_json():
    r = run_bench("bench.sync_modes", "--tiny", "--cycles", "1", "--bucket-mb", "0.5")
    assert r["benchmark"] == "sync_modes"
    assert set(r["median_seconds"]) == {"disk", "transfer", "lora"}
    for mode, phases in r["median_seconds"].items():
        assert phases["load"] > 0 and phases["verify"] > 0, mode
    # the same tensors move either way (the safetensors header aside), and a transfer holds
    # at most one bucket (or one larger tensor) in shared memory; an adapter is a fraction
    disk, sent = r["bytes_per_sync"]["disk"], r["bytes_per_sync"]["transfer"]
    assert abs(disk - sent) < 0.01 * disk
    assert r["largest_bucket_bytes"]["transfer"] < r["largest_bucket_bytes"]["disk"]
    assert r["bytes_per_sync"]["lora"] < disk / 4
    full, lora = r["trainers"]["full"], r["trainers"]["lora"]
    assert lora["trainable_parameters"] < full["trainable_parameters"] / 4
    assert full["tokens_per_s"] > 0 and lora["tokens_per_s"] > 0
