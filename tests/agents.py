"""Scripted agents for the tests. Each makes one real model call through the gateway (so the
trainer has a captured sample) and then behaves as its sample says.

Sample keys: ``gate`` (block until the test sets the Redis key ``test:gate:<gate>``),
``sleep`` (seconds), ``fail`` ("always" or "first": raise on every / the first attempt),
``reward`` (what to return; "nan" and "text" return bad values), ``sibling_sleep`` (a list
of per-sibling sleeps, by sibling index), ``fail_before_call`` (sibling indices that raise
before making any call), ``sibling_reward`` (a list of per-sibling rewards), ``max_tokens``
(of the call; default 2), ``overflow`` (then a call whose prompt exceeds the context,
left to raise), ``call_after_gate`` (a second call once the gate is open: the rollout needs
a server then).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import redis

_HTTP = httpx.Client(timeout=60)


def _sibling_index(rollout_id: str) -> int:
    return int(rollout_id.rsplit(".", 2)[1])


def scripted(sample: dict, llm: Any, *, redis_url: str, **_: Any) -> Any:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    index = _sibling_index(llm.rollout_id)
    group = llm.rollout_id.rsplit(".", 2)[0]
    if index in sample.get("fail_before_call", []):
        raise RuntimeError(f"scripted failure of sibling {index} before its first call")
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=20,
                           timeout=60, http_client=_HTTP)
    client.chat.completions.create(model=llm.model, max_tokens=int(sample.get("max_tokens", 2)),
                                   messages=[{"role": "user", "content": sample["text"]}])
    if sample.get("overflow"):  # a second call whose prompt outgrows the model: not caught
        client.chat.completions.create(model=llm.model, max_tokens=2, messages=[
            {"role": "user", "content": sample["text"] * 1000}])
    fail = sample.get("fail")
    if fail == "always":
        raise RuntimeError(f"scripted failure of {sample['text']}")
    if fail == "first" and r.incr(f"test:attempts:{group}:{index}") == 1:
        raise RuntimeError("scripted first-attempt failure")
    gate = sample.get("gate")
    if gate:
        deadline = time.monotonic() + 120
        while not r.exists(f"test:gate:{gate}") and time.monotonic() < deadline:
            time.sleep(0.05)
    if sample.get("call_after_gate"):
        client.chat.completions.create(model=llm.model, max_tokens=2, messages=[
            {"role": "user", "content": sample["text"]}])
    time.sleep(float(sample.get("sleep", 0)))
    per = sample.get("sibling_sleep")
    if per:
        time.sleep(float(per[index]))
    reward = sample.get("reward", 0.5 + 0.1 * index)
    if "sibling_reward" in sample:
        reward = sample["sibling_reward"][index]
    if reward == "nan":
        return float("nan")
    return reward


def arith_graded(sample: dict, llm: Any, **_: Any) -> float:
    """examples.arith's two-turn conversation (a wrong first answer gets a second turn) with
    partial credit, so that a group's rewards rarely all agree: a test that needs a gradient
    in every update does not wait on the few groups of a sparse reward. A near miss earns
    more than a far one, and an answer with no number (cut at max_tokens, mostly) a little
    for being short."""
    from examples.arith.agent import first_number, question

    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=20,
                           timeout=120, http_client=_HTTP)
    a, b = int(sample["a"]), int(sample["b"])
    messages = [{"role": "user", "content": question(a, b)}]
    best = 0.0
    for turn in range(2):
        answer = client.chat.completions.create(
            model=llm.model, messages=messages).choices[0].message.content or ""
        got = first_number(answer)
        if got == a + b:
            return 1.0 if turn == 0 else 0.5
        credit = 0.1 + 0.15 / (1 + abs(got - (a + b))) if got is not None \
            else 0.05 / (1 + len(answer.strip()))
        best = max(best, credit)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "That is not right. " + question(a, b)}]
    return best
