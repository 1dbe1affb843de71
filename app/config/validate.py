"""Validation rules for a merged configuration.

Each rule yields lines of the form ``key: value <value> <rule>`` so a user sees what to
change. All problems are collected, none stops the others from being found.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Protocol, TypeGuard, get_args

from app.config.errors import ConfigError
from app.config.raw import YamlMap, at, section
from app.config.schema import DrainMode
from app.config.settings import TransferEngine, WeightSync, transfer_engine
from app.config.verl_names import ADV_ESTIMATORS, POLICY_LOSSES, ROLLOUT_RS_OPTIONS

# Sections whose content is handed to user code unchecked.
FREE_FORM_SECTIONS = ("agent", "controller.kubernetes.resources",
                      "controller.kubernetes.node_selector", "controller.kubernetes.labels",
                      "controller.kubernetes.env")

ROLLOUT_IS_MODES = (None, "token", "sequence")
BACKENDS = ("python", "process", "kubernetes")
ON_FAILURE = ("requeue", "zero_reward")
DEVICES = ("auto", "cpu", "cuda")
LOSS_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
WANDB_MODES = ("offline", "online", "disabled")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
DTYPES = ("float32", "bfloat16", "float16", "auto")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# A Kubernetes label value: at most 63 characters, alphanumerics with - _ . inside.
K8S_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
# a label key: a name as above (not empty), after an optional DNS-subdomain prefix and /
K8S_LABEL_KEY = (r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?"
                 r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
K8S_NAMESPACE = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"  # a DNS-1123 label
# what a Kubernetes agent's Job gets from carryover (workers/rollout/kubernetes.py):
# controller.kubernetes.env may not name these
AGENT_JOB_ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL", "CARRYOVER_ROLLOUT_ID",
                 "CARRYOVER_REWARD_URL", "CARRYOVER_MAX_WAIT_S", "CARRYOVER_SAMPLE",
                 "CARRYOVER_AGENT_SETTINGS")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# verl's DAPO metric names; a rollout has one reward, so the seq_* names are the score
FILTER_METRICS = ("score", "acc", "seq_reward", "seq_final_reward")


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> TypeGuard[int | float]:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else repr(v)


# A rule for one key: it takes whatever the YAML held, and says what is wrong with it, or None.
Check = Callable[[object], str | None]


def positive_int(v: object) -> str | None:
    return None if _is_int(v) and v > 0 else "must be a positive integer"


def non_negative_int(v: object) -> str | None:
    return None if _is_int(v) and v >= 0 else "must be an integer >= 0"


def finite_num(v: object) -> str | None:
    return None if _is_num(v) else "must be a number"


def positive_num(v: object) -> str | None:
    return None if _is_num(v) and v > 0 else "must be a positive number"


def non_negative_num(v: object) -> str | None:
    return None if _is_num(v) and v >= 0 else "must be a number >= 0"


def at_least(low: float) -> Check:
    def check(v: object) -> str | None:
        return None if _is_num(v) and v >= low else f"must be a number >= {_fmt(low)}"

    return check


def int_at_least(low: int) -> Check:
    def check(v: object) -> str | None:
        return None if _is_int(v) and v >= low else f"must be an integer >= {low}"

    return check


def share(v: object) -> str | None:
    """A share of something that must be given some: above 0, at most 1."""
    return None if _is_num(v) and 0 < v <= 1 else "must be a number above 0, at most 1"


def fraction(v: object) -> str | None:
    return None if _is_num(v) and 0 <= v <= 1 else "must be a number from 0 to 1"


def boolean(v: object) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def string(v: object) -> str | None:
    if isinstance(v, str) and v.strip():
        return None
    if isinstance(v, (int, float)):  # bool too: true, 123 and 1e3 are read as YAML scalars
        return f"must be a non-empty string (quote it to keep it text: '{_fmt(v)}')"
    return "must be a non-empty string"


def port(v: object) -> str | None:
    return None if _is_int(v) and 0 < v < 65536 else "must be a port number 1-65535"


def url(v: object) -> str | None:
    """An HTTP server's base URL (the gateway's, an inference server's): the routes are
    added to it, so one that already ends in /v1 (an OpenAI base URL) would get a second."""
    from urllib.parse import urlsplit

    if not isinstance(v, str) or not re.match(r"^https?://\S+$", v):
        return "must be a URL like http://host:port"
    try:
        parts = urlsplit(v)
        parts.port  # noqa: B018 - raises on a port that is no number, or out of range
    except ValueError as exc:
        return f"must be a URL like http://host:port ({exc})"
    if not parts.hostname:
        return "must be a URL like http://host:port (no host)"
    if parts.path.rstrip("/").endswith("/v1"):
        return "must be the server's root, without /v1 (the routes are added to it)"
    return None


def redis_url(v: object) -> str | None:
    ok = isinstance(v, str) and re.match(r"^(rediss?|unix)://\S+$", v)
    return None if ok else "must be a URL like redis://host:port (or rediss://, unix://)"


def one_of(*choices: object) -> Check:
    def check(v: object) -> str | None:
        # by type too: 1 == True and 0 == False, which would let a 1 pass as true here and
        # then miss every rule that tests ``is True``
        if any(v == c and type(v) is type(c) for c in choices):
            return None
        shown = ", ".join(_fmt(c) for c in choices)
        return f"must be one of {shown}"

    return check


def optional(check: Check) -> Check:
    def wrapped(v: object) -> str | None:
        return None if v is None else check(v)

    return wrapped


def auto_or(check: Check) -> Check:
    def wrapped(v: object) -> str | None:
        if v == "auto" or check(v) is None:
            return None
        return f"{check(v)}, or auto"

    return wrapped


def _names(options: str) -> list[str]:
    """verl's reading of rollout_rs: empty names dropped, each name once."""
    return list(dict.fromkeys(p.strip() for p in options.split(",") if p.strip()))


def rejection_options(v: object) -> str | None:
    names = _names(v) if isinstance(v, str) else []
    if names and all(n in ROLLOUT_RS_OPTIONS for n in names):
        return None
    return ("must name verl's rejection criteria, one or several joined by commas, from "
            + ", ".join(ROLLOUT_RS_OPTIONS))


def rejection_threshold(v: object) -> str | None:
    ok = (_is_num(v) and v > 0) or (isinstance(v, str) and v.strip() != "")
    return None if ok else "must be a positive number or a string of thresholds"


def _rejection_thresholds(options: str, spec: object) -> str | None:
    """What verl would refuse in ``rollout_rs_threshold`` for ``options``
    (``rollout_corr_helper._parse_rollout_rs_thresholds``), or None."""
    names = _names(options)
    if _is_num(spec):
        parts = [str(spec)]
    elif isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",") if p.strip()]
    else:  # null: its own rule takes nothing else
        return f"must be a positive number when rollout_rs is {options!r}"
    if len(parts) not in (1, len(names)):
        return f"must give one threshold, or one per rollout_rs option ({len(names)})"
    for name, part in zip(names, parts * len(names) if len(parts) == 1 else parts,
                          strict=False):
        two_sided = name.endswith("k1")
        if "_" in part and not two_sided:
            return f"for {name} must be one upper bound (lower_upper is for the *_k1 ones)"
        try:
            if two_sided and "_" in part:
                lower, upper = (float(b) for b in part.split("_", 1))
            else:
                upper = float(part)
                lower = 1.0 / upper if two_sided and upper else 1.0  # verl's own default
        except ValueError:
            return (f"for {name} must be a positive number"
                    + (" or lower_upper" if two_sided else ""))
        if not (lower > 0 and upper > 0) or (two_sided and lower > upper):
            return (f"for {name} must be positive" + (
                " with lower <= upper (one number u means 1/u to u: u >= 1)" if two_sided
                else ""))
    return None


def url_list(v: object) -> str | None:
    if not isinstance(v, list) or not v:
        return "must be a non-empty list of URLs"
    bad = [f"{u!r} {url(u)}" for u in v if url(u)]
    return f"has entries that are not servers' URLs: {'; '.join(bad)}" if bad else None


def mapping(v: object) -> str | None:
    return None if isinstance(v, dict) else "must be a mapping"


def string_mapping(v: object) -> str | None:
    if not isinstance(v, dict):
        return "must be a mapping of strings"
    bad = [k for k, x in v.items() if not isinstance(x, str)]
    return f"must map to strings; not strings: {bad}" if bad else None


def k8s_env_mapping(v: object) -> str | None:
    """Each value a string, or a Secret's key: ``{secret: <name>, key: <key>}``."""
    if not isinstance(v, dict):
        return "must be a mapping of strings or {secret: name, key: key}"
    bad = [k for k, x in v.items() if not isinstance(x, str) and not (
        isinstance(x, dict) and set(x) == {"secret", "key"}
        and all(isinstance(s, str) and s for s in x.values()))]
    if bad:
        return f"must map to strings or {{secret: name, key: key}}; not: {bad}"
    taken = sorted(set(v) & set(AGENT_JOB_ENV))
    return (f"names {taken}, which carryover sets for the agent (it would be overwritten): "
            "give it another name" if taken else None)


def k8s_namespace(v: object) -> str | None:
    problem = string(v)
    if problem is None and isinstance(v, str) and not re.match(K8S_NAMESPACE, v):
        return "must be a Kubernetes namespace name (lower-case letters, digits and -)"
    return problem


def k8s_resources(v: object) -> str | None:
    """``{limits: {cpu: 1, memory: 2Gi}, requests: {...}}``, as a container spec has it."""
    if not isinstance(v, dict):
        return "must be a mapping like {limits: {cpu: 1, memory: 2Gi}, requests: {...}}"
    unknown = sorted(set(v) - {"limits", "requests"})
    if unknown:
        return f"has unknown keys {unknown} (limits, requests)"
    bad = [k for k, x in v.items() if not isinstance(x, dict) or not all(
        isinstance(q, str | int | float) and not isinstance(q, bool) for q in x.values())]
    return (f"has {bad} not mapping each resource to a quantity (cpu: 1, memory: 2Gi)"
            if bad else None)


def k8s_label_mapping(v: object) -> str | None:
    problem = string_mapping(v)
    if problem or not isinstance(v, dict):  # (no problem: a mapping of strings)
        return problem
    bad = [f"{k}={x}" for k, x in v.items() if not re.match(K8S_LABEL_VALUE, x)]
    if bad:
        return f"has label values Kubernetes refuses: {bad}"
    bad = [k for k in v if not re.match(K8S_LABEL_KEY, str(k))]
    return f"has label keys Kubernetes refuses: {bad}" if bad else None


def test_freq(v: object) -> str | None:
    ok = _is_int(v) and (v == -1 or v > 0)
    return None if ok else "must be a positive integer, or -1 (never)"


def lora_targets(v: object) -> str | None:
    if v == "all-linear":
        return None
    if not isinstance(v, list | tuple) or not v or not all(isinstance(x, str) and x for x in v):
        return "must be all-linear or a list of module names (q_proj, v_proj, ...)"
    # vLLM 0.32 serves LoRA on linear layers only (not on embeddings or the output head)
    bad = [x for x in v if x in ("embed_tokens", "lm_head", "wte", "word_embeddings")]
    if bad:
        return f"names {', '.join(bad)}, which vLLM cannot serve a LoRA adapter on"
    return None


def agent_ref(v: object) -> str | None:
    if isinstance(v, str) and v.strip():
        return None
    return "must name the agent (module:function or a command)"


policy_loss_mode = one_of(*POLICY_LOSSES)


RULES: dict[str, Check] = {
    "data.train_batch_size": positive_int,
    "data.train_files": string,
    "data.shuffle": boolean,
    "data.seed": non_negative_int,
    "data.val_files": optional(string),
    "data.max_prompt_failures": optional(positive_int),
    "actor_rollout_ref.model.path": string,
    "actor_rollout_ref.rollout.n": positive_int,
    "actor_rollout_ref.rollout.temperature": positive_num,
    "actor_rollout_ref.rollout.max_tokens": positive_int,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": boolean,
    "actor_rollout_ref.rollout.val_kwargs.temperature": non_negative_num,
    "actor_rollout_ref.rollout.val_kwargs.n": positive_int,
    "actor_rollout_ref.actor.lr": positive_num,
    "actor_rollout_ref.actor.lr_schedule": one_of("constant", "cosine"),
    "actor_rollout_ref.actor.min_lr_ratio": fraction,
    "actor_rollout_ref.actor.weight_decay": non_negative_num,
    "actor_rollout_ref.actor.ppo_epochs": positive_int,
    "actor_rollout_ref.actor.ppo_mini_batch_size": non_negative_int,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": optional(positive_int),
    "actor_rollout_ref.actor.use_dynamic_bsz": one_of("auto", True, False),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": auto_or(positive_int),
    "actor_rollout_ref.actor.micro_batch_memory_gb": auto_or(positive_num),
    "actor_rollout_ref.actor.enable_gradient_checkpointing": boolean,
    "actor_rollout_ref.actor.policy_loss.loss_mode": policy_loss_mode,
    "actor_rollout_ref.actor.fsdp_config.param_dtype": one_of("auto", "float32", "bfloat16",
                                                              "float16"),
    "actor_rollout_ref.actor.fsdp_config.use_remove_padding": boolean,
    "actor_rollout_ref.actor.fsdp_config.attn_implementation": one_of(
        "sdpa", "eager", "flash_attention_2"),
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile": boolean,
    "actor_rollout_ref.actor.fsdp_config.param_offload": boolean,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": boolean,
    "actor_rollout_ref.actor.clip_ratio": positive_num,
    "actor_rollout_ref.actor.grad_clip": positive_num,
    "actor_rollout_ref.actor.loss_agg_mode": one_of(*LOSS_AGG),
    "actor_rollout_ref.actor.entropy_coeff": non_negative_num,
    "actor_rollout_ref.actor.use_kl_loss": boolean,
    "actor_rollout_ref.actor.kl_loss_coef": non_negative_num,
    "actor_rollout_ref.actor.kl_loss_type": one_of(*KL_TYPES),
    "agentlightning.async_rollout.enabled": boolean,
    # null only when train_batch_size is itself invalid (it is derived from it otherwise)
    "agentlightning.async_rollout.async_train_batch_size": optional(positive_int),
    "agentlightning.async_rollout.max_carry_over_age_steps": optional(positive_int),
    "agentlightning.async_rollout.max_carry_over_age_strategy": one_of("cancel", "wait"),
    "agentlightning.async_rollout.refill": one_of("during_update", "after_update"),
    "algorithm.adv_estimator": one_of(*ADV_ESTIMATORS),
    "algorithm.norm_adv_by_std_in_grpo": boolean,
    "algorithm.filter_groups.enable": boolean,
    "algorithm.filter_groups.metric": one_of(*FILTER_METRICS),
    "algorithm.filter_groups.max_num_gen_batches": non_negative_int,
    "algorithm.overlong.mask": boolean,
    "algorithm.overlong.buffer_len": non_negative_int,
    "algorithm.overlong.penalty_factor": non_negative_num,
    "algorithm.overlong.max_response_length": optional(positive_int),
    "algorithm.rollout_correction.rollout_is": one_of(*ROLLOUT_IS_MODES),
    "algorithm.rollout_correction.rollout_is_threshold": optional(positive_num),
    "algorithm.rollout_correction.rollout_rs": optional(rejection_options),
    "algorithm.rollout_correction.rollout_rs_threshold": optional(rejection_threshold),
    "algorithm.rollout_correction.bypass_mode": boolean,
    "algorithm.rollout_correction.loss_type": one_of("ppo_clip", "reinforce"),
    "redis.url": optional(redis_url),
    "redis.host": string,
    "redis.port": port,
    "redis.dir": string,
    "redis.password": optional(string),
    "redis.reconnect_s": at_least(5),
    "redis.appendfsync": one_of("everysec", "always"),
    "inference.chat_template": optional(string),
    "inference.tool_call_parser": optional(string),
    "inference.enable_auto_tool_choice": boolean,
    "inference.tool_strict_level": one_of("auto", "function", "parameter"),
    "inference.urls": url_list,
    "inference.host": string,
    "inference.api_key": optional(string),
    "inference.dev_routes_guard": optional(string),
    "inference.port": port,
    "inference.served_model_name": string,
    "inference.dtype": one_of(*DTYPES),
    "inference.max_model_len": positive_int,
    "inference.max_num_seqs": optional(positive_int),
    "inference.kv_cache_memory_bytes": positive_int,
    "inference.logprobs_mode": one_of(*LOGPROBS_MODES),
    "inference.startup_timeout_s": positive_num,
    "inference.cpu_threads": non_negative_int,
    "inference.device": one_of(*DEVICES),
    "inference.gpu_memory_utilization": share,
    "inference.tensor_parallel_size": positive_int,
    "inference.data_parallel_size": positive_int,
    "inference.enforce_eager": optional(boolean),
    "inference.sleep_mode": one_of("auto", True, False),
    "inference.sleep_level": one_of(1, 2),
    "actor_rollout_ref.model.lora_rank": non_negative_int,
    "actor_rollout_ref.model.lora_alpha": positive_int,
    "actor_rollout_ref.model.target_modules": lora_targets,
    "inference.weight_sync": one_of(*get_args(WeightSync)),
    "inference.transfer_engine": one_of("auto", *get_args(TransferEngine)),
    "inference.transfer_bucket_mb": at_least(0.001),  # 1 KiB; 0 bytes once made an int
    "inference.transfer_checksums": boolean,
    "gateway.host": string,
    "gateway.port": port,
    "gateway.url": url,
    "gateway.workers": positive_int,
    "gateway.admin_token": optional(string),
    "gateway.lease_ttl_s": at_least(1),  # kept alive every third of it; in whole ms
    "gateway.drain_timeout_s": non_negative_num,
    "gateway.hold": boolean,
    "gateway.hold_timeout_s": positive_num,
    "gateway.retry_after_s": positive_num,
    "gateway.max_body_bytes": positive_int,
    "gateway.max_concurrent_per_rollout": positive_int,
    "gateway.upstream_timeout_s": positive_num,
    "gateway.upstream_health_s": non_negative_num,
    "controller.backend": one_of(*BACKENDS),
    "controller.agent": agent_ref,
    "controller.rollout_timeout_s": positive_num,
    "controller.max_attempts": positive_int,
    "controller.max_lost_attempts": positive_int,
    "controller.on_failure": one_of(*ON_FAILURE),
    "controller.on_context_overflow": one_of("fail", "end"),
    "controller.overflow_reward": finite_num,
    "gateway.context_check": boolean,
    "gateway.token_continuity": boolean,
    "controller.kubernetes.namespace": k8s_namespace,
    "controller.kubernetes.image": string,
    "controller.kubernetes.image_pull_policy": one_of(*PULL_POLICIES),
    "controller.kubernetes.service_account": optional(string),
    "controller.kubernetes.automount_service_account_token": boolean,
    "controller.kubernetes.resources": k8s_resources,
    "controller.kubernetes.node_selector": string_mapping,
    "controller.kubernetes.labels": k8s_label_mapping,
    "controller.kubernetes.env": k8s_env_mapping,
    "controller.kubernetes.gateway_url": optional(url),
    "controller.kubernetes.kubeconfig": optional(string),
    "controller.kubernetes.context": optional(string),
    "controller.kubernetes.creates_per_minute": positive_num,
    # the worker reads the finished pod's log (a printed reward) after the Job ends
    "controller.kubernetes.ttl_seconds_after_finished": int_at_least(60),
    "controller.kubernetes.deadline_slack_s": non_negative_num,
    "controller.kubernetes.watch_timeout_s": positive_int,
    "controller.kubernetes.start_grace_s": non_negative_num,
    "controller.kubernetes.api_retries": positive_int,
    "trainer.total_steps": positive_int,
    "trainer.test_freq": test_freq,
    "trainer.val_before_train": boolean,
    "trainer.val_active_groups": optional(positive_int),
    "trainer.device": one_of(*DEVICES),
    "trainer.ranks": positive_int,
    "controller.retry_max_wait_s": positive_num,
    "gateway.sampling": one_of("enforce", "reject"),
    "gateway.drain_mode": one_of(*get_args(DrainMode)),
    "trainer.launcher": one_of("auto", "local", "ray"),
    "trainer.nnodes": positive_int,
    "trainer.n_gpus_per_node": positive_int,
    "trainer.ray_address": optional(string),
    "trainer.save_freq": positive_int,
    "trainer.checkpoint_in_background": boolean,
    "trainer.weights_dir": string,
    "trainer.weights_in_memory": one_of("auto", False),
    "trainer.keep_weight_versions": positive_int,
    "trainer.checkpoint_dir": string,
    "trainer.probe_tolerance": positive_num,
    "trainer.step_timeout_s": positive_num,
    "trainer.reload_timeout_s": positive_num,
    "trainer.trained_data_ttl_s": positive_num,
    "trainer.heartbeat_s": positive_num,
    "trainer.step_retries": non_negative_int,
    "trainer.upstream_check_s": positive_num,
    "trainer.pause_during_update": one_of("auto", True, False),
    "trainer.cpu_threads": non_negative_int,
    "logging.dir": string,
    "logging.wandb_project": string,
    "logging.wandb_mode": one_of(*WANDB_MODES),
    "logging.console": boolean,
    "services.flower_port": port,
    "services.rollout_concurrency": positive_int,
    "services.worker_heartbeat_s": positive_num,
}


class KeysOk(Protocol):
    """Whether each key named passed its own rule (in ``RULES``): a rule between keys is
    checked only then."""

    def __call__(self, *keys: str) -> bool: ...


# A rule between keys reads a key's value as the type its own rule holds it to, once
# ``ok(key)`` said it passed that rule: a TypeError here is a rule that read a key too early.
def _int(cfg: YamlMap, key: str) -> int:
    value = at(cfg, key)
    if not _is_int(value):
        raise TypeError(f"{key}: {value!r} read as an integer before its rule passed")
    return value


def _optional_int(cfg: YamlMap, key: str) -> int | None:
    value = at(cfg, key)
    return None if value is None else _int(cfg, key)


def _num(cfg: YamlMap, key: str) -> float:
    value = at(cfg, key)
    if not _is_num(value):
        raise TypeError(f"{key}: {value!r} read as a number before its rule passed")
    return value  # an int stays one: the messages show the value as given


def _str(cfg: YamlMap, key: str) -> str:
    value = at(cfg, key)
    if not isinstance(value, str):
        raise TypeError(f"{key}: {value!r} read as a string before its rule passed")
    return value


def _strs(cfg: YamlMap, key: str) -> list[str]:
    value = at(cfg, key)
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise TypeError(f"{key}: {value!r} read as a list of strings before its rule passed")
    return [x for x in value if isinstance(x, str)]


def _bypass_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """What verl's bypass loss (``algorithm.rollout_correction.bypass_mode``) cannot take."""
    problems = []
    loss_mode = at(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode")
    if loss_mode != "vanilla":
        problems.append(
            f"actor_rollout_ref.actor.policy_loss.loss_mode: value {_fmt(loss_mode)} cannot be "
            "used with algorithm.rollout_correction.bypass_mode (verl's bypass loss is PPO's "
            "clip or REINFORCE, chosen by algorithm.rollout_correction.loss_type): set it to "
            "vanilla or turn bypass_mode off")
    micro = at(cfg, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    ranks = max(_int(cfg, "trainer.ranks"),
                _int(cfg, "trainer.nnodes") * _int(cfg, "trainer.n_gpus_per_node")) \
        if ok("trainer.ranks", "trainer.nnodes", "trainer.n_gpus_per_node") else 1
    # use_dynamic_bsz auto is false here
    if micro == 1 and ranks > 1 and \
            at(cfg, "actor_rollout_ref.actor.use_dynamic_bsz") is not True:
        problems.append(
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: value 1 cannot be used "
            f"with algorithm.rollout_correction.bypass_mode over {ranks} ranks: a batch that "
            "does not divide over them leaves a rank a micro-batch of padding alone, with no "
            "trained token, which verl's bypass loss refuses; use 2 or more")
    if ranks > 1 and at(cfg, "actor_rollout_ref.actor.use_dynamic_bsz") is True:
        problems.append(
            f"actor_rollout_ref.actor.use_dynamic_bsz: value true cannot be used with "
            f"algorithm.rollout_correction.bypass_mode over {ranks} ranks: verl cuts every "
            "rank's rows into as many micro-batches as the busiest rank needs, which can leave "
            "a padding row in a micro-batch of its own with no trained token; verl's bypass "
            "loss refuses it and the other ranks wait for it forever. Use a fixed "
            "ppo_micro_batch_size_per_gpu of 2 or more")
    return problems


def _data_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """The batch sizes fit in one another, and the prompts' chat template is a file."""
    problems = []
    if ok("data.train_batch_size", "agentlightning.async_rollout.async_train_batch_size",
          "agentlightning.async_rollout.enabled") \
            and at(cfg, "agentlightning.async_rollout.enabled"):
        tbs = _int(cfg, "data.train_batch_size")
        atbs = _int(cfg, "agentlightning.async_rollout.async_train_batch_size")
        if atbs <= tbs:
            problems.append(
                f"agentlightning.async_rollout.async_train_batch_size: value {atbs} must be "
                f"strictly greater than data.train_batch_size ({tbs}) when "
                f"async_rollout.enabled is true (a good start is 2 x train_batch_size = "
                f"{2 * tbs})"
            )
    if ok("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"):
        tbs = _int(cfg, "data.train_batch_size")
        mini = _int(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size")
        if mini and mini > tbs:
            # as verl's actor config refuses it: it would silently mean the whole batch
            problems.append(f"actor_rollout_ref.actor.ppo_mini_batch_size: value {mini} is "
                            f"more than data.train_batch_size ({tbs}): groups per optimizer "
                            "step, at most the batch (0 for the whole batch in one)")
    from app.config.loader import repo_path  # the loader imports this module

    template = at(cfg, "inference.chat_template")  # null, or a non-empty string
    if ok("inference.chat_template") and isinstance(template, str) \
            and not repo_path(template).is_file():
        problems.append(f"inference.chat_template: no file {template!r} (a path relative to "
                        f"the repository, or absolute)")
    return problems


def _algorithm_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """The advantage estimator's groups, the over-long penalty and verl's rollout correction."""
    problems = []
    if ok("actor_rollout_ref.rollout.n", "algorithm.adv_estimator"):
        n = _int(cfg, "actor_rollout_ref.rollout.n")
        est = _str(cfg, "algorithm.adv_estimator")
        if ADV_ESTIMATORS.get(est) and n < 2:
            problems.append(
                f"actor_rollout_ref.rollout.n: value {n} must be >= 2 for the group-relative "
                f"estimator algorithm.adv_estimator={est}"
            )
    if ok("algorithm.overlong.buffer_len", "algorithm.overlong.max_response_length"):
        buffer_len = _int(cfg, "algorithm.overlong.buffer_len")
        longest = _optional_int(cfg, "algorithm.overlong.max_response_length")
        if buffer_len > 0 and (longest is None or longest <= buffer_len):
            problems.append(
                f"algorithm.overlong.max_response_length: value {_fmt(longest)} must be an "
                f"integer greater than algorithm.overlong.buffer_len ({buffer_len}) when the "
                "soft over-long penalty is on"
            )
    rc = section(cfg, "algorithm.rollout_correction")
    if rc["rollout_is"] is not None and rc["rollout_is_threshold"] is None:
        problems.append(
            f"algorithm.rollout_correction.rollout_is_threshold: value null must be a positive "
            f"number when rollout_is is {rc['rollout_is']!r}"
        )
    rs = rc["rollout_rs"]  # null, or the names of verl's criteria
    if ok("algorithm.rollout_correction.rollout_rs",
          "algorithm.rollout_correction.rollout_rs_threshold") and isinstance(rs, str):
        why = _rejection_thresholds(rs, rc["rollout_rs_threshold"])
        if why is not None:
            problems.append("algorithm.rollout_correction.rollout_rs_threshold: value "
                            f"{_fmt(rc['rollout_rs_threshold'])} {why}")
    if rc["bypass_mode"] is True:
        problems += _bypass_rules(cfg, ok)
    return problems


def _controller_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """The agent the controller runs: a module:function reference, its settings a mapping."""
    problems = []
    backend = at(cfg, "controller.backend")
    agent = at(cfg, "controller.agent")
    if ok("controller.backend", "controller.agent") and backend == "python" and not re.match(
        r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", _str(cfg, "controller.agent")
    ):
        problems.append(
            f"controller.agent: value {agent!r} must be module:function when "
            f"controller.backend is 'python'"
        )
    if not isinstance(cfg.get("agent"), dict):
        problems.append(f"agent: value {_fmt(cfg.get('agent'))} must be a mapping")
    return problems


def _update_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """A weight update: engines that may sleep, a launcher for every node, a drain that fits."""
    problems = []
    if ok("inference.sleep_mode", "inference.device") and at(cfg, "inference.sleep_mode") \
            is True and at(cfg, "inference.device") == "cpu":
        problems.append("inference.sleep_mode: value true is refused by vLLM on CPU "
                        "(inference.device cpu), where sleeping frees nothing; use auto")
    if ok("inference.sleep_mode", "trainer.pause_during_update") \
            and at(cfg, "inference.sleep_mode") is True \
            and at(cfg, "trainer.pause_during_update") is False:
        problems.append("inference.sleep_mode: value true needs updates that pause the gateway "
                        "(the engines sleep only then), and trainer.pause_during_update is "
                        "false: the servers would reserve sleep memory and never sleep; use "
                        "auto")
    if ok("trainer.launcher", "trainer.nnodes") and at(cfg, "trainer.launcher") == "local" \
            and _int(cfg, "trainer.nnodes") > 1:
        problems.append(f"trainer.nnodes: value {at(cfg, 'trainer.nnodes')} needs verl's Ray "
                        "worker group, and trainer.launcher is local (ranks on this host, "
                        "trainer.ranks): use launcher ray or auto")
    if ok("inference.sleep_mode", "gateway.drain_mode") and at(cfg, "gateway.drain_mode") \
            == "keep" and at(cfg, "inference.sleep_mode") is True:
        problems.append("gateway.drain_mode: value 'keep' cannot work with inference.sleep_mode "
                        "true: calls frozen across the update hold the engine's KV cache, which "
                        "a sleeping engine drops; use sleep_mode auto (the engine stays awake and "
                        "the update needs memory beside it) or drain_mode continue, wait or abort")
    return problems


def _evaluation_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """Evaluation on held-out prompts: prompts to evaluate, a temperature that can sample."""
    problems = []
    if ok("trainer.test_freq", "data.val_files") and _int(cfg, "trainer.test_freq") > 0 \
            and not at(cfg, "data.val_files"):
        problems.append(f"trainer.test_freq: value {at(cfg, 'trainer.test_freq')} needs "
                        "data.val_files (the held-out prompts to evaluate); set it, or "
                        "test_freq -1")
    val = "actor_rollout_ref.rollout.val_kwargs."
    if ok(val + "do_sample", val + "temperature") and at(cfg, val + "do_sample") \
            and at(cfg, val + "temperature") == 0:
        problems.append(f"{val}temperature: value 0 cannot sample with {val}do_sample true; "
                        "set a temperature above 0, or do_sample false (greedy)")
    return problems


def _retry_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """Agents retry for longer than an ordinary pause lasts."""
    if not ok("controller.retry_max_wait_s", "gateway.drain_timeout_s", "trainer.heartbeat_s"):
        return []
    wait = _num(cfg, "controller.retry_max_wait_s")
    drain = _num(cfg, "gateway.drain_timeout_s")
    beat = _num(cfg, "trainer.heartbeat_s")
    if wait < drain + beat:
        return [
            f"controller.retry_max_wait_s: value {wait} must be at least gateway.drain_timeout_s"
            f" + trainer.heartbeat_s ({drain + beat}): agents would give up during an ordinary "
            "pause"]
    return []


def _weight_sync_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """New weights reach the servers: dev routes kept guarded, a weight_sync that can work."""
    problems = []
    host = at(cfg, "inference.host")
    if ok("inference.host", "inference.dev_routes_guard") \
            and not is_loopback(_str(cfg, "inference.host")) \
            and not at(cfg, "inference.dev_routes_guard"):
        problems.append(
            f"inference.host: value {host!r} opens the inference server beyond this machine, "
            "and with it vLLM's dev routes, which no API key guards: /collective_rpc loads "
            "weights from any path, /sleep and /pause stop generation, the weight-transfer "
            "routes replace the weights. Bind to 127.0.0.1, or set "
            "inference.dev_routes_guard to how they are kept from all but the trainer (a "
            "network policy admitting only the gateway and trainer hosts; "
            "docs/operations.md, Security)")
    if ok("inference.weight_sync", "inference.urls") \
            and at(cfg, "inference.weight_sync") == "transfer":
        problems += _transfer_rules(cfg)
    ipc_on_cpu = False
    for side in ("inference.device", "trainer.device"):
        if ok("inference.transfer_engine", side) \
                and at(cfg, "inference.transfer_engine") == "ipc" and at(cfg, side) == "cpu":
            ipc_on_cpu = True
            problems.append("inference.transfer_engine: value 'ipc' hands GPU memory over "
                            f"(CUDA IPC), and {side} is cpu: use shm or auto")
    layout = ("inference.urls", "inference.tensor_parallel_size", "inference.data_parallel_size",
              "trainer.launcher", "trainer.ranks", "trainer.nnodes", "trainer.n_gpus_per_node")
    if ok("inference.transfer_engine", "inference.weight_sync", *layout) and not ipc_on_cpu \
            and at(cfg, "inference.weight_sync") == "transfer" \
            and at(cfg, "inference.transfer_engine") == "ipc":
        from omegaconf import OmegaConf

        try:  # the rule the server command and the trainer apply, on the GPU ipc needs
            transfer_engine(OmegaConf.create(cfg), "cuda")
        except ConfigError as exc:
            problems += exc.problems
    return problems


def _model_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """The served model: a LoRA adapter it can serve, a default reply that fits its context."""
    problems = []
    if ok("actor_rollout_ref.model.lora_rank") and at(cfg, "actor_rollout_ref.model.lora_rank"):
        problems += _lora_rules(cfg, ok)
    if ok("actor_rollout_ref.rollout.max_tokens", "inference.max_model_len"):
        max_tokens = _int(cfg, "actor_rollout_ref.rollout.max_tokens")
        max_len = _int(cfg, "inference.max_model_len")
        if max_tokens >= max_len:
            problems.append(
                f"actor_rollout_ref.rollout.max_tokens: value {max_tokens} must be below "
                f"inference.max_model_len ({max_len}): the gateway asks that many tokens for "
                "a call that names none, and refuses a prompt that does not fit beside them")
    return problems


def _service_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """The services beside one another: ports of their own, waits that outlast each other's."""
    problems = _port_rules(cfg, ok)
    if ok("controller.kubernetes.deadline_slack_s", "controller.kubernetes.watch_timeout_s"):
        slack = _num(cfg, "controller.kubernetes.deadline_slack_s")
        window = _int(cfg, "controller.kubernetes.watch_timeout_s")
        if slack < 2 * window:
            problems.append(
                f"controller.kubernetes.deadline_slack_s: value {slack} must be at least twice "
                f"controller.kubernetes.watch_timeout_s ({window}): the Job's deadline is moved "
                "out by the time paused once per watch window, and must not run out in between")
    if ok("trainer.reload_timeout_s", "inference.startup_timeout_s"):
        reload_s = _num(cfg, "trainer.reload_timeout_s")
        start_s = _num(cfg, "inference.startup_timeout_s")
        if reload_s < start_s:
            problems.append(
                f"trainer.reload_timeout_s: value {reload_s} must be at least "
                f"inference.startup_timeout_s ({start_s}): a server that restarts during a "
                "step takes up to that long to answer again, and the step would fail (the "
                "gateway paused meanwhile) before it is back")
    return problems


# The groups of rules between keys, in the order their problems are reported.
CROSS_RULES: tuple[Callable[[YamlMap, KeysOk], list[str]], ...] = (
    _data_rules, _algorithm_rules, _controller_rules, _update_rules, _evaluation_rules,
    _retry_rules, _weight_sync_rules, _model_rules, _service_rules)


def _cross_rules(cfg: YamlMap, bad: set[str]) -> list[str]:
    """Rules between keys; a rule is checked only when each key it reads is valid alone."""

    def ok(*names: str) -> bool:
        return not bad.intersection(names)

    problems = []
    for rules in CROSS_RULES:
        problems += rules(cfg, ok)
    return problems


def _port_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """The ports ``carryover up`` binds on this host differ (else a service fails to start
    with an error that blames another stack)."""
    names = ["inference.port", "gateway.port", "services.flower_port"]
    if at(cfg, "redis.url") is None:  # the embedded server
        names.insert(0, "redis.port")
    seen: dict[int, str] = {}
    out = []
    for name in names:
        if not ok(name):
            continue
        value = _int(cfg, name)
        if value in seen:
            out.append(f"{name}: value {value} is also {seen[value]}: each service on this "
                       "host binds its own port")
        seen.setdefault(value, name)
    return out


def _lora_rules(cfg: YamlMap, ok: KeysOk) -> list[str]:
    """A LoRA adapter the servers can serve, synced the way adapters are."""
    from app.config.settings import MAX_LORA_RANKS

    rank = _int(cfg, "actor_rollout_ref.model.lora_rank")  # (read once its rule passed)
    out = []
    if rank > MAX_LORA_RANKS[-1]:
        out.append(f"actor_rollout_ref.model.lora_rank: value {rank} is above the largest "
                   f"rank vLLM serves ({MAX_LORA_RANKS[-1]}, its --max-lora-rank)")
    if ok("inference.weight_sync") and at(cfg, "inference.weight_sync") == "transfer":
        out.append("inference.weight_sync: value 'transfer' sends whole weights; with "
                   "actor_rollout_ref.model.lora_rank set, each update's adapter (megabytes) "
                   "is loaded by name instead: use weight_sync disk")
    if ok("inference.sleep_level") and at(cfg, "inference.sleep_level") == 2:
        out.append("inference.sleep_level: value 2 drops the base weights while the engine "
                   "sleeps, and with actor_rollout_ref.model.lora_rank only the adapter is "
                   "loaded after: use sleep_level 1")
    if ok("trainer.keep_weight_versions") and _int(cfg, "trainer.keep_weight_versions") < 2:
        out.append("trainer.keep_weight_versions: with actor_rollout_ref.model.lora_rank the "
                   "servers serve the previous version's adapter too, from its folder: keep "
                   "at least 2")
    if ok("gateway.drain_mode") and at(cfg, "gateway.drain_mode") == "keep":
        out.append("gateway.drain_mode: value 'keep' cannot work with a LoRA adapter "
                   "(actor_rollout_ref.model.lora_rank): a frozen call names the previous "
                   "version's adapter and would go on sampling from it after the switch; use "
                   "wait, abort or continue")
    return out


def _transfer_rules(cfg: YamlMap) -> list[str]:
    """``weight_sync: transfer`` goes through shared memory, so every server is on the
    trainer's host."""
    from urllib.parse import urlsplit

    far = [u for u in _strs(cfg, "inference.urls")
           if not is_loopback(urlsplit(u).hostname or "")]
    if far:
        return [f"inference.weight_sync: value 'transfer' hands the weights over in this host's "
                f"shared memory, which the server(s) {', '.join(far)} (inference.urls) cannot "
                "read: use weight_sync disk for servers on other hosts"]
    nodes = at(cfg, "trainer.nnodes")
    if _is_int(nodes) and nodes > 1:
        return [f"inference.weight_sync: value 'transfer' needs the trainer's rank 0 on the "
                f"servers' host, which trainer.nnodes {nodes} does not promise: use "
                "weight_sync disk"]
    return []


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address) is this machine's loopback."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def validate(cfg: YamlMap) -> list[str]:
    """Every problem in ``cfg`` (a merged plain dict), one line each; empty when valid."""
    problems = []
    bad = set()
    for key, check in RULES.items():
        value = at(cfg, key)
        rule = check(value)
        if rule:
            bad.add(key)
            problems.append(f"{key}: value {_fmt(value)} {rule}")
    problems += _cross_rules(cfg, bad)
    return problems
