"""An arithmetic agent written against the official ``openai`` client, for an instruct model.

Turn 1 asks "What is a + b? Answer with only the number.". A checking tool (latency
log-normal, as real tools are) looks at the first number in the answer. A wrong answer gets
a second turn in the same conversation, so the chat template renders the model's own first
answer back to it. Reward: 1 for a right first answer, ``retry_reward`` for a right second
one, 0 otherwise; an evaluation counts a rollout as a success when its reward is 1.

Nothing here knows about carryover: the client is pointed at the per-rollout gateway URL.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

import openai

from app.client import openai_max_retries
from examples.reverse.agent import http_client, tool_latency

NUMBER = re.compile(r"-?\d+")


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? Answer with only the number."


def first_number(text: str) -> int | None:
    match = NUMBER.search(text or "")
    return int(match.group()) if match else None


def check(answer: str, target: int, rng: random.Random, median_s: float, sigma: float,
          max_s: float) -> bool:
    """The checking tool: as slow as a real one (heavy-tailed), right or wrong."""
    time.sleep(min(tool_latency(rng, median_s, sigma), max_s))
    return first_number(answer) == target


def run(sample: dict, llm: Any, *, tool_median_s: float = 0.5, tool_sigma: float = 1.0,
        max_tool_s: float = 20.0, retry_reward: float = 0.5, seed: int | None = None,
        **_: Any) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key,
                           max_retries=openai_max_retries(getattr(llm, "max_wait_s", 900.0)),
                           timeout=300, http_client=http_client())
    rng = random.Random(seed)
    a, b = int(sample["a"]), int(sample["b"])
    messages: list[dict[str, str]] = [{"role": "user", "content": question(a, b)}]
    for turn in range(2):
        out = client.chat.completions.create(model=llm.model, messages=messages)
        answer = out.choices[0].message.content or ""
        if check(answer, a + b, rng, tool_median_s, tool_sigma, max_tool_s):
            return 1.0 if turn == 0 else float(retry_reward)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "That is not right. " + question(a, b)}]
    return 0.0
