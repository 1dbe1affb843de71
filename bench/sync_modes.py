"""The weight-sync cycle per ``inference.weight_sync`` mode, side by side in one run: the real
model (SmolLM2-135M-Instruct, bf16 serving) from verl's FSDP2 engine into the real vLLM CPU
server.

Two trainers (every weight, and a rank ``--lora-rank`` LoRA adapter) and two servers (one with
vLLM's weight-transfer routes on, one serving LoRA adapters); the modes alternate cycle by
cycle, each after an update that moves the weights, so all see the same machine:
- ``disk``: the bf16 safetensors export (shared memory where it fits), ``reload_weights``
  and the prefix-cache reset;
- ``transfer``: the buckets through ``/update_weights`` (``workers/trainer/transfer.py``)
  and the reset;
- ``lora``: the adapter's export, ``/v1/load_lora_adapter`` under the version's name, the
  reset, the older adapters unloaded.
Each cycle then verifies as the trainer does: the probe (against the version's adapter for
LoRA), and the checksums (full weights). Reported per mode: the median seconds of each phase
and the bytes moved per sync (transfer: the largest bucket too); per trainer: the update's
trained tokens/s, its trainable parameters and the bytes of its parameters, gradients and
optimizer state.

Usage: python -m bench.sync_modes [--cycles 3] [--bucket-mb 256] [--tiny]  (prints JSON,
then the tables)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("disk", "transfer", "lora")


def main(argv: list[str] | None = None) -> int:
    from bench.stack import bench_dir

    with bench_dir() as tmp:
        return run(argv, tmp)


def run(argv: list[str] | None, tmp: Path) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8, help="rows per update (timed)")
    ap.add_argument("--tiny", action="store_true", help="the demo's tiny model (a smoke run)")
    args = ap.parse_args(argv)

    from bench.stack import free_port, inference_servers

    port, lora_port = free_port(), free_port()
    os.environ.setdefault("WANDB_MODE", "disabled")
    from app.config import load_config
    from app.config.secrets import inference_api_key
    from app.config.settings import adapter_name
    from workers.trainer import weights
    from workers.trainer.engine import EngineTrainer

    base = None if args.tiny else str(REPO / "config" / "arith.yaml")
    common = ["trainer.device=cpu", f"inference.port={port}",
              f"inference.urls=[http://127.0.0.1:{port}]"]
    lr = "1e-2" if args.tiny else "5e-4"
    cfg = load_config(base, [*common, "inference.weight_sync=transfer",
                             f"actor_rollout_ref.actor.lr={lr}"])
    # a server of its own for LoRA: its base weights stay the model's, as the adapter's
    # trainer has them (the full trainer's loads change the other server's)
    lora_cfg = load_config(base, [
        "trainer.device=cpu", f"inference.port={lora_port}",
        f"inference.urls=[http://127.0.0.1:{lora_port}]",
        f"actor_rollout_ref.model.lora_rank={args.lora_rank}", "actor_rollout_ref.actor.lr=5e-3"])
    key = inference_api_key(cfg)
    weights.use_api_key(key)
    model = REPO / cfg.actor_rollout_ref.model.path
    name = str(cfg.inference.served_model_name)
    dname = str(weights.engine_dtype(str(cfg.inference.dtype), model)).removeprefix("torch.")
    tol = float(cfg.trainer.probe_tolerance)
    bucket = int(args.bucket_mb * (1 << 20))
    ids = weights.probe_ids(model)

    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    full = Trained(EngineTrainer(cfg, str(model)), args.rows, vocab)
    lora = Trained(EngineTrainer(lora_cfg, str(model)), args.rows, vocab)
    phases: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    moved: dict[str, list[int]] = {m: [] for m in MODES}
    largest: dict[str, int] = {m: 0 for m in MODES}
    weights_dir = Path("/dev/shm") / f"carryover-bench-{os.getpid()}" \
        if Path("/dev/shm").is_dir() else tmp / "weights"
    digests: dict[str, str] | None = None
    with inference_servers([(cfg, tmp / "vllm.log"), (lora_cfg, tmp / "vllm-lora.log")]) \
            as [(full_url, _), (lora_url, _)]:
        for url in (full_url, lora_url):
            weights.engine_probe_logprobs(url, name, ids)  # the first probe warms it up
        weights.weight_checksums(full_url)
        previous: dict[str, list[float] | None] = {"full": None, "lora": None}
        version = 0
        for _ in range(args.cycles):
            for mode in MODES:
                version += 1
                who = lora if mode == "lora" else full
                kind = "lora" if mode == "lora" else "full"
                url = lora_url if mode == "lora" else full_url
                who.update(version)
                expected = who.trainer.probe_log_probs(ids)
                served = name
                t0 = time.perf_counter()
                if mode == "transfer":
                    t1 = t0  # no export: the gather feeds the buckets
                    sent = who.trainer.transfer_weights([url], dname, bucket, 600, key)
                    assert sent.loaded == [url], sent
                    weights.after_load(url, 600, version=version)
                    moved[mode].append(sent.bytes_moved)
                    largest[mode] = max(largest[mode], sent.largest_bucket)
                else:
                    export = who.trainer.export_adapter if mode == "lora" \
                        else who.trainer.export_weights
                    path = weights.publish_version(weights_dir / mode, version, 2,
                                                   lambda d, f=export: f(d, dname))
                    t1 = time.perf_counter()
                    if mode == "lora":
                        served = adapter_name(name, version)
                        weights.load_adapter(url, served, path, 600)
                        for old in weights.served_adapters(url, name):
                            if old != served:
                                weights.unload_adapter(url, old)
                    else:
                        weights.reload_weights(url, path, version=version)
                    size = sum(f.stat().st_size for f in path.iterdir())
                    moved[mode].append(size)
                    largest[mode] = max(largest[mode], size)
                t2 = time.perf_counter()
                weights.verify_sync(url, served, expected, previous[kind], tol, ids)
                if mode != "lora":
                    new = weights.weight_checksums(url)
                    weights.check_checksums(url, new, digests, False)
                    digests = new
                previous[kind] = expected
                t3 = time.perf_counter()
                for k, v in (("export", t1 - t0), ("load", t2 - t1), ("verify", t3 - t2),
                             ("cycle", t3 - t0)):
                    phases[mode].setdefault(k, []).append(v)
    import shutil

    shutil.rmtree(weights_dir, ignore_errors=True)
    med = {m: {k: statistics.median(v) for k, v in ph.items()} for m, ph in phases.items()}
    trainers = {k: t.figures() for k, t in (("full", full), ("lora", lora))}
    full.trainer.close()
    lora.trainer.close()
    result = {
        "benchmark": "sync_modes", "machine": f"{os.cpu_count()} CPUs",
        "model": str(cfg.actor_rollout_ref.model.path), "engine_dtype": dname,
        "cycles": args.cycles, "bucket_mb": args.bucket_mb, "lora_rank": args.lora_rank,
        "median_seconds": med,
        "bytes_per_sync": {m: statistics.median(v) for m, v in moved.items()},
        "largest_bucket_bytes": largest,
        "trainers": trainers,
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(json.dumps(result, indent=1))
    print("\n| weight sync | export s | load s | verify s | cycle s | bytes per sync |"
          "\n|---|---|---|---|---|---|")
    for m in MODES:
        r = med[m]
        print(f"| {m} | {r['export']:.2f} | {r['load']:.2f} | {r['verify']:.2f} | "
              f"{r['cycle']:.2f} | {result['bytes_per_sync'][m] / 1e6:.1f} MB |")
    print("\n| trainer | update s (median) | trained tokens/s | trainable parameters | "
          "engine state GB |\n|---|---|---|---|---|")
    for k, f in trainers.items():
        print(f"| {k} | {f['update_s']:.2f} | {f['tokens_per_s']:.0f} | "
              f"{f['trainable_parameters']:,} | {f['state_gb']:.2f} |")
    return 0


class Trained:
    """One trainer and its batch: ``rows`` rows of a group whose rewards differ, with the
    old log-probs its own (PPO's ratio does not clip the step)."""

    def __init__(self, trainer, rows: int, vocab: int) -> None:
        import random

        from workers.trainer.batch import Sample

        rng = random.Random(0)
        self.trainer = trainer
        top = min(vocab, 2000)
        self.batch = [Sample([1] + [rng.randrange(3, top) for _ in range(47)],
                             [rng.randrange(3, top) for _ in range(31)] + [2], [0.0] * 32,
                             float(i % 2), "g0", 1.0, 0, rollout_id=f"r{i}")
                      for i in range(rows)]
        self.update_s: list[float] = []

    def update(self, step: int) -> None:
        from workers.trainer.batch import Sample
        from workers.trainer.verl_batch import to_verl_batch

        tr = self.trainer
        own = tr.log_probs(to_verl_batch(self.batch, tr.pad_id))
        self.batch = [Sample(s.prompt_ids, s.response_ids, own[i, :32].tolist(), s.reward,
                             s.group_id, 1.0, 0, rollout_id=s.rollout_id)
                      for i, s in enumerate(self.batch)]
        t = time.perf_counter()
        tr.update(to_verl_batch(self.batch, tr.pad_id), step)
        self.update_s.append(time.perf_counter() - t)

    def figures(self) -> dict[str, float]:
        mem = self.trainer.memory("now")
        state = sum(v for k, v in mem.items() if k.endswith("allocated_gb"))
        tokens = sum(len(s.response_ids) for s in self.batch)
        best = statistics.median(self.update_s)
        return {"update_s": best, "tokens_per_s": tokens / best,
                "trainable_parameters": self.trainer.ranks.call("trainable_count")[0],
                "state_gb": state}


if __name__ == "__main__":
    sys.exit(main())
