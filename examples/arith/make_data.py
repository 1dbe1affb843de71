"""Write the task's prompts: every single-digit sum a + b, split from a seed into a training
and a held-out evaluation set. Same seed, same bytes.

Usage: python -m examples.arith.make_data [--seed 0] [--val 30]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def samples() -> list[dict]:
    return [{"id": f"{a}+{b}", "a": a, "b": b, "answer": a + b}
            for a in range(10) for b in range(10)]


def split(seed: int, n_val: int) -> tuple[list[dict], list[dict]]:
    rows = samples()
    random.Random(seed).shuffle(rows)
    return rows[n_val:], rows[:n_val]


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val", type=int, default=30, help="held-out prompts")
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args(argv)
    train, val = split(args.seed, args.val)
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "train.jsonl", train)
    write(args.out / "val.jsonl", val)
    print(f"{len(train)} training and {len(val)} held-out prompts in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
