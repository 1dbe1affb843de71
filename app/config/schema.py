"""The configuration as types: one frozen dataclass per section of ``config/default.yaml``.

``app.config.loader.load_config`` merges the defaults, a file and overrides, validates the
result (``app.config.validate``, every rule and every cross-key rule) and returns it as a
:class:`Config`; a run stores ``Config.to_dict()`` in Redis and its workers read it back the
same way. Past that point the code reads typed attributes: a misspelt key or a mode compared
with a value it cannot take is a mypy error, not a ``KeyError`` or a silent ``False`` at run
time, and no default is repeated in code (every key has its value here).

The names are the YAML's (``cfg.trainer.total_steps``), so the docs read as the code. A key
added to ``default.yaml`` needs its field here (and its rule in ``app.config.validate``):
``Config.of`` refuses a section with a key the dataclass lacks or the other way round, and
``tests/unit/test_config_schema.py`` builds every shipped config and compares the ``Literal``
choices here with the validation rules. verl's registry names (policy losses, estimators,
loss aggregation, KL types) are ``str`` here: ``app.config.verl_names`` lists them, checked
against the verl the project pins.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args, get_origin

from app.config.errors import ConfigError

DrainMode = Literal["wait", "keep", "abort", "continue"]
WeightSyncWay = Literal["disk", "transfer"]
TransferEngineChoice = Literal["auto", "shm", "ipc"]
DeviceChoice = Literal["auto", "cpu", "cuda"]
LauncherChoice = Literal["auto", "local", "ray"]
Backend = Literal["python", "process", "kubernetes"]
OnFailure = Literal["requeue", "zero_reward"]
ServedDtype = Literal["float32", "bfloat16", "float16", "auto"]


@dataclass(frozen=True)
class DataConfig:
    train_batch_size: int
    train_files: str
    shuffle: bool
    seed: int
    val_files: str | None
    max_prompt_failures: int | None


@dataclass(frozen=True)
class ModelConfig:
    path: str
    lora_rank: int
    lora_alpha: int
    target_modules: str | tuple[str, ...]


@dataclass(frozen=True)
class ValKwargsConfig:
    do_sample: bool
    temperature: float
    n: int


@dataclass(frozen=True)
class RolloutConfig:
    n: int
    temperature: float
    max_tokens: int
    val_kwargs: ValKwargsConfig


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str  # a verl policy-loss name (app/config/verl_names.py)


@dataclass(frozen=True)
class FsdpConfig:
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"]
    use_remove_padding: bool
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"]
    use_torch_compile: bool
    param_offload: bool
    optimizer_offload: bool


@dataclass(frozen=True)
class ActorConfig:
    lr: float
    lr_schedule: Literal["constant", "cosine"]
    min_lr_ratio: float
    weight_decay: float
    ppo_epochs: int
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_gpu: int | None
    use_dynamic_bsz: bool | Literal["auto"]
    ppo_max_token_len_per_gpu: int | Literal["auto"]
    micro_batch_memory_gb: float | Literal["auto"]
    enable_gradient_checkpointing: bool
    clip_ratio: float
    grad_clip: float
    loss_agg_mode: str  # verl"s agg_loss modes
    policy_loss: PolicyLossConfig
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str  # verl"s kl_penalty estimators
    fsdp_config: FsdpConfig


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    model: ModelConfig
    rollout: RolloutConfig
    actor: ActorConfig


@dataclass(frozen=True)
class AsyncRolloutConfig:
    enabled: bool
    async_train_batch_size: int  # null in the YAML: filled in as 2 x train_batch_size
    max_carry_over_age_steps: int | None
    max_carry_over_age_strategy: Literal["cancel", "wait"]
    refill: Literal["during_update", "after_update"]


@dataclass(frozen=True)
class AgentlightningConfig:
    async_rollout: AsyncRolloutConfig


@dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool
    metric: Literal["score", "acc", "seq_reward", "seq_final_reward"]
    max_num_gen_batches: int


@dataclass(frozen=True)
class OverlongConfig:
    mask: bool
    buffer_len: int
    penalty_factor: float
    max_response_length: int | None


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    rollout_is: Literal["token", "sequence"] | None
    rollout_is_threshold: float | None
    rollout_rs: str | None
    rollout_rs_threshold: float | str | None
    bypass_mode: bool
    loss_type: Literal["ppo_clip", "reinforce"]


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str  # verl"s estimator registry (ADV_ESTIMATORS)
    norm_adv_by_std_in_grpo: bool
    filter_groups: FilterGroupsConfig
    overlong: OverlongConfig
    rollout_correction: RolloutCorrectionConfig


@dataclass(frozen=True)
class RedisConfig:
    url: str | None
    host: str
    port: int
    dir: str
    password: str | None
    reconnect_s: float
    appendfsync: Literal["everysec", "always"]


@dataclass(frozen=True)
class InferenceConfig:
    urls: tuple[str, ...]
    host: str
    api_key: str | None
    dev_routes_guard: str | None
    port: int
    served_model_name: str
    dtype: ServedDtype
    max_model_len: int
    max_num_seqs: int | None
    kv_cache_memory_bytes: int
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"]
    startup_timeout_s: float
    cpu_threads: int
    device: DeviceChoice
    gpu_memory_utilization: float
    tensor_parallel_size: int
    data_parallel_size: int
    enforce_eager: bool | None
    sleep_mode: bool | Literal["auto"]
    sleep_level: Literal[1, 2]
    chat_template: str | None
    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    weight_sync: WeightSyncWay
    transfer_engine: TransferEngineChoice
    transfer_bucket_mb: float
    transfer_checksums: bool
    tool_strict_level: Literal["auto", "function", "parameter"]


@dataclass(frozen=True)
class GatewayConfig:
    host: str
    port: int
    url: str
    workers: int
    admin_token: str | None
    lease_ttl_s: float
    drain_timeout_s: float
    drain_mode: DrainMode
    sampling: Literal["enforce", "reject"]
    hold: bool
    hold_timeout_s: float
    retry_after_s: float
    max_body_bytes: int
    max_concurrent_per_rollout: int
    upstream_timeout_s: float
    upstream_health_s: float
    token_continuity: bool
    context_check: bool


@dataclass(frozen=True)
class KubernetesConfig:
    namespace: str
    image: str
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"]
    service_account: str | None
    automount_service_account_token: bool
    resources: Mapping[str, Any]
    node_selector: Mapping[str, Any]
    labels: Mapping[str, Any]
    env: Mapping[str, Any]
    gateway_url: str | None
    kubeconfig: str | None
    context: str | None
    creates_per_minute: float
    ttl_seconds_after_finished: int
    deadline_slack_s: float
    watch_timeout_s: int
    start_grace_s: float
    api_retries: int


@dataclass(frozen=True)
class ControllerConfig:
    backend: Backend
    agent: str
    rollout_timeout_s: float
    max_attempts: int
    max_lost_attempts: int
    retry_max_wait_s: float
    on_failure: OnFailure
    on_context_overflow: Literal["fail", "end"]
    overflow_reward: float
    kubernetes: KubernetesConfig


@dataclass(frozen=True)
class TrainerConfig:
    total_steps: int
    test_freq: int
    val_before_train: bool
    val_active_groups: int | None
    device: DeviceChoice
    launcher: LauncherChoice
    ranks: int
    nnodes: int
    n_gpus_per_node: int
    ray_address: str | None
    save_freq: int
    checkpoint_in_background: bool
    weights_dir: str
    weights_in_memory: Literal["auto", False]
    keep_weight_versions: int
    trained_data_ttl_s: float
    checkpoint_dir: str
    probe_tolerance: float
    step_timeout_s: float
    reload_timeout_s: float
    heartbeat_s: float
    step_retries: int
    upstream_check_s: float
    cpu_threads: int
    pause_during_update: bool | Literal["auto"]


@dataclass(frozen=True)
class LoggingConfig:
    dir: str
    wandb_project: str
    wandb_mode: Literal["offline", "online", "disabled"]
    console: bool


@dataclass(frozen=True)
class ServicesConfig:
    flower_port: int
    rollout_concurrency: int
    worker_heartbeat_s: float


@dataclass(frozen=True)
class Config:
    """A run's whole configuration, validated: each field is a section of
    ``config/default.yaml`` (docs/configuration.md says what every key does)."""

    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    agentlightning: AgentlightningConfig
    algorithm: AlgorithmConfig
    redis: RedisConfig
    inference: InferenceConfig
    gateway: GatewayConfig
    controller: ControllerConfig
    agent: Mapping[str, Any]  # free-form: handed to the agent as-is
    trainer: TrainerConfig
    logging: LoggingConfig
    services: ServicesConfig

    @classmethod
    def of(cls, source: Mapping[str, object]) -> Config:
        """The typed view of a validated configuration as a plain mapping (what
        ``load_config`` validated, or ``to_dict()`` of a run's config). A section whose keys
        differ from the dataclass's is refused with a ``ConfigError`` naming the key: the
        schema and ``config/default.yaml`` have drifted apart."""
        return _build(cls, source, "")

    def select(self, key: str) -> Any:
        """The value at a dotted key (``"inference.urls"``), as a plain JSON value."""
        # Any: the caller knows the key's type (a mapping for "agent", a list for
        # "inference.urls"), which a key given as text cannot tell the type checker
        node: object = self
        for part in key.split("."):
            node = node[part] if isinstance(node, Mapping) else getattr(node, part)
        return _unfreeze(node)

    def to_dict(self) -> dict[str, Any]:
        """The plain mapping (lists for tuples), as YAML and JSON write it."""
        # Any: callers read and edit sections of it by name (an evaluation's config is made
        # from it), as JSON values whose types the section's name decides
        return typing.cast(dict[str, Any], _unfreeze(self))


T = TypeVar("T")


def _build(cls: type[T], node: object, path: str) -> T:
    if not isinstance(node, Mapping):
        raise ConfigError([f"{path or 'config'}: must be a mapping (got {node!r})"])
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    problems = [f"{path}{k}: not a key of the configuration's schema (app/config/schema.py)"
                for k in node if k not in hints]
    problems += [f"{path}{k}: missing (every key has a default in config/default.yaml)"
                 for k in fields if k not in node]
    if problems:
        raise ConfigError(problems)
    return cls(**{k: _value(hints[k], node[k], f"{path}{k}") for k in fields})


def _value(hint: object, value: object, path: str) -> object:
    """``value`` as the type ``hint`` says, or a ConfigError naming ``path``."""
    origin = get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(typing.cast(type, hint), value, path + ".")
    if origin in (typing.Union, types.UnionType):
        for member in get_args(hint):
            try:
                return _value(member, value, path)
            except ConfigError:
                continue
    elif origin is Literal:
        # by type too: 1 == True, and a 1 must not pass as true
        if any(value == c and type(value) is type(c) for c in get_args(hint)):
            return value
    elif origin is tuple:
        if isinstance(value, list | tuple) and all(isinstance(x, str) for x in value):
            return tuple(value)
    elif origin is Mapping or hint is Mapping:
        if isinstance(value, Mapping):
            return _freeze(value)
    elif hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ConfigError([f"{path}: value {value!r} is not a {_name(hint)} (the schema in "
                       "app/config/schema.py and the rule in app/config/validate.py differ)"])


def _name(hint: object) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


class FrozenMap(Mapping[str, object]):
    """A read-only mapping for the free-form keys (``agent``, Kubernetes labels, ...); unlike
    ``types.MappingProxyType`` it copies and pickles."""

    def __init__(self, items: Mapping[str, object]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> object:
        return self._items[key]

    def __iter__(self) -> typing.Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))


def _freeze(value: object) -> object:
    if isinstance(value, Mapping):
        return FrozenMap({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _unfreeze(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _unfreeze(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: _unfreeze(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_unfreeze(v) for v in value]
    return value
