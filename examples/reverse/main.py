"""The demo agent as a program: what a ``process`` or ``kubernetes`` controller starts.

It reads what every controller hands an agent (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
``OPENAI_MODEL``, ``CARRYOVER_SAMPLE``, ``CARRYOVER_AGENT_SETTINGS``), runs the same agent
as the ``python`` backend, POSTs the reward to ``CARRYOVER_REWARD_URL`` with its token and
also prints it as its last line. Usage (``controller.agent``): ``python -m examples.reverse.main``
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import httpx

from examples.reverse.agent import run


def main() -> int:
    sample = json.loads(os.environ.get("CARRYOVER_SAMPLE") or sys.stdin.readline())
    settings = json.loads(os.environ.get("CARRYOVER_AGENT_SETTINGS") or "{}")
    key = os.environ["OPENAI_API_KEY"]
    llm = SimpleNamespace(base_url=os.environ["OPENAI_BASE_URL"], api_key=key,
                          model=os.environ.get("OPENAI_MODEL", "policy"))
    reward = run(sample, llm, **settings)
    url = os.environ.get("CARRYOVER_REWARD_URL")
    if url:
        httpx.post(url, json={"reward": reward}, timeout=30,
                   headers={"Authorization": f"Bearer {key}"}).raise_for_status()
    print(json.dumps({"reward": reward}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
