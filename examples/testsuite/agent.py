"""A long-running agent: it answers, runs a slow test suite on its answer, and fixes it.

The shape of a coding agent that calls a test suite or a web API: each turn the model
answers through the official ``openai`` client; then a tool runs for a long, heavy-tailed
time (log-normal, median ``suite_median_s``, sigma ``suite_sigma``, cut at
``suite_max_s``) before it says pass or fail; a failure goes back to the model in the same
conversation for another turn, up to ``turns`` turns. The tool's time is real waiting that
uses no CPU (``time.sleep``, as a process waiting on a remote runner would), so on a small
machine it measures scheduling, not contention.

The task is the arithmetic one (``examples/arith``: "What is a + b? Answer with only the
number."), whose held-out success the base model starts low on and learns fast. Reward: 1
when the first answer passes, ``retry_reward`` when a later one does, 0 otherwise; an
evaluation counts a rollout as a success when its reward is 1.

Nothing here knows about carryover: the client is pointed at the per-rollout gateway URL.
"""

from __future__ import annotations

import random
import time
from typing import Any

import openai

from app.client import openai_max_retries
from examples.arith.agent import first_number, question
from examples.reverse.agent import http_client, tool_latency


def run_suite(answer: str, target: int, rng: random.Random, median_s: float, sigma: float,
              max_s: float) -> bool:
    """The test suite: as slow as a real one (heavy-tailed), whether it passes or not."""
    time.sleep(min(tool_latency(rng, median_s, sigma), max_s))
    return first_number(answer) == target


def run(sample: dict, llm: Any, *, suite_median_s: float = 10.0, suite_sigma: float = 1.0,
        suite_max_s: float = 60.0, turns: int = 2, retry_reward: float = 0.5,
        seed: int | None = None, **_: Any) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key,
                           max_retries=openai_max_retries(getattr(llm, "max_wait_s", 900.0)),
                           timeout=300, http_client=http_client())
    rng = random.Random(seed)
    a, b = int(sample["a"]), int(sample["b"])
    messages: list[dict[str, str]] = [{"role": "user", "content": question(a, b)}]
    for turn in range(int(turns)):
        out = client.chat.completions.create(model=llm.model, messages=messages)
        answer = out.choices[0].message.content or ""
        if run_suite(answer, a + b, rng, suite_median_s, suite_sigma, suite_max_s):
            return 1.0 if turn == 0 else float(retry_reward)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "The tests failed. " + question(a, b)}]
    return 0.0
