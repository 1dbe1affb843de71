"""The collocated update cycle, phase by phase, for the tiny model on the real vLLM server.

Starts its own Redis and vLLM (the inference environment), then repeats: pause + drain (the
gateway's Redis scripts, no traffic), update (verl PPO step on a synthetic batch of
``--samples`` captured calls), save (safetensors), reload + reset prefix cache, probe, resume.

Usage: python -m bench.weight_sync [--cycles 10] [--samples 128]   (prints JSON, then a table)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--samples", type=int, default=128)
    args = ap.parse_args(argv)

    from bench.gateway import free_port

    tmp = Path(tempfile.mkdtemp(prefix="carryover-bench-"))
    inf_port = free_port()
    os.environ.pop("REDIS_URL", None)
    os.environ["CARRYOVER_OVERRIDES"] = json.dumps([
        f"redis.port={free_port()}", f"redis.dir={tmp / 'redis'}",
        f"inference.port={inf_port}", f"inference.urls=[http://127.0.0.1:{inf_port}]"])
    from app.config import service_config
    from app.services.supervisor import Supervisor
    from app.state.connection import connect, resolve_redis_url
    from gateway.admission import Admission
    from workers.trainer import weights
    from workers.trainer.batch import Sample, to_batch
    from workers.trainer.update import PolicyTrainer

    cfg = service_config()
    phases: dict[str, list[float]] = {}

    def timed(name: str, fn, *a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        phases.setdefault(name, []).append(time.perf_counter() - t)
        return out

    rng = random.Random(0)
    samples = [Sample([1] + [rng.randrange(3, 27) for _ in range(21)],
                      [rng.randrange(3, 27) for _ in range(5)] + [2], [-3.3] * 6,
                      rng.random(), f"g{i // 8}", 1.0, 0) for i in range(args.samples)]
    with Supervisor(cfg, log_dir=tmp / "logs") as sup:
        sup.start(["redis", "inference"])
        adm = Admission(connect(resolve_redis_url(cfg)))
        trainer = PolicyTrainer(cfg, str(REPO / cfg.actor_rollout_ref.model.path))
        batch = to_batch(samples, trainer.pad_id)
        url = cfg.inference.urls[0]
        dtype = weights.engine_dtype(cfg.inference.dtype)
        previous = None
        for version in range(1, args.cycles + 1):
            start = time.perf_counter()
            timed("pause_drain", lambda: (adm.pause(), adm.drain(5)))
            timed("update", trainer.update, batch)
            path = timed("save", weights.save_weights, trainer.model, tmp / "w", version, 2)
            timed("reload", weights.reload_weights, url, path)
            expected = weights.trainer_probe_logprobs(trainer.model, weights.PROBE_IDS, dtype)
            timed("probe", weights.verify_sync, url, cfg.inference.served_model_name,
                  expected, previous, float(cfg.trainer.probe_tolerance))
            previous = expected
            timed("resume", adm.resume)
            phases.setdefault("cycle", []).append(time.perf_counter() - start)

    result = {
        "benchmark": "weight_sync", "machine": f"{os.cpu_count()} CPUs",
        "model": cfg.actor_rollout_ref.model.path, "engine_dtype": cfg.inference.dtype,
        "samples_per_update": args.samples, "cycles": args.cycles,
        "median_seconds": {k: statistics.median(v) for k, v in phases.items()},
        "max_seconds": {k: max(v) for k, v in phases.items()},
    }
    print(json.dumps(result, indent=1))
    print("\n| phase | median s | max s |\n|---|---|---|")
    for k in phases:
        print(f"| {k} | {result['median_seconds'][k]:.4f} | {result['max_seconds'][k]:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
