"""What Redis durability costs, and what a Redis crash costs, on the demo under ``carryover up``.

For each ``redis.appendfsync`` mode (everysec, always) it brings the demo stack up with
``carryover up`` (its config, concurrency and model), runs ``carryover train`` for
``--steps`` steps and reports the median step seconds (the first step, which starts the
pool, left out), and the Redis write rate (``instantaneous_ops_per_sec`` is reads too, so
the AOF's growth per step is reported instead). With ``--kill-at K`` the embedded
``redis-server`` is SIGKILLed while step K collects: reported are how long each role's
Redis was unreachable (their outage records), step K's seconds against the median, and the
driver's log lines saying what it redid.

Usage: python -m bench.redis_fsync [--steps 8] [--modes everysec,always] [--kill-at 3]
Prints JSON per mode, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.stack import BIN, REPO, carryover_up, is_redis, stack_overrides


def run_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict:
    from app.state import keys
    from app.state.connection import connect, resolve_redis_url
    from app.state.records import OutageRecord

    overrides = stack_overrides(
        tmp, f"redis.appendfsync={mode}", f"logging.dir={tmp / 'runs'}",
        "logging.wandb_mode=disabled", f"trainer.weights_dir={tmp / 'w'}",
        f"trainer.checkpoint_dir={tmp / 'c'}", f"trainer.total_steps={args.steps}")
    # no deadline for the start: a slow machine is what a benchmark may measure
    with carryover_up(overrides, tmp / "up.log", timeout=float("inf")) as stack:
        cfg, env = stack.cfg, stack.env
        client = connect(resolve_redis_url(cfg))
        aof = tmp / "redis" / "appendonly.aof"
        train = subprocess.Popen([str(BIN / "carryover"), "train"], cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run_id = None
        killed = False
        sizes: dict[int, int] = {}
        while train.poll() is None:
            runs = list(client.scan_iter(keys.run("*") + ":metrics"))
            run_id = runs[0].split(":")[-2] if runs else None
            done = client.llen(keys.run_metrics(run_id)) if run_id else 0
            sizes.setdefault(done, aof.stat().st_size if aof.exists() else 0)
            if args.kill_at is not None and not killed and done == args.kill_at \
                    and not client.exists(keys.paused()):
                stack.kill_role(is_redis)
                killed = True
            time.sleep(0.02)
        out = train.communicate()[0]
        if train.returncode != 0:
            raise RuntimeError(out[-3000:])
        metrics = [json.loads(m) for m in client.lrange(keys.run_metrics(run_id), 0, -1)
                   if "timing/step_seconds" in json.loads(m)]
        seconds = {m["step"]: m["timing/step_seconds"] for m in metrics}
        steady = [s for step, s in seconds.items() if step > 0 and step != args.kill_at]
        growth = [sizes[k + 1] - sizes[k] for k in sorted(sizes)[1:-1] if k + 1 in sizes]
        result = {"mode": mode, "steps": len(seconds),
                  "median_step_s": statistics.median(steady),
                  "aof_bytes_per_step": statistics.median(growth) if growth else None}
        if killed:
            outages = [OutageRecord.from_json(r)
                       for r in client.lrange(keys.redis_outages(), 0, -1)]
            result.update({
                "killed_step_s": seconds.get(args.kill_at),
                "outage_s_by_role": {o.role: round(o.seconds, 2) for o in outages},
                "redone": [line for line in out.splitlines() if "redone" in line],
            })
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--modes", default="everysec,always")
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    rows = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"redis-fsync-{mode}-") as tmp:
            row = run_mode(mode, args, Path(tmp))
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| appendfsync | median step s | AOF bytes/step | killed step s |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['median_step_s']:.2f} | {r['aof_bytes_per_step']} | "
              f"{r.get('killed_step_s', '-')} |")


if __name__ == "__main__":
    main()
