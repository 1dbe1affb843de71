"""A multi-turn agent written against the official ``openai`` client.

Turn 1: the model is asked to reverse the word. Then the agent calls a "tool" whose latency
is heavy-tailed (log-normal), as real tools are, and asks again with the tool's feedback.
The reward is the mean per-position score of the two answers, so both calls carry signal.

Nothing here knows about carryover: the client is pointed at the per-rollout gateway URL.
"""

from __future__ import annotations

import math
import random
import ssl
import threading
import time
from typing import Any

import httpx
import openai

from app.client import openai_max_retries

# Building a TLS context costs about 0.2 s of CPU, more than a whole rollout: one for all.
_TLS = ssl.create_default_context()
_local = threading.local()


def http_client() -> httpx.Client:
    """This thread's HTTP client. One pool shared by hundreds of agent threads is scanned in
    full on every request (httpcore), which was most of a rollout worker's CPU."""
    client = getattr(_local, "client", None)
    if client is None:
        client = _local.client = httpx.Client(timeout=120, verify=_TLS)
    return client


def score(answer: str, target: str) -> float:
    """Fraction of positions right; 0 without a clean stop; halved on a wrong length."""
    answer = answer.strip()
    if not answer:
        return 0.0
    right = sum(1 for a, b in zip(answer, target, strict=False) if a == b) / len(target)
    return right if len(answer) == len(target) else right / 2


def tool_latency(rng: random.Random, median_s: float, sigma: float) -> float:
    return median_s * math.exp(rng.gauss(0.0, sigma)) if median_s > 0 else 0.0


def ask(text: str, turn: int) -> str:
    """The user message of each turn. Every turn restates the word at the end of the
    message, so the word sits at the same distance from the answer in every turn (a tiny
    model learns position-based reversal; a word far back behind the first answer is much
    harder for it)."""
    return f"reverse {text}" if turn == 0 else f"again reverse {text}"


def run(sample: dict, llm: Any, *, tool_median_s: float = 0.3, tool_sigma: float = 1.0,
        max_tool_s: float = 30.0, seed: int | None = None, **_: Any) -> float:
    # Retries ride through the gateway's pauses for as long as the run allows (llm.max_wait_s,
    # from controller.retry_max_wait_s), honouring its Retry-After.
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key,
                           max_retries=openai_max_retries(getattr(llm, "max_wait_s", 900.0)),
                           timeout=120, http_client=http_client())
    rng = random.Random(seed)
    text, target = sample["text"], sample["target"]
    messages = [{"role": "user", "content": ask(text, 0)}]
    scores = []
    for turn in range(2):
        try:
            out = client.chat.completions.create(model=llm.model, messages=messages)
        except openai.BadRequestError as exc:
            if exc.code != "context_length_exceeded":
                raise
            # the conversation outgrew the model: end here, scored on the turns it had
            break
        choice = out.choices[0]
        answer = choice.message.content or ""
        clean_stop = choice.finish_reason == "stop"
        scores.append(score(answer, target) if clean_stop else 0.0)
        if turn == 0:
            time.sleep(min(tool_latency(rng, tool_median_s, tool_sigma), max_tool_s))
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": ask(text, 1)}]
    return sum(scores) / 2
