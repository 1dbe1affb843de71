"""Time to accuracy, asynchronous against synchronous training, on the long-running agent.

Runs ``carryover demo --compare`` ``--runs`` times (each: a stack of its own, the
asynchronous run then the synchronous one on the same task, data order, groups per update
and number of updates; the test suite's latencies are drawn afresh in each), then reports
per mode, median and range over the runs:

- minutes of training to reach a held-out success threshold (by default the synchronous
  runs' median final success minus 0.05, and at least 0.1 above their median success before
  training; ``--threshold`` sets one);
- the final held-out success, trained rollouts per minute, mean and maximum sample age (in
  updates) and the carry-over figures;
- the speed-up: the synchronous median minutes over the asynchronous one.

Prints the JSON on stdout and a table on stderr; ``--plot PNG`` draws held-out success
against minutes of training for every run of both modes. Run it with nothing else on the
machine: a second load slows the steps, and the asynchronous timing changes what is trained.

Usage: python -m bench.time_to_accuracy [--runs 3] [--config config/long-agent.yaml]
           [--plot docs/time-to-accuracy.png] [-- more carryover demo arguments]
       python -m bench.time_to_accuracy --metrics async=a.jsonl sync=b.jsonl ...
           (summarise finished runs)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from app.accuracy import compare, plot, table

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "config/long-agent.yaml"


def run_pair(config: str, log: Path, extra: list[str]) -> dict[str, Path]:
    """One ``carryover demo --compare``; returns each mode's metrics file."""
    cmd = [str(REPO / ".venv" / "bin" / "carryover"), "demo", "--compare", "--config", config,
           *extra]
    with open(log, "w") as out:
        code = subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    found = dict(re.findall(r"\n(async|sync): run \S+\n\s+metrics\s+(\S+)",
                            log.read_text(errors="replace")))
    if code != 0 or set(found) != {"async", "sync"}:
        raise SystemExit(f"carryover demo failed (exit {code}); its output is in {log}")
    return {mode: Path(p) for mode, p in found.items()}


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--log-dir", type=Path, default=REPO / "var" / "time-to-accuracy")
    ap.add_argument("--metrics", nargs="*", default=None,
                    help="finished runs as MODE=metrics.jsonl (MODE: async or sync)")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("demo_args", nargs="*", help="more arguments for carryover demo")
    args = ap.parse_args(argv)
    paths: dict[str, list[Path]] = {"async": [], "sync": []}
    if args.metrics:
        for item in args.metrics:
            mode, _, path = item.partition("=")
            if mode not in paths or not path:
                ap.error(f"--metrics {item!r}: write async=PATH or sync=PATH")
            paths[mode].append(Path(path))
    else:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(args.runs):
            pair = run_pair(args.config, args.log_dir / f"run-{i + 1}.log", args.demo_args)
            for mode, path in pair.items():
                paths[mode].append(path)
            print(f"run {i + 1}/{args.runs}: {pair}", file=sys.stderr, flush=True)
    runs = {mode: [read_rows(p) for p in ps] for mode, ps in paths.items() if ps}
    result = compare(runs, args.threshold)
    result["metrics"] = {mode: [str(p) for p in ps] for mode, ps in paths.items()}
    print(json.dumps(result, indent=1))
    print(table(result), file=sys.stderr)
    if args.plot is not None:
        plot(result, args.plot, "held-out success against minutes of training")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
