"""Write the task's prompts: every single-digit sum a + b, split from a seed into a training
and a held-out evaluation set (by unordered pair). Same seed, same bytes.

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
    """Held out by unordered pair: a + b and b + a fall on the same side, so no held-out sum
    has its commuted twin among the training prompts. About ``n_val`` held out."""
    pairs = sorted({(min(a, b), max(a, b)) for a in range(10) for b in range(10)})
    random.Random(seed).shuffle(pairs)
    held: set[tuple[int, int]] = set()
    count = 0
    for a, b in pairs:
        size = 1 if a == b else 2
        if count + size > n_val:
            continue
        held.add((a, b))
        count += size
    rows = samples()
    random.Random(seed).shuffle(rows)
    val = [r for r in rows if (min(r["a"], r["b"]), max(r["a"], r["b"])) in held]
    train = [r for r in rows if (min(r["a"], r["b"]), max(r["a"], r["b"])) not in held]
    return train, val


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
