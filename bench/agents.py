"""Benchmark agents: one real model call through the gateway, then a sleep whose length
comes from a configured distribution (the agent's "tool" and "thinking" time).

Durations are a pure function of (seed, group sequence number, sibling index), so the n-th
group gets the same durations in every mode of a benchmark: sync and async runs see the
same workload.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import httpx
import openai

_HTTP = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=512))


def duration(dist: str, median_s: float, sigma: float, seed: int, seq: int, index: int
             ) -> float:
    if dist == "fixed":
        return median_s
    rng = random.Random(f"{seed}:{seq}:{index}")
    return median_s * math.exp(rng.gauss(0.0, sigma))


def timed(sample: dict, llm: Any, *, dist: str = "lognormal", median_s: float = 0.5,
          sigma: float = 1.0, seed: int = 0, max_s: float = 60.0, **_: Any) -> float:
    group, index, _attempt = llm.rollout_id.rsplit(".", 2)
    seq = int(group.rsplit("-g", 1)[1])
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=20,
                           timeout=120, http_client=_HTTP)
    out = client.chat.completions.create(
        model=llm.model, max_tokens=2,
        messages=[{"role": "user", "content": f"reverse {sample.get('text', 'abc')}"}])
    time.sleep(min(duration(dist, median_s, sigma, seed, seq, int(index)), max_s))
    return float(len(out.choices[0].message.content or "") % 2)


def instant(sample: dict, llm: Any, **_: Any) -> float:
    """No model call, no wait: what is left is the orchestration."""
    return 1.0


def sleeping(sample: dict, llm: Any, *, median_s: float = 1.0, sigma: float = 0.5,
             seed: int = 0, max_s: float = 30.0, **_: Any) -> float:
    """No model call; sleeps a log-normal duration (a cheap stand-in for a waiting agent:
    the scale benchmark keeps thousands of them in flight)."""
    group, index, _attempt = llm.rollout_id.rsplit(".", 2)
    seq = int(group.rsplit("-g", 1)[1])
    time.sleep(min(duration("lognormal", median_s, sigma, seed, seq, int(index)), max_s))
    return 1.0


def long_calls(sample: dict, llm: Any, *, calls: int = 2, max_tokens: int = 256,
               **_: Any) -> float:
    """``calls`` model calls of exactly ``max_tokens`` tokens each (``ignore_eos``): long
    generations, the case where a weight update either waits for them or freezes them."""
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=50,
                           timeout=300, http_client=_HTTP)
    text = ""
    for _ in range(calls):
        out = client.chat.completions.create(
            model=llm.model, max_tokens=max_tokens, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"reverse {sample.get('text', 'abc')}"}])
        text = out.choices[0].message.content or ""
    return float(len(text) % 2)
