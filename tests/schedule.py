"""How ``make test`` shares the suite between its pytest-xdist workers (``-n 2 --dist
loadgroup``: one per core of the CI machine).

Most tests wait on something (a server's start, a pause, a heartbeat) for part of their
time, so two workers finish the suite sooner than one even on two cores. Each worker has
its own session services (Redis, vLLM, gateway, Celery workers: tests/conftest.py gives each
process its own ports and data directory).

- Each module is one unit of work, so its module-scoped fixtures are set up once, on one
  worker. The modules in ``APART`` are the exception: their tests start everything they use
  themselves, and each test is a unit of its own.
- Units go out heaviest first (xdist hands the next unit to whichever worker frees up), so
  the suite does not end with one worker idle while the other runs a long test.
"""

from __future__ import annotations

import pytest

APART = frozenset({"tests/integration/test_bench.py", "tests/faults/test_redis_crash.py"})

# Seconds in one serial run on 2 cores (``--durations=0``), rounded: only their order
# matters, and a module or test missing here goes after the ones listed, in file order.
SECONDS = {
    "tests/integration/test_agent_sdks.py": 152,
    "tests/integration/test_lora.py": 126,
    "tests/faults/test_inference_restart.py": 86,
    "tests/faults/test_redis_crash.py::test_redis_killed_at_three_points_of_a_step": 70,
    "tests/faults/test_redis_crash.py::test_redis_killed_under_the_demo_load": 67,
    "tests/integration/test_real_model.py": 65,
    "tests/integration/test_bench.py::test_rerender_bench_json": 60,
    "tests/integration/test_bench.py::test_async_vs_sync_bench_json": 57,
    "tests/integration/test_weight_transfer.py": 56,
    "tests/integration/test_bench.py::test_drain_modes_bench_json": 50,
    "tests/integration/test_kubernetes.py": 48,
    "tests/faults/test_role_restart.py": 48,
    "tests/integration/test_bench.py::test_sync_modes_bench_json": 46,
    "tests/faults/test_worker_kills.py": 45,
    "tests/faults/test_redis_crash.py::test_messages_delivered_before_the_crash_are_redelivered":
        45,
    "tests/integration/test_demo.py": 41,
    "tests/integration/test_stack.py": 40,
    "tests/faults/test_engine_sleep.py": 38,
    "tests/faults/test_upstreams.py": 34,
    "tests/integration/test_bench.py::test_weight_sync_bench_json": 33,
    "tests/integration/test_ipc_transfer.py": 31,
    "tests/unit/test_redis_reconnect.py": 30,
    "tests/faults/test_security.py": 30,
    "tests/unit/test_engine.py": 25,
    "tests/integration/test_tied_weights.py": 23,
    "tests/faults/test_gateway_drain.py": 23,
    "tests/faults/test_agent_rides_pauses.py": 22,
    "tests/integration/test_collector.py": 22,
    "tests/integration/test_bench.py::test_gpu_trainer_bench_tiny_json": 21,
    "tests/faults/test_load.py": 20,
    "tests/faults/test_resident_trainer.py": 20,
    "tests/integration/test_recipe.py": 18,
    "tests/integration/test_generation_config.py": 18,
    "tests/faults/test_context_overflow.py": 18,
    "tests/faults/test_sampling.py": 17,
    "tests/integration/test_ray_trainer.py": 16,
    "tests/integration/test_bench.py::test_checkpoint_cost_bench_json": 15,
    "tests/integration/test_bench.py::test_scale_bench_json": 14,
    "tests/unit/test_model_builder.py": 12,
}


def unit_of(item: pytest.Item) -> str:
    """The unit of work ``item`` belongs to: its module, or itself for a module in APART."""
    module = item.nodeid.split("::", 1)[0]
    return item.nodeid if module in APART else module


def distribute(items: list[pytest.Item]) -> None:
    """Mark each module's tests as one xdist group (APART's tests stay ungrouped), and
    order ``items`` heaviest unit first, in place."""
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        unit = unit_of(item)
        first_seen.setdefault(unit, index)
        if unit != item.nodeid:
            item.add_marker(pytest.mark.xdist_group(unit))
    items.sort(key=lambda item: (-SECONDS.get(unit_of(item), 0), first_seen[unit_of(item)]))
