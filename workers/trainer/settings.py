"""The trainer step's settings: typed, frozen, read once from a run's config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from app.config.loader import model_dir, repo_path
from app.config.schema import Config, DrainMode
from app.config.settings import InferenceSettings
from app.config.verl_names import ADV_ESTIMATORS
from workers.trainer.batch import Overlong


@dataclass(frozen=True)
class TrainerSettings:
    model_path: Path
    weights_dir: Path
    weights_in_memory: bool     # auto: /dev/shm when it fits and every server is local
    checkpoint_dir: Path
    keep_weight_versions: int
    heartbeat_s: float          # the pause's lease: extended every beat, gone a TTL after
    reload_timeout_s: float
    upstream_check_s: float
    probe_tolerance: float
    trained_data_ttl_s: float
    save_freq: int
    checkpoint_in_background: bool
    offloads: bool              # the engine parks parameters or optimizer state off-device
    total_steps: int
    pause_during_update: bool | Literal["auto"]
    zero_reward_failures: bool  # controller.on_failure: zero_reward
    min_group_rewards: int      # 2 for a group-relative estimator, else 1
    overlong: Overlong
    lease_ttl_s: float
    drain_timeout_s: float
    drain_mode: DrainMode
    inference: InferenceSettings

    @classmethod
    def from_config(cls, cfg: Config) -> TrainerSettings:
        tr, gw = cfg.trainer, cfg.gateway
        pause = tr.pause_during_update
        return cls(
            model_path=model_dir(cfg),
            weights_dir=repo_path(str(tr.weights_dir)),
            weights_in_memory=tr.weights_in_memory == "auto",
            checkpoint_dir=repo_path(str(tr.checkpoint_dir)),
            keep_weight_versions=int(tr.keep_weight_versions),
            heartbeat_s=float(tr.heartbeat_s),
            reload_timeout_s=float(tr.reload_timeout_s),
            upstream_check_s=float(tr.upstream_check_s),
            probe_tolerance=float(tr.probe_tolerance),
            trained_data_ttl_s=float(tr.trained_data_ttl_s),
            save_freq=int(tr.save_freq),
            checkpoint_in_background=bool(tr.checkpoint_in_background),
            offloads=bool(cfg.actor_rollout_ref.actor.fsdp_config.param_offload
                          or cfg.actor_rollout_ref.actor.fsdp_config.optimizer_offload),
            total_steps=int(tr.total_steps),
            pause_during_update="auto" if pause == "auto" else bool(pause),
            zero_reward_failures=cfg.controller.on_failure == "zero_reward",
            min_group_rewards=2 if ADV_ESTIMATORS.get(str(cfg.algorithm.adv_estimator))
            else 1,
            overlong=Overlong.from_config(cfg),
            lease_ttl_s=float(gw.lease_ttl_s),
            drain_timeout_s=float(gw.drain_timeout_s),
            drain_mode=cfg.gateway.drain_mode,
            inference=InferenceSettings.from_config(cfg),
        )

    def collocated(self, device: str) -> bool:
        """Whether the gateway stays paused for the whole update (``pause_during_update``).

        ``auto``: yes on CUDA, where the engine sleeps and lends its accelerator memory to
        the update; no on CPU, where nothing has to be freed, so rollouts keep going while
        the update runs and the pause covers only loading the new weights (the samples made
        meanwhile come from the previous version: their staleness is measured and corrected
        like any other)."""
        if self.pause_during_update == "auto":
            return device.startswith("cuda")
        return self.pause_during_update

    def sleeps(self, device: str) -> bool:
        """The engines sleep through a collocated update where sleep mode is on (GPU)."""
        return self.collocated(device) and self.inference.sleep_mode

    def save_due(self, updates: int) -> bool:
        """A checkpoint is due once the run holds ``updates`` updates: every ``save_freq``,
        and at the last step."""
        return updates > 0 and (updates % self.save_freq == 0 or updates >= self.total_steps)

    def saves_in_background(self, device: str) -> bool:
        """A checkpoint is written while the next step's groups are collected only where the
        engine's state stays put between steps: verl's save brings offloaded parameters
        back onto the accelerator, which a sleeping-engine cycle has lent to inference."""
        return self.checkpoint_in_background and not self.offloads and not self.sleeps(device)
