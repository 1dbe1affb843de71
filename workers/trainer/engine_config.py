"""From carryover's configuration to verl's engine dataclasses.

``engine_spec`` reads the validated config once into an ``EngineSpec`` (it crosses process
boundaries to every rank); ``worker_config`` and ``actor_config`` build verl's own
``TrainingWorkerConfig`` and ``ActorConfig`` from it on each rank.

Precision: master weights and optimizer state are always fp32 (``model_dtype: fp32``); the
compute dtype (FSDP2 mixed precision ``param_dtype``) is bf16 on CUDA and fp32 on CPU unless
set. Nothing ever rounds the master weights to the compute dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

from app.config.schema import Config, RolloutCorrectionConfig
from app.config.settings import launcher

if TYPE_CHECKING:
    from verl.workers.config import ActorConfig, TrainingWorkerConfig

PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def pick_device(setting: str) -> str:
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


class LoraSettings(TypedDict):
    """The LoRA fields of ``EngineSpec``."""

    lora_rank: int
    lora_alpha: int
    target_modules: str | tuple[str, ...]


@dataclass(frozen=True)
class EngineSpec:
    """What every rank needs to build its engine: plain, picklable, typed."""

    device: str
    model_path: str
    pad_id: int
    seed: int
    cpu_threads: int
    compute_dtype: str
    lr: float
    weight_decay: float
    grad_clip: float
    total_steps: int
    micro_batch_size: int | None
    use_dynamic_bsz: bool
    # None = auto: each rank derives it from micro_batch_memory_gb once its engine is built
    max_token_len_per_gpu: int | None
    gradient_checkpointing: bool
    use_remove_padding: bool
    attn_implementation: str
    use_torch_compile: bool
    param_offload: bool
    optimizer_offload: bool
    clip_ratio: float
    loss_agg_mode: str
    loss_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    # algorithm.rollout_correction in verl's bypass mode, which the loss applies itself
    bypass: RolloutCorrectionConfig | None = None
    # how long a rank may wait in a collective (collective_timeout_s)
    collective_timeout_s: float = 1800.0
    # LoRA (verl's names, actor_rollout_ref.model): rank 0 trains every weight
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: str | tuple[str, ...] = "all-linear"
    # memory a micro-batch may take on a rank (GB); None = auto (token_budget.auto_budget)
    micro_batch_memory_gb: float | None = None


def engine_spec(cfg: Config, model_path: str, pad_id: int) -> EngineSpec:
    actor = cfg.actor_rollout_ref.actor
    fsdp = actor.fsdp_config
    device = pick_device(cfg.trainer.device)
    compute = fsdp.param_dtype
    if compute == "auto":
        compute = "bfloat16" if device == "cuda" else "float32"
    micro = actor.ppo_micro_batch_size_per_gpu
    max_tokens = actor.ppo_max_token_len_per_gpu
    memory = actor.micro_batch_memory_gb
    return EngineSpec(
        device=device,
        model_path=model_path,
        pad_id=int(pad_id),
        seed=int(cfg.data.seed),
        cpu_threads=int(cfg.trainer.cpu_threads),
        compute_dtype=str(compute),
        lr=float(actor.lr),
        weight_decay=float(actor.weight_decay),
        grad_clip=float(actor.grad_clip),
        total_steps=int(cfg.trainer.total_steps),
        micro_batch_size=int(micro) if micro else None,
        use_dynamic_bsz=dynamic_bsz(cfg, device),
        max_token_len_per_gpu=None if max_tokens == "auto" else int(max_tokens),
        micro_batch_memory_gb=None if memory == "auto" else float(memory),
        gradient_checkpointing=bool(actor.enable_gradient_checkpointing),
        use_remove_padding=bool(fsdp.use_remove_padding),
        attn_implementation=str(fsdp.attn_implementation),
        use_torch_compile=bool(fsdp.use_torch_compile),
        param_offload=bool(fsdp.param_offload),
        optimizer_offload=bool(fsdp.optimizer_offload),
        clip_ratio=float(actor.clip_ratio),
        loss_agg_mode=str(actor.loss_agg_mode),
        loss_mode=str(actor.policy_loss.loss_mode),
        entropy_coeff=float(actor.entropy_coeff),
        use_kl_loss=bool(actor.use_kl_loss),
        kl_loss_coef=float(actor.kl_loss_coef),
        kl_loss_type=str(actor.kl_loss_type),
        bypass=bypass_settings(cfg),
        collective_timeout_s=collective_timeout_s(cfg),
        **lora_settings(cfg),
    )


def dynamic_bsz(cfg: Config, device: str) -> bool:
    """``actor.use_dynamic_bsz``; ``auto`` = verl's token-count cut where a micro-batch costs
    its tokens: with packed rows (``use_remove_padding``). Without, every row is padded to
    the longest of its micro-batch, and verl's cut, which counts real tokens and mixes
    lengths to balance the work, can hold many times its bound: the rows are cut by count
    instead, like lengths together, as many as the bound holds at the longest. Never with
    bypass mode over several ranks (a rank could be left a micro-batch of padding alone)."""
    actor = cfg.actor_rollout_ref.actor
    if actor.use_dynamic_bsz != "auto":
        return bool(actor.use_dynamic_bsz)
    if not actor.fsdp_config.use_remove_padding:
        return False
    tr = cfg.trainer
    ranks = int(tr.nnodes) * int(tr.n_gpus_per_node) if launcher(cfg, device) == "ray" \
        else int(tr.ranks)
    return not (bypass_settings(cfg) is not None and ranks > 1)


def collective_timeout_s(cfg: Config) -> float:
    """The ranks' process-group timeout. In a weight transfer the other ranks wait in a
    collective while rank 0 takes each server in turn: at most three posts given
    ``trainer.reload_timeout_s`` (the engine's init, a start refused by a session left open,
    the start again, or a bucket's load) and three closes of a dropped server's session
    (``transfer.CLOSE_TIMEOUT_S``). NCCL's default, 10 min, was the default reload timeout
    itself. Never below gloo's default, 30 min."""
    servers = max(1, len(cfg.inference.urls or []))
    return max(1800.0, servers * (3 * float(cfg.trainer.reload_timeout_s) + 180.0) + 600.0)


def bypass_settings(cfg: Config) -> RolloutCorrectionConfig | None:
    """``algorithm.rollout_correction`` (verl's ``RolloutCorrectionConfig`` fields) when
    ``bypass_mode`` is on, else None."""
    rc = cfg.algorithm.rollout_correction
    return rc if rc.bypass_mode else None


def lora_settings(cfg: Config) -> LoraSettings:
    """``actor_rollout_ref.model.lora_rank`` / ``lora_alpha`` / ``target_modules``."""
    model = cfg.actor_rollout_ref.model
    return {"lora_rank": model.lora_rank, "lora_alpha": model.lora_alpha,
            "target_modules": model.target_modules}


def worker_config(spec: EngineSpec, forward_only: bool) -> TrainingWorkerConfig:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )

    compute = PRECISION[spec.compute_dtype]
    model = HFModelConfig(
        path=spec.model_path, use_remove_padding=spec.use_remove_padding,
        enable_gradient_checkpointing=spec.gradient_checkpointing and not forward_only,
        override_config={"attn_implementation": spec.attn_implementation},
        lora_rank=spec.lora_rank, lora_alpha=spec.lora_alpha,
        target_modules=spec.target_modules if isinstance(spec.target_modules, str)
        else list(spec.target_modules))
    engine = FSDPEngineConfig(
        strategy="fsdp2", model_dtype="fp32", dtype=spec.compute_dtype,
        mixed_precision={"param_dtype": compute, "reduce_dtype": "fp32",
                         "buffer_dtype": "fp32"},
        use_torch_compile=spec.use_torch_compile, param_offload=spec.param_offload,
        optimizer_offload=spec.optimizer_offload and not forward_only,
        # verl's defaults for a call that names no bound: every call here names one
        # (RankEngine._meta), the forward-only old-log-prob pass included
        use_dynamic_bsz=spec.use_dynamic_bsz,
        max_token_len_per_gpu=spec.max_token_len_per_gpu,
        infer_max_token_len_per_gpu=spec.max_token_len_per_gpu,
        micro_batch_size_per_gpu=spec.micro_batch_size or 1,
        infer_micro_batch_size_per_gpu=spec.micro_batch_size or 1,
        forward_only=forward_only, seed=spec.seed)
    optim = None if forward_only else FSDPOptimizerConfig(
        lr=spec.lr, weight_decay=spec.weight_decay, clip_grad=spec.grad_clip,
        total_training_steps=max(spec.total_steps, 1), lr_scheduler_type="constant")
    return TrainingWorkerConfig(model_type="language_model", model_config=model,
                                engine_config=engine, optimizer_config=optim,
                                # with LoRA the frozen base is the model's own files:
                                # a checkpoint holds the adapter (verl loads it non-strict)
                                checkpoint_config=CheckpointConfig(
                                    save_lora_only=spec.lora_rank > 0))


def actor_config(spec: EngineSpec) -> ActorConfig:
    """verl's ``ActorConfig`` as its ``ppo_loss`` reads it. The batch-size fields are verl's
    validation inputs only: mini- and micro-batches are cut by the controller."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig as VerlCorrection
    from verl.workers.config import ActorConfig, PolicyLossConfig

    clip = spec.clip_ratio
    # bypass mode: verl's own loss for it, which reads the correction from policy_loss (as
    # verl's apply_bypass_mode sets it up)
    policy_loss = PolicyLossConfig(loss_mode=spec.loss_mode) if spec.bypass is None else \
        PolicyLossConfig(loss_mode="bypass_mode",
                         rollout_correction=VerlCorrection(**asdict(spec.bypass)))
    return ActorConfig(
        strategy="fsdp", clip_ratio=clip, clip_ratio_low=clip, clip_ratio_high=clip,
        loss_agg_mode=spec.loss_agg_mode, rollout_n=1, ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1, use_torch_compile=False,
        policy_loss=policy_loss,
        entropy_coeff=spec.entropy_coeff, use_kl_loss=spec.use_kl_loss,
        kl_loss_coef=spec.kl_loss_coef, kl_loss_type=spec.kl_loss_type)
