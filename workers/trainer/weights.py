"""Shipping weights to the inference servers, and proving they arrived.

Saved as one ``model.safetensors`` per version directory (vLLM's ``reload_weights`` reads a
directory holding just that file); old versions are pruned. After each reload the prefix
cache is reset (a cached prompt would keep KV from the old weights) and a teacher-forced
probe compares the engine's log-probs with the trainer's: a reload that silently failed
(vLLM CPU skips a tied ``lm_head``, for one) must fail the step, not poison every later one.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import requests
import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

# A fixed sequence for the probe: prompt + response ids scored through prompt_logprobs.
PROBE_IDS = [1, 17, 15, 7, 14, 21, 3, 4, 5, 2, 21, 1, 3, 15, 15, 9, 15, 16, 3, 12, 16, 21,
             5, 4, 3, 2]


class WeightSyncError(RuntimeError):
    pass


def save_weights(model: torch.nn.Module, root: Path, version: int, keep: int) -> Path:
    out = root / f"v{version:06d}"
    tmp = root / f".v{version:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    versions = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def reload_weights(url: str, path: Path, timeout: float = 120.0) -> None:
    url = url.rstrip("/")
    resp = requests.post(url + "/collective_rpc", json={
        "method": "reload_weights", "kwargs": {"weights_path": str(path.resolve())}},
        timeout=timeout)
    if resp.status_code != 200:
        raise WeightSyncError(f"{url}: reload_weights answered {resp.status_code}: "
                              f"{resp.text[:300]}")
    # The reset fails while requests hold KV blocks; after a drain that is rare, so retry
    # briefly, then fail loudly: a stale prefix cache means off-policy log-probs.
    for _ in range(50):
        body = requests.post(url + "/reset_prefix_cache", timeout=timeout).json()
        if body.get("success") is True:
            return
        time.sleep(0.1)
    raise WeightSyncError(f"{url}: /reset_prefix_cache kept answering success=false")


def engine_probe_logprobs(url: str, model_name: str, ids: list[int], timeout: float = 60.0
                          ) -> list[float]:
    resp = requests.post(url.rstrip("/") + "/v1/completions", json={
        "model": model_name, "prompt": ids, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0}, timeout=timeout)
    resp.raise_for_status()
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    out = []
    for pos, entry in enumerate(plp[1:], start=1):
        out.append(float(entry[str(ids[pos])]["logprob"]))
    return out


def trainer_probe_logprobs(model: torch.nn.Module, ids: list[int], dtype: torch.dtype
                           ) -> list[float]:
    """Log-probs of ``ids[1:]`` from ``model`` cast to the engine's dtype (temperature 1)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        cast = model.to(dtype)
        try:
            logits = cast(input_ids=torch.tensor([ids], device=device)).logits.float()
        finally:
            model.to(torch.float32)
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    return logp.gather(1, torch.tensor(ids[1:], device=device).unsqueeze(-1)).squeeze(-1).tolist()


def mean_gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def verify_sync(url: str, model_name: str, expected: list[float],
                previous: list[float] | None, tolerance: float) -> dict[str, float]:
    got = engine_probe_logprobs(url, model_name, PROBE_IDS)
    gap = mean_gap(got, expected)
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


def engine_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "auto": torch.float32}[name]


def sleep_engine(urls: list[str], device: str) -> str:
    if device == "cpu":
        return "skipped: vLLM's sleep mode frees nothing on CPU (and --enable-sleep-mode is " \
               "refused there)"
    for url in urls:
        requests.post(url.rstrip("/") + "/sleep", params={"level": 1}, timeout=120)
    return "slept"


def wake_engine(urls: list[str], device: str) -> None:
    if device == "cpu":
        return
    for url in urls:
        requests.post(url.rstrip("/") + "/wake_up", timeout=120)
