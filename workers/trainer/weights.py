"""Shipping weights to the inference servers, and proving they arrived.

Saved as one ``model.safetensors`` per version directory (vLLM's ``reload_weights`` reads a
directory holding just that file); old versions are pruned. After each reload the prefix
cache is reset (a cached prompt would keep KV from the old weights) and a teacher-forced
probe compares the engine's log-probs with the trainer's: a reload that silently failed
(vLLM CPU skips a tied ``lm_head``, for one) must fail the step, not poison every later one.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import requests
import torch
from safetensors.torch import save_file

from app.config.settings import served_dtype
from workers.trainer.server_http import server_session
from workers.trainer.token_budget import proc_kb

log = logging.getLogger(__name__)

# Pause and resume move no weights (seconds at most); sleep and wake move the model's memory
# and are given the load's timeout (trainer.reload_timeout_s) by their callers.
ENGINE_CONTROL_TIMEOUT_S = 120.0

# A fixed sequence for the probe: prompt + response ids scored through prompt_logprobs.
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. Weights were loaded, and this "
              "sentence checks that the server now scores text as the trainer does.")
PROBE_IDS = [1, 17, 15, 7, 14, 21, 3, 4, 5, 2, 21, 1, 3, 15, 15, 9, 15, 16, 3, 12, 16, 21,
             5, 4, 3, 2]


# One session for every call to the servers: it carries their API key (``use_api_key``;
# only /v1 asks for it, but a proxy in front may guard every route).
_http = server_session()


def use_api_key(key: str) -> None:
    """Send ``key`` (``inference.api_key``: app.config.secrets) on every call to a server."""
    _http.headers["Authorization"] = f"Bearer {key}"


def api_key() -> str | None:
    """The key ``use_api_key`` set (the trainer's ranks send it on their own calls)."""
    auth = str(_http.headers.get("Authorization", ""))
    return auth.removeprefix("Bearer ") or None


class WeightSyncError(RuntimeError):
    pass


def publish_version(root: Path, version: int, keep: int, write: Callable[[Path], None],
                    published: Path | None = None) -> Path:
    """``root/vNNNNNN`` written by ``write(dir)`` into a temporary directory and renamed, so
    a server never reads a half-written version. Before the write, versions are pruned to
    the newest ``keep - 1`` and ``published`` (the one the servers are known to hold: the
    new one is not verified yet, and the upstream keeper loads ``published`` into a server
    that restarts), so at most ``keep + 1`` exist while it is written; once the new one is
    verified, :func:`prune_versions` leaves ``keep``."""
    out = root / f"v{version:06d}"
    tmp = root / f".v{version:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    held = published.resolve() if published is not None else None
    # a failed step's export of this same number (the retry's) counts as nothing kept
    others = [v for v in _versions(root) if v != out]
    newest = others[-(keep - 1):] if keep > 1 else []
    for old in [*others, out]:
        if old.is_dir() and old not in newest and old.resolve() != held:
            shutil.rmtree(old, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def prune_versions(root: Path, keep: int) -> None:
    """Leave the newest ``keep`` versions in ``root`` (called once the newest is verified)."""
    for old in _versions(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _versions(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v")) \
        if root.is_dir() else []


SHM = Path("/dev/shm")


def export_root(weights_dir: Path, in_memory: bool, urls: list[str], export_bytes: int,
                keep: int, shm: Path = SHM) -> Path:
    """Where the exports go: a folder in shared memory (``trainer.weights_in_memory``
    auto) when every server is on this host and ``shm`` has room for ``keep`` + 1 exports
    of ``export_bytes`` (the versions kept, and the one being written), else
    ``weights_dir``. A server on another host cannot read this host's memory."""
    from urllib.parse import urlsplit

    from app.config.validate import is_loopback

    local = all(is_loopback(urlsplit(u).hostname or "") for u in urls)
    if not (in_memory and local and shm.is_dir()):
        return weights_dir
    _prune_orphans(shm)
    # one folder per weights_dir: two deployments on one host never share versions
    owner = str(weights_dir.resolve())
    root = shm / f"carryover-weights-{hashlib.blake2b(owner.encode(), digest_size=6).hexdigest()}"
    held = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0
    need = (keep + 1) * export_bytes
    # tmpfs pages are host memory: the free space, and memory to spare beside what offloads
    # and sleeping engines also park there (a tenth of it kept free)
    avail, total = _meminfo()
    if shutil.disk_usage(shm).free + held < need or avail + held < need + total // 10:
        return weights_dir
    weights_dir.mkdir(parents=True, exist_ok=True)  # the owner's mark: it exists
    root.mkdir(exist_ok=True)
    (root / "owner").write_text(owner)
    return root


def _meminfo() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes; (0, 0) where /proc/meminfo does not say."""
    try:
        values = proc_kb(Path("/proc/meminfo"), ["MemAvailable", "MemTotal"])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return values.get("MemAvailable", 0), values.get("MemTotal", 0)


def _prune_orphans(shm: Path) -> None:
    """Memory is not disk: a folder whose deployment's weights_dir is gone (a test's, a
    deleted checkout's) is removed."""
    for folder in shm.glob("carryover-weights-*"):
        owner = folder / "owner"
        try:
            gone = owner.is_file() and not Path(owner.read_text()).exists()
        except OSError:
            continue
        if gone:
            shutil.rmtree(folder, ignore_errors=True)


def in_shared_memory(root: Path, shm: Path = SHM) -> bool:
    return root.parent == shm and root.name.startswith("carryover-weights-")


def save_weights(model: torch.nn.Module, root: Path, version: int, keep: int) -> Path:
    """The single-process reference path's export (the engine exports its own)."""
    def write(tmp: Path) -> None:
        # clone: a tied model shares one tensor between two names, which safetensors refuses
        state = {k: v.detach().to("cpu").contiguous().clone()
                 for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))

    return publish_version(root, version, keep, write)


def loaded_version(url: str, timeout: float = 5.0) -> str | None:
    """The weight version the server says it holds (vLLM's ``/weight_info``: "default"
    until a load names one, and again after a restart); None if it does not say."""
    try:
        resp = _http.get(url.rstrip("/") + "/weight_info", timeout=timeout)
        return str(resp.json()["weight_version"]) if resp.status_code == 200 else None
    except (requests.RequestException, ValueError, KeyError):
        return None


def behind(held: str | None, version: int) -> bool:
    """A server holding ``held`` lacks policy ``version`` (it restarted, or missed a
    load); one that does not report its version is not judged."""
    return held is not None and not (held.isdigit() and int(held) >= version)


def reload_weights(url: str, path: Path, timeout: float = 600.0,
                   frozen_calls: bool = False, version: int | None = None) -> None:
    """Load ``path`` into the server at ``url`` and reset its prefix cache; the load must
    answer within ``timeout`` (``trainer.reload_timeout_s``: a 7B load from disk takes
    minutes). With ``frozen_calls`` (the engine is paused with calls frozen in it) the reset
    also drops the KV cache those calls hold, so they recompute it under the new weights
    when they resume: every token sampled after the switch reads a prefix computed by the
    weights that sample it."""
    url = url.rstrip("/")
    try:
        resp = _http.post(url + "/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": str(path.resolve())}},
            timeout=timeout)
    except requests.Timeout as exc:
        raise WeightSyncError(f"{url}: reload_weights did not answer within {timeout:.0f} s "
                              "(trainer.reload_timeout_s); the engine may hold part of the "
                              "new weights") from exc
    if resp.status_code != 200:
        raise WeightSyncError(f"{url}: reload_weights answered {resp.status_code}: "
                              f"{resp.text[:300]}")
    after_load(url, timeout, frozen_calls, version)


def after_load(url: str, timeout: float, frozen_calls: bool = False,
               version: int | None = None) -> None:
    """What every load ends with, however the weights came: the prefix cache reset, then
    the version recorded in the server (only now does it fully serve it)."""
    reset_prefix_cache(url, timeout, frozen_calls)
    if version is not None:
        set_version(url, version, timeout)


def set_version(url: str, version: int, timeout: float) -> None:
    """The server keeps the version it holds (set once it fully serves it): the upstream
    keeper reads it back, and a server that restarted (behind a load balancer, unseen) says
    "default" again."""
    resp = _http.post(url.rstrip("/") + "/update_weight_version",
                      json={"new_version": str(version)}, timeout=timeout)
    if resp.status_code != 200:
        raise WeightSyncError(f"{url}: /update_weight_version answered "
                              f"{resp.status_code}: {resp.text[:200]}")


def load_adapter(url: str, name: str, path: Path, timeout: float, frozen_calls: bool = False,
                 version: int | None = None) -> None:
    """Serve the LoRA adapter at ``path`` under ``name`` (vLLM's ``/v1/load_lora_adapter``,
    the base weights untouched), then ``after_load``."""
    # a name loaded again (a retried step, the keeper after a failed load) is unloaded
    # first: vLLM refuses a name it serves, and its load_inplace re-reads the adapter's
    # files on every engine step after
    unload_adapter(url, name, timeout)
    resp = _http.post(url.rstrip("/") + "/v1/load_lora_adapter",
                      json={"lora_name": name, "lora_path": str(path.resolve())},
                      timeout=timeout)
    if resp.status_code != 200:
        raise WeightSyncError(f"{url}: /v1/load_lora_adapter {name} answered "
                              f"{resp.status_code}: {resp.text[:300]}")
    after_load(url, timeout, frozen_calls, version)


def unload_adapter(url: str, name: str, timeout: float = 60.0) -> bool:
    """Stop serving adapter ``name``; -> whether the server held it."""
    resp = _http.post(url.rstrip("/") + "/v1/unload_lora_adapter", json={"lora_name": name},
                      timeout=timeout)
    return resp.status_code == 200


def served_adapters(url: str, base: str, timeout: float = 10.0) -> list[str]:
    """The adapter names the server serves beside its ``base`` model (``/v1/models``)."""
    resp = _http.get(url.rstrip("/") + "/v1/models", timeout=timeout)
    resp.raise_for_status()
    return [m["id"] for m in resp.json()["data"] if m["id"] != base]


def reset_prefix_cache(url: str, timeout: float, frozen_calls: bool = False) -> None:
    """Drop the server's prefix cache after a load: a cached prompt would keep KV from the
    old weights. With ``frozen_calls`` the KV of the calls frozen in the engine goes too."""
    url = url.rstrip("/")
    # The reset fails while requests hold KV blocks; after a drain that is rare, so retry
    # briefly, then fail loudly: a stale prefix cache means off-policy log-probs.
    params = {"reset_running_requests": "true"} if frozen_calls else None
    for _ in range(50):
        body = _http.post(url + "/reset_prefix_cache", params=params, timeout=timeout).json()
        if body.get("success") is True:
            break
        time.sleep(0.1)
    else:
        raise WeightSyncError(f"{url}: /reset_prefix_cache kept answering success=false")


def engine_probe_logprobs(url: str, model_name: str, ids: list[int], timeout: float = 60.0,
                          dp_rank: int | None = None) -> list[float]:
    """``dp_rank``: the data-parallel replica to ask (vLLM's ``X-data-parallel-rank``
    header); None lets the server's balancer pick one."""
    headers = {"X-data-parallel-rank": str(dp_rank)} if dp_rank is not None else None
    resp = _http.post(url.rstrip("/") + "/v1/completions", json={
        "model": model_name, "prompt": ids, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0}, timeout=timeout, headers=headers)
    resp.raise_for_status()
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    out = []
    for pos, entry in enumerate(plp[1:], start=1):
        out.append(float(entry[str(ids[pos])]["logprob"]))
    return out


def trainer_probe_logprobs(model: torch.nn.Module, ids: list[int], dtype: torch.dtype
                           ) -> list[float]:
    """Log-probs of ``ids[1:]`` (temperature 1) from a copy of ``model`` in ``dtype``: the
    model itself is never cast (that would round its master weights)."""
    import copy

    device = next(model.parameters()).device
    with torch.no_grad():
        cast = copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model
        logits = cast(input_ids=torch.tensor([ids], device=device)).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    return logp.gather(1, torch.tensor(ids[1:], device=device).unsqueeze(-1)).squeeze(-1).tolist()


def probe_ids(model_path: str | Path) -> list[int]:
    """A fixed text in the model's own tokenizer; the demo's tiny vocabulary (it cannot spell
    the text) falls back to ``PROBE_IDS``."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_path))
        ids = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    except (OSError, ValueError):
        return PROBE_IDS
    unk = getattr(tok, "unk_token_id", None)
    if len(ids) < 16 or len(set(ids)) < 8 or (unk is not None and ids.count(unk) > len(ids) // 4):
        return PROBE_IDS
    return ids[:64]


def mean_gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def verify_sync(url: str, model_name: str, expected: list[float],
                previous: list[float] | None, tolerance: float,
                ids: list[int] | None = None, dp_size: int = 1) -> dict[str, float]:
    """Probe the server (every one of its ``dp_size`` data-parallel replicas: each holds
    its own copy of the weights, and the balancer would reach only one) against the
    trainer's ``expected`` log-probs; raises ``WeightSyncError`` naming the replica that
    fails. -> the gap metrics (the worst replica's)."""
    if dp_size <= 1:
        return _verify_one(url, model_name, expected, previous, tolerance, ids, None)
    worst: dict[str, float] = {}
    for rank in range(dp_size):
        m = _verify_one(url, model_name, expected, previous, tolerance, ids, rank)
        worst = {k: max(v, worst.get(k, v)) if k == "weight_sync/probe_gap"
                 else min(v, worst.get(k, v)) for k, v in m.items()}
    return worst


def _verify_one(url: str, model_name: str, expected: list[float],
                previous: list[float] | None, tolerance: float, ids: list[int] | None,
                dp_rank: int | None) -> dict[str, float]:
    got = engine_probe_logprobs(url, model_name, ids or PROBE_IDS, dp_rank=dp_rank)
    if dp_rank is not None:
        url = f"{url} (data-parallel replica {dp_rank})"
    gap = mean_gap(got, expected)
    if not math.isfinite(gap):
        raise WeightSyncError(f"{url}: the probe gap is {gap} (non-finite log-probs from the "
                              "engine or the trainer): the weights cannot be trusted")
    metrics = {"weight_sync/probe_gap": gap}
    if previous is not None:
        gap_prev = mean_gap(got, previous)
        metrics["weight_sync/probe_gap_to_previous"] = gap_prev
        change = mean_gap(expected, previous)
        # The engine must be clearly closer to the new weights than to the old ones
        # (only checkable when the update moved the probe more than the tolerance).
        if change > tolerance and not gap < 0.5 * gap_prev:
            raise WeightSyncError(
                f"{url}: engine log-probs are not closer to the new weights (gap {gap:.2e}) "
                f"than to the previous ones (gap {gap_prev:.2e}): the reload did not apply")
    if gap > tolerance:
        raise WeightSyncError(f"{url}: engine log-probs differ from the trainer's by {gap:.2e} "
                              f"(trainer.probe_tolerance {tolerance}): the reload did not apply")
    return metrics


# vLLM's CPU backend repacks each linear layer's weight for its GEMM kernel and leaves an
# empty tensor in the parameter: its digest is this one, and says nothing of the weights.
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def weight_checksums(url: str, timeout: float = 120.0) -> dict[str, str]:
    """vLLM's ``/weight_checker`` digests of every loaded tensor on every worker of the
    server, keyed ``dp<i>:pp<j>:pcp<k>:tp<l>:<name>``."""
    resp = _http.post(url.rstrip("/") + "/weight_checker", json={"action": "checksum"},
                      timeout=timeout)
    if resp.status_code != 200:
        raise WeightSyncError(f"{url}: /weight_checker answered {resp.status_code}: "
                              f"{resp.text[:200]}")
    return dict(resp.json()["checksums"])


def check_checksums(url: str, digests: dict[str, str], previous: dict[str, str] | None,
                    must_change: bool) -> dict[str, float]:
    """Every data-parallel replica of the server holds the same tensors (each holds its own
    copy, and the probe reaches one at a time), and, where the update moved the weights
    (``must_change``), they differ from ``previous`` (the last version's digests). Tensors
    whose digest is of nothing (vLLM CPU's repacked linear layers) are left to the probe.
    -> metrics: tensors checksummed, and those changed since ``previous``."""
    by_tensor: dict[str, set[str]] = {}
    for key, digest in digests.items():
        _, _, rest = key.partition(":")  # drop dp<i>: the replicas must agree
        by_tensor.setdefault(rest, set()).add(digest)
    split = sorted(name for name, seen in by_tensor.items() if len(seen) > 1)
    if split:
        raise WeightSyncError(f"{url}: the server's data-parallel replicas hold different "
                              f"weights for {len(split)} tensor(s), first {split[0]}: a load "
                              "reached only some of them")
    real = {k: v for k, v in digests.items() if v != EMPTY_DIGEST}
    changed = sum(1 for k, v in real.items() if previous is not None and previous.get(k) != v)
    if must_change and previous is not None and real and not changed:
        raise WeightSyncError(f"{url}: the update moved the weights, but every one of the "
                              f"{len(real)} checksummed tensors is as it was: the load did "
                              "not apply")
    return {"weight_sync/checksummed_tensors": float(len(real)),
            "weight_sync/changed_tensors": float(changed)}


def engine_dtype(name: str, model_path: str | Path | None = None) -> torch.dtype:
    """The dtype the inference server computes in (``served_dtype``), as torch names it."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}.get(served_dtype(name, model_path), torch.float32)


def _why(route: str, resp: requests.Response | None, state_route: str, state: object) -> str:
    """Why an engine did not change state: the route's refusal, or the state it reports."""
    if resp is not None and resp.status_code != 200:
        return f"{route} answered {resp.status_code}: {resp.text[:200]}"
    return f"{route} answered 200 but {state_route} says {state}" if resp is not None \
        else f"{state_route}: {state}"


class EnginePauseError(WeightSyncError):
    """An inference server did not pause its generation (or resume it) when asked."""


class EngineSleepError(WeightSyncError):
    """An inference server did not go to sleep (or wake up) when asked."""


@dataclass(frozen=True)
class EngineChange:
    """A state an engine is put in and taken out of, through vLLM's dev routes: the route
    that enters it, the route that leaves it, and the query both are checked against."""

    route: str           # /pause
    undo_route: str      # /resume
    state_route: str     # /is_paused -> {"is_paused": bool}
    what: str            # "pause its generation", for the error
    undo_what: str       # "resume"
    why_it_matters: str  # what refusing would break, and how to fix it
    error: type[WeightSyncError]
    skip_unreachable: bool  # an unreachable server is left out (it is reloaded when back)

    @property
    def state_key(self) -> str:
        return self.state_route.lstrip("/")


PAUSE = EngineChange(
    "/pause", "/resume", "/is_paused", "pause its generation", "resume",
    "not loading weights under running requests. The server needs VLLM_SERVER_DEV_MODE=1 "
    "(the project's inference command sets it)", EnginePauseError, skip_unreachable=True)
SLEEP = EngineChange(
    "/sleep", "/wake_up", "/is_sleeping", "go to sleep", "wake up",
    "the update would share the accelerator with it. Start the server with "
    "--enable-sleep-mode (inference.sleep_mode) or set trainer.pause_during_update: false",
    EngineSleepError, skip_unreachable=False)


def _state(url: str, change: EngineChange, timeout: float) -> object:
    resp = _http.get(url + change.state_route, timeout=timeout)
    return resp.json().get(change.state_key) if resp.status_code == 200 else None


class Held:
    """Engines kept in ``change``'s state until :meth:`release`; as a context manager, they
    are released (unchecked: a failure is already on its way) on any way out that did not
    release them first."""

    def __init__(self, change: EngineChange, urls: list[str],
                 timeout: float = ENGINE_CONTROL_TIMEOUT_S, frozen_calls: bool = False) -> None:
        self.change = change
        self.urls = urls
        self.timeout = timeout
        self.frozen_calls = frozen_calls   # requests wait frozen inside these engines

    def forget(self, url: str) -> None:
        """Leave ``url`` as it is on release: an engine whose weight load failed must not
        resume serving (it is marked stale; the upstream keeper restores it)."""
        self.urls = [u for u in self.urls if u != url.rstrip("/")]

    def wake(self, tags: list[str]) -> None:
        """Wake only ``tags`` of every sleeping engine (vLLM's ``/wake_up?tags=``: weights
        before the load, the KV cache after the trainer gave its memory back). The engines
        stay held: a failure later still wakes them fully on the way out. One whose
        process is gone (connection refused) is left out: it holds no memory, and the
        load that follows finds it unreachable and marks it stale."""
        c = self.change
        for url in list(self.urls):
            try:
                resp = _http.post(url + c.undo_route, params={"tags": tags},
                                  timeout=self.timeout)
            except requests.ConnectionError as exc:
                if not refused(exc):  # a timeout or a reset: it may be alive, and asleep
                    raise c.error(f"{url}: {c.undo_route}?tags={','.join(tags)} failed: "
                                  f"{exc}") from exc
                log.warning("%s: unreachable when its %s were to wake (%s); left out, it "
                            "gets the new weights when it is back", url, ",".join(tags),
                            exc.__class__.__name__)
                self.forget(url)
                continue
            except requests.RequestException as exc:
                raise c.error(f"{url}: {c.undo_route}?tags={','.join(tags)} failed: "
                              f"{exc}") from exc
            if resp.status_code != 200:
                raise c.error(f"{url}: {c.undo_route}?tags={','.join(tags)} answered "
                              f"{resp.status_code}: {resp.text[:200]}")

    def release(self, check: bool = True, tags: list[str] | None = None) -> None:
        """Take every engine out of the state (with ``tags``, the sleep's last tags: the
        engine must then be fully awake), each one tried whatever the others did; with
        ``check``, those that stay in it are one error naming each."""
        urls, self.urls = self.urls, []
        c = self.change
        params = {"tags": tags} if tags else None
        problems = []
        for url in urls:
            try:
                resp = _http.post(url + c.undo_route, params=params, timeout=self.timeout)
                state = _state(url, c, self.timeout)
            except (requests.RequestException, ValueError) as exc:
                problems.append(f"{url}: {c.undo_route} failed: {exc}")
                continue
            if resp.status_code != 200 or state is not False:
                problems.append(f"{url}: the engine did not {c.undo_what} ({c.undo_route} "
                                f"answered {resp.status_code}: {resp.text[:200]})")
        if problems and check:
            raise c.error("; ".join(problems))
        for line in problems:
            log.warning("could not %s an engine: %s", c.undo_what, line)

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release(check=False)


NOTHING_HELD = Held(PAUSE, [])


def change_engines(urls: list[str], change: EngineChange, params: dict[str, object],
                   timeout: float = ENGINE_CONTROL_TIMEOUT_S, frozen_calls: bool = False) -> Held:
    """Post ``change.route`` to every server and check that each reports the new state; on
    any failure the servers already changed are changed back and ``change.error`` names
    the server, why and the fix. -> the servers changed (unreachable ones are skipped
    where ``change.skip_unreachable``)."""
    done = Held(change, [], timeout, frozen_calls)
    for raw in urls:
        url = raw.rstrip("/")
        resp: requests.Response | None
        state: object
        try:
            resp = _http.post(url + change.route, params=params, timeout=timeout)
            state = _state(url, change, timeout) if resp.status_code == 200 else None
        except (requests.RequestException, ValueError) as exc:
            if isinstance(exc, requests.ConnectionError) and change.skip_unreachable:
                log.warning("%s: unreachable; not changed (it gets the new weights when it "
                            "is back)", url)
                continue
            resp, state = None, f"{exc.__class__.__name__}: {exc}"
        if resp is None or resp.status_code != 200 or state is not True:
            why = _why(change.route, resp, change.state_route, state)
            done.release(check=False)
            detail = "; ".join([*(f"{k}={v}" for k, v in params.items()), why])
            raise change.error(f"{url}: the engine did not {change.what} ({detail}); "
                               f"{change.why_it_matters}")
        done.urls.append(url)
    return done


# vLLM's /pause?mode=: keep freezes the requests in flight inside the engine, abort ends them
EnginePauseMode = Literal["keep", "abort"]


def pause_engines(urls: list[str], mode: EnginePauseMode,
                  timeout: float = ENGINE_CONTROL_TIMEOUT_S) -> Held:
    """Pause generation in every server (vLLM ``/pause``): ``keep`` freezes the requests in
    flight inside the engine, ``abort`` ends them. Weights are never loaded under running
    requests. A server that cannot be reached is skipped (the reload marks it stale; it
    serves nobody until it has the new weights)."""
    return change_engines(urls, PAUSE, {"mode": mode}, timeout, frozen_calls=mode == "keep")


def resume_engines(urls: list[str], timeout: float = ENGINE_CONTROL_TIMEOUT_S,
                   check: bool = True) -> None:
    Held(PAUSE, [u.rstrip("/") for u in urls], timeout).release(check)


def sleep_engines(urls: list[str], level: int, timeout: float = ENGINE_CONTROL_TIMEOUT_S
                  ) -> Held:
    """Put every server to sleep (vLLM sleep mode: level 1 offloads the weights and drops the
    KV cache, level 2 drops both) so the update gets the memory; one that stays awake fails
    the step before the update starts."""
    return change_engines(urls, SLEEP, {"level": level}, timeout)


def wake_engines(urls: list[str], timeout: float = ENGINE_CONTROL_TIMEOUT_S,
                 check: bool = True) -> None:
    Held(SLEEP, [u.rstrip("/") for u in urls], timeout).release(check)


def in_state(url: str, change: EngineChange, timeout: float = 10.0) -> bool:
    """The engine reports being in ``change``'s state (asleep, paused); a server without
    the route (no dev mode, no sleep mode) or no answer is not."""
    try:
        return _state(url.rstrip("/"), change, timeout) is True
    except (requests.RequestException, ValueError):
        return False


def refused(exc: BaseException) -> bool:
    """The connection was refused: nothing listens there (the server's process is gone),
    as opposed to a timeout or a reset, where a live server may be behind."""
    seen: list[BaseException] = []
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or any(e is x for x in seen) or len(seen) > 16:
            continue
        if isinstance(e, ConnectionRefusedError):
            return True
        seen.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None), *e.args[:1]]
    return False


def _undo_if(url: str, change: EngineChange, timeout: float) -> bool:
    """Take one engine out of ``change``'s state if it reports being in it (checked);
    -> whether it was."""
    if not in_state(url, change):
        return False
    Held(change, [url.rstrip("/")], timeout).release(check=True)
    return True


def wake_if_asleep(url: str, timeout: float = ENGINE_CONTROL_TIMEOUT_S) -> bool:
    """Wake an engine left asleep (its trainer died between sleep and wake)."""
    return _undo_if(url, SLEEP, timeout)


def resume_if_paused(url: str, timeout: float = ENGINE_CONTROL_TIMEOUT_S) -> bool:
    """Resume an engine left paused (a step whose load failed did not resume it)."""
    return _undo_if(url, PAUSE, timeout)

