"""The part of the configuration the gateway uses, read once per process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.config.loader import model_dir, repo_path
from app.config.schema import Config
from app.config.secrets import admin_token, inference_api_key
from app.config.serving import gateway_view
from app.config.settings import InferenceSettings, adapter_name, lora_rank
from app.state.connection import resolve_redis_url


@dataclass(frozen=True)
class GatewaySettings:
    redis_url: str
    upstreams: tuple[str, ...]
    model: str
    admin_token: str
    lease_ttl_s: float
    hold: bool
    hold_timeout_s: float
    retry_after_s: float
    max_body_bytes: int
    max_concurrent_per_rollout: int
    upstream_timeout_s: float
    upstream_health_s: float
    default_max_tokens: int
    default_temperature: float
    sampling: str = "enforce"
    context_check: bool = True    # gateway.context_check: count prompts (gateway/context.py)
    token_continuity: bool = True  # gateway.token_continuity (gateway/continuity.py)
    tokenizer_path: str = ""      # the served model's tokenizer and chat template
    chat_template: str | None = None  # inference.chat_template: the servers' template file
    max_model_len: int = 0
    sleep_check: bool = False     # the servers sleep around updates: skip one left asleep
    inference_api_key: str = ""   # sent to the servers; agents never see it
    tool_call_parser: str | None = None  # inference.tool_call_parser: where calls start
    tool_strict_level: str = "auto"  # inference.tool_strict_level: which calls it constrains
    lora: bool = False            # each policy version is served as its own LoRA adapter
    # the config keys this gateway serves by, for the driver to compare with a run's
    # (app/config/serving.py); empty for settings not built from a config
    serves: dict[str, Any] = field(default_factory=dict, compare=False)

    def served_model(self, version: int) -> str:
        """What a call admitted at policy ``version`` is sent to: with LoRA that version's
        adapter (the servers load it before the version is bumped), else the model."""
        return adapter_name(self.model, version) if self.lora and version > 0 else self.model

    @classmethod
    def from_config(cls, cfg: Config) -> GatewaySettings:
        g = cfg.gateway
        return cls(
            redis_url=resolve_redis_url(cfg),
            upstreams=tuple(cfg.inference.urls),
            model=cfg.inference.served_model_name,
            admin_token=admin_token(cfg),
            lease_ttl_s=float(g.lease_ttl_s),
            hold=bool(g.hold),
            hold_timeout_s=float(g.hold_timeout_s),
            retry_after_s=float(g.retry_after_s),
            max_body_bytes=int(g.max_body_bytes),
            max_concurrent_per_rollout=int(g.max_concurrent_per_rollout),
            upstream_timeout_s=float(g.upstream_timeout_s),
            upstream_health_s=float(g.upstream_health_s),
            default_max_tokens=int(cfg.actor_rollout_ref.rollout.max_tokens),
            default_temperature=float(cfg.actor_rollout_ref.rollout.temperature),
            sampling=str(g.sampling),
            context_check=g.context_check,
            token_continuity=g.token_continuity,
            tokenizer_path=str(model_dir(cfg)),
            max_model_len=int(cfg.inference.max_model_len),
            chat_template=str(repo_path(str(cfg.inference.chat_template)))
            if cfg.inference.chat_template else None,
            sleep_check=InferenceSettings.from_config(cfg).sleep_mode,
            inference_api_key=inference_api_key(cfg),
            tool_call_parser=cfg.inference.tool_call_parser or None,
            tool_strict_level=cfg.inference.tool_strict_level,
            lora=lora_rank(cfg) > 0,
            serves=gateway_view(cfg),
        )
