"""The collocated update cycle, phase by phase, for the tiny model on the real vLLM server:
the trainer on verl's FSDP2 engine against the single-process reference path, in one run.

Starts its own Redis and vLLM (the inference environment; or uses a running stack's:
bench.stack's ``CARRYOVER_BENCH_ATTACH``), then repeats, alternating the two
paths: pause + drain (the gateway's Redis scripts, no traffic), update (a PPO step on a
synthetic batch of ``--samples`` captured calls), save (safetensors), reload + reset prefix
cache, probe, resume. Also reports the update's trained tokens per second.

Usage: python -m bench.weight_sync [--cycles 10] [--samples 128]   (prints JSON, then a table)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--samples", type=int, default=128)
    args = ap.parse_args(argv)
    from bench.stack import bench_stack

    with bench_stack(["redis", "inference"]) as (_, tmp):
        return run(args, tmp)


def run(args: argparse.Namespace, tmp: Path) -> int:
    from app.config import service_config
    from app.config.secrets import inference_api_key
    from app.state.connection import connect, resolve_redis_url
    from app.state.pause import Pause
    from bench.reference import PolicyTrainer
    from workers.trainer import weights
    from workers.trainer.batch import Sample, to_batch
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.verl_batch import to_verl_batch

    cfg = service_config()
    weights.use_api_key(inference_api_key(cfg))
    phases: dict[str, dict[str, list[float]]] = {"engine": {}, "reference": {}}

    def timed(path: str, name: str, fn, *a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        phases[path].setdefault(name, []).append(time.perf_counter() - t)
        return out

    rng = random.Random(0)
    samples = [Sample([1] + [rng.randrange(3, 27) for _ in range(21)],
                      [rng.randrange(3, 27) for _ in range(5)] + [2], [-3.3] * 6,
                      rng.random(), f"g{i // 8}", 1.0, 0) for i in range(args.samples)]
    trained_tokens = sum(len(s.response_ids) for s in samples)
    model_path = str(REPO / cfg.actor_rollout_ref.model.path)
    adm = Pause(connect(resolve_redis_url(cfg)))
    engine = EngineTrainer(cfg, model_path)
    reference = PolicyTrainer(cfg, model_path)
    ref_batch = to_batch(samples, reference.pad_id)
    url = cfg.inference.urls[0]
    dtype = weights.engine_dtype(cfg.inference.dtype, model_path)
    dname = str(dtype).replace("torch.", "")
    ids = weights.probe_ids(model_path)
    version = 0
    # The two paths alternate cycle by cycle, so both see the same machine.
    for _ in range(args.cycles):
        for path in ("engine", "reference"):
            version += 1
            start = time.perf_counter()
            timed(path, "pause_drain", lambda: (adm.pause(), adm.drain(5)))
            if path == "engine":
                timed(path, "update", engine.update, to_verl_batch(samples, engine.pad_id))
                out = timed(path, "save", weights.publish_version, tmp / "w", version, 2,
                            lambda d: engine.export_weights(d, dname))
                timed(path, "reload", weights.reload_weights, url, out)
                expected = engine.probe_log_probs(ids)
                probe_ids = ids
            else:
                timed(path, "update", reference.update, ref_batch)
                out = timed(path, "save", weights.save_weights, reference.model, tmp / "w",
                            version, 2)
                timed(path, "reload", weights.reload_weights, url, out)
                expected = weights.trainer_probe_logprobs(reference.model,
                                                          weights.PROBE_IDS, dtype)
                probe_ids = weights.PROBE_IDS
            # each path's previous weights are not what the server held last: no
            # "closer to new than old" check across paths
            timed(path, "probe", weights.verify_sync, url, cfg.inference.served_model_name,
                  expected, None, float(cfg.trainer.probe_tolerance), probe_ids)
            timed(path, "resume", adm.resume)
            phases[path].setdefault("cycle", []).append(time.perf_counter() - start)
    engine.close()

    med = {p: {k: statistics.median(v) for k, v in ph.items()} for p, ph in phases.items()}
    result = {
        "benchmark": "weight_sync", "machine": f"{os.cpu_count()} CPUs",
        "model": cfg.actor_rollout_ref.model.path, "engine_dtype": cfg.inference.dtype,
        "samples_per_update": args.samples, "trained_tokens_per_update": trained_tokens,
        "cycles": args.cycles,
        "median_seconds": med["engine"],
        "reference_median_seconds": med["reference"],
        "max_seconds": {k: max(v) for k, v in phases["engine"].items()},
        "update_tokens_per_s": {p: trained_tokens / med[p]["update"] for p in med},
    }
    print(json.dumps(result, indent=1))
    print("\n| phase | engine (verl FSDP2) median s | reference (single process) median s |"
          "\n|---|---|---|")
    for k in med["engine"]:
        print(f"| {k} | {med['engine'][k]:.4f} | {med['reference'][k]:.4f} |")
    tps = result["update_tokens_per_s"]
    print(f"| update: trained tokens/s | {tps['engine']:.0f} | {tps['reference']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
