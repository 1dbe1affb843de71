"""What a gateway takes from its own config and a run must share with it.

Every gateway process reads its settings once, from the config its stack was started with
(``carryover up``), while the trainer follows the run's config (``carryover train``). Where
the two differ on one of these keys the run trains on what it did not ask for, silently: a
rollout temperature the gateway enforces but the trainer does not model, a LoRA adapter the
gateway never sends calls to, another tokenizer or chat template for the token continuity.
The stack's inference servers were started from the same config, so the view also holds
what the trainer needs of them: how weights reach them (the transfer routes and their
engine), their dtype, the largest LoRA rank they take and whether they sleep; otherwise
every weight load of the run fails. The gateway reports its view in ``/admin/state``, and
the driver refuses a run whose config says otherwise, naming each key.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from app.config.loader import repo_path
from app.config.settings import MAX_LORA_RANKS, lora_rank, sleep_mode, transfer_engine
from app.services.device import resolve as resolve_device

# compared as they are, and paths as the gateway resolves them
_PLAIN = ("inference.served_model_name", "inference.urls", "inference.max_model_len",
          "inference.tool_call_parser", "actor_rollout_ref.rollout.temperature",
          "actor_rollout_ref.rollout.max_tokens", "gateway.sampling",
          "gateway.token_continuity", "gateway.context_check", "inference.weight_sync",
          "inference.dtype")
_PATHS = ("actor_rollout_ref.model.path", "inference.chat_template")
LORA = "actor_rollout_ref.model.lora_rank"
# only what a call gets when its agent sets none: a difference is reported, not refused
NOTED = ("actor_rollout_ref.rollout.max_tokens",)


def gateway_view(cfg: Any) -> dict[str, Any]:
    """The values of the keys a gateway serves by, as JSON values."""
    view: dict[str, Any] = {}
    for key in _PLAIN:
        value = OmegaConf.select(cfg, key)
        view[key] = OmegaConf.to_container(value, resolve=True) \
            if OmegaConf.is_config(value) else value
    for key in _PATHS:
        value = OmegaConf.select(cfg, key)
        view[key] = str(repo_path(str(value))) if value else None
    # the gateway asks whether; the servers take ranks up to their --max-lora-rank
    rank = lora_rank(cfg)
    view[LORA] = f"up to {next(r for r in MAX_LORA_RANKS if r >= rank)}" if rank else "unset"
    # as the servers' command resolves them
    device = resolve_device(str(cfg.inference.device))
    view["inference.transfer_engine"] = transfer_engine(cfg, device) \
        if cfg.inference.weight_sync == "transfer" else None
    view["inference.sleep_mode"] = sleep_mode(cfg, device)
    return view


def disagreements(run: dict[str, Any], gateway: dict[str, Any]
                  ) -> tuple[list[str], list[str]]:
    """One line per key the run's view and the running gateway's differ on: (those that
    refuse the run, those only reported: ``NOTED``). Keys one side does not know are left
    out (a gateway of another release)."""
    refused: list[str] = []
    noted: list[str] = []
    for key in run:
        if key in gateway and _norm(run[key]) != _norm(gateway[key]):
            (noted if key in NOTED else refused).append(
                f"{key}: the running gateway serves with {gateway[key]!r}, this run's "
                f"config says {run[key]!r}")
    return refused, noted


def _norm(value: Any) -> Any:
    # 1 and 1.0 are the same temperature; a URL with or without its trailing slash; the
    # servers in any order (the gateway ranks them per rollout)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, list):
        return sorted((_norm(v) for v in value), key=repr)
    return value.rstrip("/") if isinstance(value, str) else value
