"""Load with pauses: a few hundred concurrent agents call the gateway for a bounded time
while the model is paused and drained every second or so. Every call an agent got an answer
for is captured exactly once; no call answered 503 is captured; every drain completes."""

from __future__ import annotations

import json
import threading
import time

import requests

from app.state import keys
from app.state.pause import Pause
from tests.conftest import standin_gateway

AGENTS = 200
PAUSES = 8


def test_load_with_pauses_loses_and_duplicates_nothing(redis_client, tmp_root, new_rollout):
    with standin_gateway(tmp_root, "load-test", "gateway.workers=2",
                         "gateway.max_concurrent_per_rollout=4") as (url, _, _):
        rollouts = [new_rollout(url) for _ in range(AGENTS)]
        answered = [0] * AGENTS
        refused = [0] * AGENTS
        errors: list[str] = []
        stop = threading.Event()

        def agent(i: int) -> None:
            rid, token, base = rollouts[i]
            s = requests.Session()
            s.headers["Authorization"] = f"Bearer {token}"
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    r = s.post(base + "/chat/completions", timeout=30, json={
                        "messages": [{"role": "user", "content": f"{i}-{n}"}],
                        "max_tokens": 2})
                except requests.RequestException as exc:
                    errors.append(f"{rid}: {exc}")
                    return
                if r.status_code == 200:
                    answered[i] += 1
                elif r.status_code == 503:
                    refused[i] += 1
                    time.sleep(min(float(r.headers.get("Retry-After", 0.2)), 0.5))
                else:
                    errors.append(f"{rid}: {r.status_code} {r.text[:200]}")
                    return

        adm = Pause(redis_client, lease_ttl_s=30)
        drains = []
        threads = [threading.Thread(target=agent, args=(i,), daemon=True)
                   for i in range(AGENTS)]
        for t in threads:
            t.start()
        try:
            for _ in range(PAUSES):  # bounded: about 1.5 s of load per pause
                time.sleep(1.0)
                inflight = adm.pause(pause_ttl_s=30)
                drains.append((inflight, adm.drain(10.0)))
                time.sleep(0.2)
                adm.resume()
        finally:
            adm.resume()
            stop.set()
            for t in threads:
                t.join(30)
    assert not errors, errors[:5]
    assert len(drains) == PAUSES
    assert all(d.cancelled == 0 for _, d in drains), drains  # every drain completed
    assert sum(inflight for inflight, _ in drains) > 0  # pauses did catch calls in flight
    assert sum(refused) > 0  # and agents were told to retry meanwhile
    total = 0
    for i, (rid, _, _) in enumerate(rollouts):
        calls = [json.loads(c) for c in redis_client.lrange(keys.rollout_calls(rid), 0, -1)]
        assert len(calls) == answered[i], (rid, len(calls), answered[i])
        total += len(calls)
    assert total > AGENTS  # each agent made several calls
