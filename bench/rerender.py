"""How often a multi-turn rollout's later calls share its first call's row: the chat
template renders the model's earlier answer (a tool call, a text) back into the next
prompt, and where those tokens differ from the ones sampled the trainer cannot pack the
turns into one row (each call then trains on its own context, in a row of its own).

Starts Redis, a vLLM CPU server of SmolLM2-135M-Instruct (config/arith.yaml: its
tool-aware chat template, vLLM's hermes parser) and the gateway, then runs ``--rollouts``
episodes of each kind through the real gateway and packs each rollout's captured calls as
the trainer does (``workers.trainer.batch.pack_turns``):

- ``arith``: examples/arith's two-turn chat (a wrong answer gets a second turn);
- one per SDK of examples/tools/agent.py: a tool call named in ``tool_choice`` (vLLM
  constrains the arguments to the schema, and the template renders the call back in the
  Hermes format), the tool's result, an answer.

Each kind runs through two gateways on the same server, alternating rollouts: one with
token continuity (``gateway.token_continuity``, the default: a later turn is sent as the
tokens sampled) and one without (every prompt rendered by the template).

Prints JSON: per kind and gateway, later-turn calls, calls packed into an earlier row, rows
per rollout, the mean reward.

Usage: python -m bench.rerender [--rollouts 8] [--kinds arith,openai-chat,anthropic,...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from bench.stack import REPO, bench_stack, free_port

BIN = os.path.dirname(sys.executable)


def pack_stats(client: Any, rollout_ids: list[str]) -> dict[str, Any]:
    from app.state import keys
    from app.state.records import CapturedCall
    from workers.trainer.batch import Sample, pack_turns

    calls = later = packed = rows = 0
    for rid in rollout_ids:
        captured = [CapturedCall.from_json(c) for c in client.lrange(keys.rollout_calls(rid),
                                                                       0, -1)]
        samples = [Sample(c.prompt_ids, c.response_ids, c.logprobs, 0.0, "g", c.temperature,
                          c.policy_version, rollout_id=rid) for c in captured]
        n_rows = len(pack_turns(samples))
        calls += len(samples)
        later += max(len(samples) - 1, 0)
        packed += len(samples) - n_rows
        rows += n_rows
    return {"rollouts": len(rollout_ids), "calls": calls, "later_turn_calls": later,
            "packed_calls": packed, "packed_share": packed / later if later else None,
            "rows_per_rollout": rows / max(len(rollout_ids), 1)}


def main(argv: list[str] | None = None) -> int:
    from examples.tools.agent import SDKS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--kinds", default=",".join(["arith", *SDKS]))
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    os.environ["CARRYOVER_CONFIG"] = str(REPO / "config" / "arith.yaml")
    with bench_stack(["redis", "inference", "gateway"]) as (overrides, tmp):
        from app.config import service_config
        from app.state.connection import connect, resolve_redis_url
        from bench.gateway import wait_http
        from examples.arith.agent import run as arith
        from examples.tools.agent import run as tools
        from workers.rollout.episode import _start_attempt

        cfg = service_config()
        client = connect(resolve_redis_url(cfg))
        port = free_port()
        plain_url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(
            [*overrides, f"gateway.port={port}", f"gateway.url={plain_url}",
             "gateway.token_continuity=false"])}
        with open(tmp / "gateway-plain.log", "ab") as log:
            plain = subprocess.Popen([os.path.join(BIN, "gunicorn"), "-c",
                                      "gateway/gunicorn.conf.py", "gateway:create_app()"],
                                     cwd=REPO, env=env, stdout=log, stderr=log,
                                     start_new_session=True)
        try:
            wait_http(f"{plain_url}/healthz", 120)
            gateways = {"continuity": str(cfg.gateway.url), "rendered": plain_url}
            out: dict[str, Any] = {"benchmark": "rerender",
                                   "model": cfg.inference.served_model_name, "kinds": {}}
            for kind in kinds:
                ids: dict[str, list[str]] = {g: [] for g in gateways}
                rewards: dict[str, list[float]] = {g: [] for g in gateways}
                errors = dict.fromkeys(gateways, 0)
                for i in range(args.rollouts):
                    for name, url in gateways.items():
                        rid, token = _start_attempt(client, "bench", f"{kind}-{name}-{i}", 0, 1)
                        llm = SimpleNamespace(base_url=f"{url}/rollout/{rid}/v1",
                                              api_key=token,
                                              model=cfg.inference.served_model_name,
                                              max_wait_s=60.0)
                        sample = {"a": 2 + i % 7, "b": 3 + i % 5}
                        try:
                            rewards[name].append(
                                arith(sample, llm, tool_median_s=0.0, tool_sigma=0.0)
                                if kind == "arith" else tools({**sample, "sdk": kind}, llm))
                        except Exception as exc:  # noqa: BLE001 - counted; its calls are kept
                            errors[name] += 1
                            print(f"{kind} {name} {i}: {exc.__class__.__name__}: {exc}",
                                  file=sys.stderr)
                        ids[name].append(rid)
                out["kinds"][kind] = {
                    name: {**pack_stats(client, ids[name]), "errors": errors[name],
                           "reward_mean": sum(rewards[name]) / len(rewards[name])
                           if rewards[name] else None} for name in gateways}
                print(kind, json.dumps(out["kinds"][kind]), file=sys.stderr, flush=True)
        finally:
            os.killpg(plain.pid, signal.SIGTERM)
            plain.wait(15)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
