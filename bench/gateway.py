"""Gateway overhead: requests/s and added latency against calling the upstream directly.

Starts its own Redis, a near-free OpenAI-compatible stand-in upstream (``bench/fast_standin.py``:
one asyncio process returning token ids and log-probs, so the gateway's admission and capture
paths run; its CPU per call is reported beside the proxies'), the gateway under gunicorn and,
as the reference point, a bare Flask proxy under gunicorn (``bench/bare_proxy.py``: forwards
and nothing else). Then measures direct, through the bare proxy and through the gateway at 1
and 8 connections, interleaved in one run: the bare proxy's figures say what Flask + gunicorn
+ one upstream call cost on this machine at this moment, so the gateway's can be read against
them.

``--baseline DIR`` also serves the gateway of another checkout (``git worktree add DIR REV``)
on the same Redis and upstream, measured in the same rounds: a change's cost, side by side.

Usage: python -m bench.gateway [--requests 2000] [--rounds 3] [--baseline DIR]
(prints JSON, then a table)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            requests.get(url, timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.2)
    raise TimeoutError(url)


class RawClient:
    """A keep-alive HTTP/1.1 client on a bare socket: one pre-encoded request, responses
    read by Content-Length. It costs a few tens of microseconds of CPU per call, so on two
    cores the load generator does not eat the CPU the gateway is being measured on (the
    ``requests`` library costs about as much per call as the gateway itself)."""

    def __init__(self, url: str, headers: dict, body: dict) -> None:
        import socket
        from urllib.parse import urlsplit

        u = urlsplit(url)
        payload = json.dumps(body).encode()
        head = [f"POST {u.path} HTTP/1.1", f"Host: {u.netloc}",
                "Content-Type: application/json", f"Content-Length: {len(payload)}",
                *(f"{k}: {v}" for k, v in headers.items())]
        self.request = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
        self.sock = socket.create_connection((u.hostname, u.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def call(self) -> tuple[int, bytes]:
        self.sock.sendall(self.request)
        while b"\r\n\r\n" not in self.buf:
            self._recv()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:])
                      if k.strip().lower() == b"content-length")
        while len(self.buf) < length:
            self._recv()
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, body

    def _recv(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buf += chunk

    def close(self) -> None:
        self.sock.close()


def _tree(pid: int) -> list:
    import psutil

    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def _cpu_seconds(procs: list) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def run_load(url: str, headers: dict, connections: int, total: int) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
    per = total // connections
    latencies: list[float] = []
    lock = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        client = RawClient(url, headers, body)
        mine = []
        try:
            for _ in range(per):
                t = time.perf_counter()
                status, data = client.call()
                mine.append(time.perf_counter() - t)
                if status != 200:
                    errors.append(f"{url}: {status} {data[:200]!r}")
                    return
        finally:
            client.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(errors[0])
    latencies.sort()
    return {"requests": len(latencies), "rps": len(latencies) / wall,
            "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[int(len(latencies) * 0.99) - 1]}


def main(argv: list[str] | None = None) -> int:
    from bench.stack import bench_dir

    with bench_dir() as tmp:
        return run(argv, tmp)


def run(argv: list[str] | None, tmp: Path) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gateway-workers", type=int, default=2)
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout whose gateway is measured beside this one")
    args = ap.parse_args(argv)

    redis_port, standin_port, gw_port, bare_port, base_port = (free_port() for _ in range(5))
    overrides = [f"redis.port={redis_port}", f"redis.dir={tmp}", f"gateway.port={gw_port}",
                 f"gateway.url=http://127.0.0.1:{gw_port}",
                 f"gateway.workers={args.gateway_workers}",
                 f"inference.urls=[http://127.0.0.1:{standin_port}]"]
    env = {**os.environ, "CARRYOVER_OVERRIDES": json.dumps(overrides),
           "CARRYOVER_ADMIN_TOKEN": "bench"}
    env.pop("REDIS_URL", None)
    log = open(tmp / "bench.log", "ab")  # noqa: SIM115
    procs = [
        subprocess.Popen([str(BIN / "redis-server"), "--port", str(redis_port), "--bind",
                          "127.0.0.1", "--dir", str(tmp), "--appendonly", "yes", "--save", ""],
                         stdout=log, stderr=log, start_new_session=True),
        # the upstream: an asyncio server whose cost per call is small beside the proxies'
        subprocess.Popen([sys.executable, "-m", "bench.fast_standin", str(standin_port)],
                         cwd=REPO, stdout=log, stderr=log, start_new_session=True),
        subprocess.Popen([str(BIN / "gunicorn"), "-c", "gateway/gunicorn.conf.py",
                          "gateway:create_app()"], cwd=REPO, env=env, stdout=log, stderr=log,
                         start_new_session=True),
        subprocess.Popen([str(BIN / "gunicorn"), "-k", "gevent", "-w",
                          str(args.gateway_workers), "-b", f"127.0.0.1:{bare_port}",
                          "--log-level", "warning",
                          f"bench.bare_proxy:create_app('http://127.0.0.1:{standin_port}')"],
                         cwd=REPO, stdout=log, stderr=log, start_new_session=True),
    ]
    if args.baseline is not None:
        base_env = {**env, "PYTHONPATH": str(args.baseline.resolve()),
                    "CARRYOVER_OVERRIDES": json.dumps(
                        [*overrides, f"gateway.port={base_port}",
                         f"gateway.url=http://127.0.0.1:{base_port}"])}
        procs.append(subprocess.Popen(
            [str(BIN / "gunicorn"), "-c", "gateway/gunicorn.conf.py", "gateway:create_app()"],
            cwd=args.baseline, env=base_env, stdout=log, stderr=log, start_new_session=True))
    try:
        wait_http(f"http://127.0.0.1:{standin_port}/health")
        wait_http(f"http://127.0.0.1:{gw_port}/healthz")
        wait_http(f"http://127.0.0.1:{bare_port}/health")
        os.environ["CARRYOVER_OVERRIDES"] = env["CARRYOVER_OVERRIDES"]
        from app.config import service_config
        from app.state.connection import connect, resolve_redis_url
        from workers.rollout.episode import _start_attempt

        client = connect(resolve_redis_url(service_config()))
        rid, token = _start_attempt(client, "bench", "bench-g", 0, 1)
        direct = f"http://127.0.0.1:{standin_port}/v1/chat/completions"
        via = f"http://127.0.0.1:{gw_port}/rollout/{rid}/v1/chat/completions"
        bare = f"http://127.0.0.1:{bare_port}/rollout/{rid}/v1/chat/completions"
        auth = {"Authorization": f"Bearer {token}"}
        paths = [("direct", direct, {}, None), ("bare_proxy", bare, {}, _tree(procs[3].pid)),
                 ("gateway", via, auth, _tree(procs[2].pid))]
        if args.baseline is not None:
            wait_http(f"http://127.0.0.1:{base_port}/healthz")
            paths.append(("gateway_baseline",
                          f"http://127.0.0.1:{base_port}/rollout/{rid}/v1/chat/completions",
                          auth, _tree(procs[4].pid)))
        standin = _tree(procs[1].pid)
        for _name, url, hdr, _procs in paths:
            run_load(url, hdr, 8, 400)  # warm-up: connections, imports, scripts
        results: dict[str, list[dict]] = {}
        cpu: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for conns in (1, 8):
                n = args.requests // (4 if conns == 1 else 1)
                for name, url, hdr, tree in paths:
                    before = _cpu_seconds(tree) if tree else 0.0
                    up_before = _cpu_seconds(standin)
                    row = run_load(url, hdr, conns, n)
                    results.setdefault(f"{name}@{conns}", []).append(row)
                    if tree:
                        cpu.setdefault(f"{name}@{conns}", []).append(
                            1000 * (_cpu_seconds(tree) - before) / row["requests"])
                    cpu.setdefault(f"standin_via_{name}@{conns}", []).append(
                        1000 * (_cpu_seconds(standin) - up_before) / row["requests"])
        captured = client.llen(f"co:rollout:{rid}:calls")
    finally:
        for p in reversed(procs):
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(15)
        log.close()

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in results[key])

    summary = {
        "benchmark": "gateway",
        "machine": f"{os.cpu_count()} CPUs",
        "gateway_workers": args.gateway_workers,
        "rounds": args.rounds,
        "captured_calls": captured,
        "results": {k: {f: med(k, f) for f in ("rps", "p50_ms", "p99_ms")} for k in results},
    }
    for conns in (1, 8):
        names = [("gateway", ""), ("bare_proxy", "bare_proxy_")]
        if args.baseline is not None:
            names.append(("gateway_baseline", "gateway_baseline_"))
        for name, prefix in names:
            for q in ("p50", "p99"):
                summary[f"{prefix}added_{q}_ms@{conns}"] = med(
                    f"{name}@{conns}", f"{q}_ms") - med(f"direct@{conns}", f"{q}_ms")
    summary["gateway_rps@8"] = med("gateway@8", "rps")
    summary["bare_proxy_rps@8"] = med("bare_proxy@8", "rps")
    summary["gateway_rps_vs_bare_proxy@8"] = summary["gateway_rps@8"] / summary[
        "bare_proxy_rps@8"]
    if args.baseline is not None:
        summary["gateway_baseline_rps@8"] = med("gateway_baseline@8", "rps")
        summary["gateway_rps_vs_baseline@8"] = summary["gateway_rps@8"] / summary[
            "gateway_baseline_rps@8"]
    # CPU the proxies' processes spend per call: what bounds requests/s on 2 cores
    for key, values in cpu.items():
        name, conns = key.split("@")
        summary[f"{name}_cpu_ms_per_request@{conns}"] = statistics.median(values)
    print(json.dumps(summary, indent=1))
    print("\n| path | conns | req/s | p50 ms | p99 ms |\n|---|---|---|---|---|")
    for key, r in summary["results"].items():
        name, conns = key.split("@")
        print(f"| {name} | {conns} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
