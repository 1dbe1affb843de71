"""What a gateway takes from its own config and a run must share with it.

Every gateway process reads its settings once, from the config its stack was started with
(``carryover up``), while the trainer follows the run's config (``carryover train``). Where
the two differ on one of these keys the run trains on what it did not ask for, silently: a
rollout temperature the gateway enforces but the trainer does not model, a LoRA adapter the
gateway never sends calls to, another tokenizer or chat template for the token continuity.
The stack's inference servers were started from the same config, so the view also holds
what a run's weight loads need of them: the transfer routes and their engine, the dtype, the
largest LoRA rank they take. A run may ask less of them than they offer, not more. The
gateway reports its view in ``/admin/state``, and the driver refuses a run whose config
says otherwise, naming each key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from app.config.loader import repo_path
from app.config.raw import YamlMap
from app.config.schema import Config
from app.config.settings import MAX_LORA_RANKS, lora_rank, served_dtype

# compared as they are, and paths as the gateway resolves them
_PLAIN = ("inference.served_model_name", "inference.urls", "inference.max_model_len",
          "inference.tool_call_parser", "actor_rollout_ref.rollout.temperature",
          "actor_rollout_ref.rollout.max_tokens", "gateway.sampling",
          "gateway.token_continuity", "gateway.context_check")
_PATHS = ("actor_rollout_ref.model.path", "inference.chat_template")
LORA = "actor_rollout_ref.model.lora_rank"
# only what a call gets when its agent sets none: a difference is reported, not refused
NOTED = ("actor_rollout_ref.rollout.max_tokens",)
# what the servers were started with, (run's, stack's) -> whether the run's loads work there
# (Any: each rule compares its key's JSON values as that key's type, ranks as numbers;
# the gateway's side comes from another process)
_SERVERS: dict[str, Callable[[Any, Any], bool]] = {
    "inference.weight_sync": lambda run, stack: run != "transfer" or stack == "transfer",
    "inference.transfer_engine": lambda run, stack: run is None or run == stack,
    # (with no LoRA on the servers, the lora_rank key says so)
    "inference.max_lora_rank": lambda run, stack: run <= stack or not stack,
    "inference.dtype": lambda run, stack: run == stack,
}


def gateway_view(cfg: Config) -> YamlMap:
    """The values of the keys a gateway serves by, as JSON values."""
    view: YamlMap = {key: cfg.select(key) for key in _PLAIN}
    for key in _PATHS:
        value = cfg.select(key)
        view[key] = str(repo_path(str(value))) if value else None
    rank = lora_rank(cfg)
    view[LORA] = "set" if rank > 0 else "unset"  # the gateway only asks whether
    inf = cfg.inference
    transfer = inf.weight_sync == "transfer"
    view["inference.weight_sync"] = str(inf.weight_sync)
    # as written, not resolved: "auto" picks per host, and the two views may be made on two
    view["inference.transfer_engine"] = str(inf.transfer_engine) if transfer else None
    # the servers' --max-lora-rank (vLLM's next value at or above the rank)
    view["inference.max_lora_rank"] = next(r for r in MAX_LORA_RANKS if r >= rank) \
        if rank else 0
    view["inference.dtype"] = served_dtype(str(inf.dtype),
                                           repo_path(str(cfg.actor_rollout_ref.model.path)))
    return view


def disagreements(run: Mapping[str, object], gateway: Mapping[str, object]
                  ) -> tuple[list[str], list[str]]:
    """One line per key the run's view and the running gateway's differ on: (those that
    refuse the run, those only reported: ``NOTED``). Keys one side does not know are left
    out (a gateway of another release)."""
    refused: list[str] = []
    noted: list[str] = []
    for key in run:
        if key not in gateway:
            continue
        rule = _SERVERS.get(key)
        if rule(run[key], gateway[key]) if rule else _norm(run[key]) == _norm(gateway[key]):
            continue
        (noted if key in NOTED else refused).append(
            f"{key}: the running gateway serves with {gateway[key]!r}, this run's config "
            f"says {run[key]!r}")
    return refused, noted


def _norm(value: object) -> object:
    # 1 and 1.0 are the same temperature; a URL with or without its trailing slash; the
    # servers in any order (the gateway ranks them per rollout)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, list):
        return sorted((_norm(v) for v in value), key=repr)
    return value.rstrip("/") if isinstance(value, str) else value
