"""The weight-sync cycle per ``inference.weight_sync`` mode, side by side in one run: the real
model (SmolLM2-135M-Instruct, bf16 serving) from verl's FSDP2 engine into the real vLLM CPU
server.

One server (started with vLLM's weight-transfer routes on) and one trainer; the modes
alternate cycle by cycle, each after an update that moves the weights, so both see the same
machine and the server always changes weights:
- ``disk``: the bf16 safetensors export (shared memory where it fits), ``reload_weights``
  and the prefix-cache reset;
- ``transfer``: the buckets through ``/update_weights`` (``workers/trainer/transfer.py``)
  and the reset.
Each cycle then verifies as the trainer does: the probe, and (transfer) the checksums.
Reported per mode: the median seconds of each phase, the bytes moved per sync, the largest
bucket (what shared memory held at once), and the trainer's peak resident memory.

Usage: python -m bench.sync_modes [--cycles 3] [--bucket-mb 256] [--tiny]  (prints JSON,
then a table)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("disk", "transfer")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--tiny", action="store_true", help="the demo's tiny model (a smoke run)")
    args = ap.parse_args(argv)

    from bench.stack import free_port, inference_server

    tmp = Path(tempfile.mkdtemp(prefix="carryover-bench-"))
    port = free_port()
    os.environ.setdefault("WANDB_MODE", "disabled")
    from app.config import load_config
    from app.config.secrets import inference_api_key
    from workers.trainer import weights
    from workers.trainer.batch import Sample
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.verl_batch import to_verl_batch

    base = None if args.tiny else str(REPO / "config" / "arith.yaml")
    cfg = load_config(base, [
        "trainer.device=cpu", f"inference.port={port}",
        f"inference.urls=[http://127.0.0.1:{port}]", "inference.weight_sync=transfer",
        "actor_rollout_ref.actor.lr=5e-4" if not args.tiny else "actor_rollout_ref.actor.lr=1e-2"])
    key = inference_api_key(cfg)
    weights.use_api_key(key)
    model = REPO / cfg.actor_rollout_ref.model.path
    name = str(cfg.inference.served_model_name)
    dtype = weights.engine_dtype(str(cfg.inference.dtype), model)
    dname = str(dtype).removeprefix("torch.")
    tol = float(cfg.trainer.probe_tolerance)
    bucket = int(args.bucket_mb * (1 << 20))

    trainer = EngineTrainer(cfg, str(model))
    ids = weights.probe_ids(model)
    batch = [Sample([1, 3, 4, 5, 9, 10], [6 + i, 7, 8, 2], [0.0] * 4, float(i % 2), "g0", 1.0,
                    0, rollout_id=f"r{i}") for i in range(4)]
    update_s: list[float] = []

    def update(step: int) -> None:
        nonlocal batch
        own = trainer.log_probs(to_verl_batch(batch, trainer.pad_id))
        batch = [Sample(s.prompt_ids, s.response_ids, own[i, :4].tolist(), s.reward,
                        s.group_id, 1.0, 0, rollout_id=s.rollout_id)
                 for i, s in enumerate(batch)]
        t = time.perf_counter()
        trainer.update(to_verl_batch(batch, trainer.pad_id), step)
        update_s.append(time.perf_counter() - t)

    phases: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    moved: dict[str, list[int]] = {m: [] for m in MODES}
    largest: dict[str, int] = {m: 0 for m in MODES}
    weights_dir = Path("/dev/shm") / f"carryover-bench-{os.getpid()}" \
        if Path("/dev/shm").is_dir() else tmp / "weights"
    digests: dict[str, str] | None = None
    with inference_server(cfg, tmp / "vllm.log") as (url, _):
        weights.engine_probe_logprobs(url, name, ids)  # the first probe warms the engine up
        weights.weight_checksums(url)
        previous = None
        version = 0
        for _ in range(args.cycles):
            for mode in MODES:
                version += 1
                update(version)
                expected = trainer.probe_log_probs(ids)
                ph = phases[mode]
                t0 = time.perf_counter()
                if mode == "disk":
                    path = weights.publish_version(weights_dir, version, 2,
                                                   lambda d: trainer.export_weights(d, dname))
                    t1 = time.perf_counter()
                    weights.reload_weights(url, path, version=version)
                    moved[mode].append((path / "model.safetensors").stat().st_size)
                    largest[mode] = max(largest[mode], moved[mode][-1])
                else:
                    t1 = t0  # no export: the gather feeds the buckets
                    sent = trainer.transfer_weights([url], dname, bucket, 600, key)
                    assert sent.loaded == [url], sent
                    weights.reset_prefix_cache(url, 600)
                    weights.set_version(url, version, 600)
                    moved[mode].append(sent.bytes_moved)
                    largest[mode] = max(largest[mode], sent.largest_bucket)
                t2 = time.perf_counter()
                weights.verify_sync(url, name, expected, previous, tol, ids)
                new = weights.weight_checksums(url)
                moved_probe = previous is not None and weights.mean_gap(expected, previous) > tol
                weights.check_checksums(url, new, digests, moved_probe)
                digests, previous = new, expected
                t3 = time.perf_counter()
                for k, v in (("export", t1 - t0), ("load", t2 - t1), ("verify", t3 - t2),
                             ("cycle", t3 - t0)):
                    ph.setdefault(k, []).append(v)
    trainer.close()
    import shutil

    shutil.rmtree(weights_dir, ignore_errors=True)
    med = {m: {k: statistics.median(v) for k, v in ph.items()} for m, ph in phases.items()}
    result = {
        "benchmark": "sync_modes", "machine": f"{os.cpu_count()} CPUs",
        "model": str(cfg.actor_rollout_ref.model.path), "engine_dtype": dname,
        "cycles": args.cycles, "bucket_mb": args.bucket_mb,
        "median_seconds": med,
        "bytes_per_sync": {m: statistics.median(v) for m, v in moved.items()},
        "largest_bucket_bytes": largest,
        "update_median_seconds": statistics.median(update_s),
        "trainer_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(json.dumps(result, indent=1))
    print("\n| weight_sync | export s | load s | verify s | cycle s | bytes per sync | "
          "largest bucket |\n|---|---|---|---|---|---|---|")
    for m in MODES:
        r = med[m]
        print(f"| {m} | {r['export']:.2f} | {r['load']:.2f} | {r['verify']:.2f} | "
              f"{r['cycle']:.2f} | {result['bytes_per_sync'][m] / 1e6:.0f} MB | "
              f"{largest[m] / 1e6:.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
