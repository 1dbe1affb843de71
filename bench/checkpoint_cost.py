"""What a checkpoint after every update costs a step: none, written synchronously (the
step waits for the whole write), and written in the background (``trainer.
checkpoint_in_background``: the write runs while the driver collects the next step's groups,
and the next update waits only for what is left of it).

One ``EngineTrainer`` (verl's FSDP2 engine) on a config's model trains a synthetic batch; the
three modes take turns, one step each per round, so they are measured side by side. After
each step the benchmark idles ``--collect-s`` seconds, the time the driver spends collecting
the next step's groups (here it is idle; in a run the rollouts share the CPU, so the
background write's cost there lies between these figures and the synchronous one).

The figure per mode is the trainer's time per step: the update plus the save (synchronous)
or plus the wait for the previous write (background).

Usage: python -m bench.checkpoint_cost [--config config/arith.yaml] [--rounds 3]
       [--rows 8] [--collect-s 10] [--tiny]   (prints JSON)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "sync", "background")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="the run config whose model is trained")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--collect-s", type=float, default=10.0)
    ap.add_argument("--tiny", action="store_true", help="CI: the demo's model, 2 rounds, 1 s")
    args = ap.parse_args(argv)
    if args.tiny:
        args.config, args.rounds, args.rows, args.collect_s = None, 2, 4, 1.0

    from app.config import load_config
    from app.config.loader import repo_path
    from workers.trainer import checkpoint
    from workers.trainer.batch import Sample
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.verl_batch import to_verl_batch

    cfg = load_config(args.config, ["trainer.total_steps=1000"])
    model = repo_path(str(cfg.actor_rollout_ref.model.path))
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(str(model)).vocab_size)
    trainer = EngineTrainer(cfg, str(model))
    rng = random.Random(0)
    samples = []
    for i in range(args.rows):
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        resp = [rng.randrange(3, vocab) for _ in range(args.response_len)]
        samples.append(Sample(prompt, resp, [0.0] * len(resp), float(i % 2), f"g{i // 2}",
                              1.0, 0))
    vb = to_verl_batch(samples, trainer.pad_id)
    lp = trainer.log_probs(vb)
    for i, s in enumerate(samples):  # on-policy: importance weights near 1
        s.rollout_logprobs = lp[i][: len(s.response_ids)].tolist()
    vb = to_verl_batch(samples, trainer.pad_id)

    root = Path(tempfile.mkdtemp(prefix="carryover-ckpt-bench-"))
    saves = checkpoint.BackgroundSaves()
    per_mode: dict[str, dict[str, list[float]]] = {
        m: {"update_s": [], "save_or_wait_s": [], "write_s": []} for m in MODES}
    step = 0
    trainer.update(vb, step)  # warm-up, not timed
    try:
        for _ in range(args.rounds):
            for mode in MODES:
                step += 1
                t = time.monotonic()
                trainer.update(vb, step)
                update_s = time.monotonic() - t
                row = per_mode[mode]
                row["update_s"].append(update_s)

                def write(k: int = step) -> None:
                    checkpoint.save_checkpoint(trainer, root, "bench", k, k, {})

                if mode == "sync":
                    t = time.monotonic()
                    write()
                    row["save_or_wait_s"].append(time.monotonic() - t)
                    row["write_s"].append(row["save_or_wait_s"][-1])
                elif mode == "background":
                    saves.start(step, write)
                time.sleep(args.collect_s)
                if mode == "background":
                    row["save_or_wait_s"].append(saves.wait())
                    row["write_s"].append(saves.last_write_s or 0.0)
                elif mode == "none":
                    row["save_or_wait_s"].append(0.0)
        latest = checkpoint.latest_checkpoint(root, "bench")
        size = dir_bytes(latest) if latest else 0
    finally:
        saves.wait()
        trainer.close()
        shutil.rmtree(root, ignore_errors=True)

    result: dict = {"benchmark": "checkpoint_cost", "model": str(model),
                    "rows": args.rows, "collect_s": args.collect_s, "rounds": args.rounds,
                    "checkpoint_bytes": size, "modes": {}}
    for mode, row in per_mode.items():
        step_s = [u + s for u, s in zip(row["update_s"], row["save_or_wait_s"], strict=True)]
        result["modes"][mode] = {
            "trainer_step_s_median": statistics.median(step_s),
            "update_s_median": statistics.median(row["update_s"]),
            "save_or_wait_s_median": statistics.median(row["save_or_wait_s"]),
            "write_s_median": statistics.median(row["write_s"]) if row["write_s"] else 0.0,
            "trainer_step_s": step_s,
        }
    base = result["modes"]["none"]["trainer_step_s_median"]
    for mode in ("sync", "background"):
        result["modes"][mode]["extra_per_step_s"] = (
            result["modes"][mode]["trainer_step_s_median"] - base)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
