"""The arithmetic example: its shipped data are what its generator writes, its reward reads
the first number."""

from __future__ import annotations

import random

from examples.arith import make_data
from examples.arith.agent import check, first_number
from tests.conftest import REPO


def test_the_shipped_data_are_what_the_generator_writes(tmp_path):
    make_data.main(["--out", str(tmp_path)])
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == \
            (REPO / "examples" / "arith" / "data" / name).read_bytes()
    train, val = make_data.split(0, 30)
    assert len(val) == 30 and len(train) == 70
    # held out by unordered pair: no held-out sum has its commuted twin in training
    pair = lambda r: (min(r["a"], r["b"]), max(r["a"], r["b"]))  # noqa: E731
    assert not {pair(r) for r in train} & {pair(r) for r in val}


def test_the_reward_reads_the_first_number():
    assert first_number("The answer is 15.") == 15
    # restating the question is the base model's usual mistake
    assert first_number("3 + 4 = 7") == 3
    assert first_number("no digits") is None
    rng = random.Random(0)
    assert check("7", 7, rng, 0.0, 1.0, 0.0) and not check("3 + 4 = 7", 7, rng, 0.0, 1.0, 0.0)
