"""The long-running agent's test suite: it passes on the first number of the answer, takes a
heavy-tailed time cut at its limit, and waits without using the CPU."""

from __future__ import annotations

import math
import random
import time

from examples.testsuite.agent import run_suite


def test_the_suite_passes_on_the_first_number_only():
    rng = random.Random(0)
    assert run_suite("7", 7, rng, 0.0, 1.0, 0.0)
    assert run_suite("The answer is 7.", 7, rng, 0.0, 1.0, 0.0)
    assert not run_suite("3 + 4 = 7", 7, rng, 0.0, 1.0, 0.0)  # the base model's restatement
    assert not run_suite("", 7, rng, 0.0, 1.0, 0.0)


def test_the_suite_waits_its_latency_up_to_its_limit_without_cpu():
    rng = random.Random(1)  # its first draw, median 0.2 s and sigma 3, is far above 0.3 s
    assert 0.2 * math.exp(random.Random(1).gauss(0.0, 3.0)) > 0.3
    wall, cpu = time.monotonic(), time.process_time()
    run_suite("7", 7, rng, 0.2, 3.0, 0.3)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert 0.3 <= wall < 2.0  # cut at the limit
    assert cpu < 0.05  # waiting, not computing
