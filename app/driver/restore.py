"""Asking the trainer worker to give the inference servers the run's weights again.

A restarted inference server serves the initial model until the trainer worker's upstream
keeper reloads the published weights into it. The keeper cannot when those weights exist
only in a trainer that is gone (``inference.weight_sync: transfer``, and the trainer worker
restarted too, as when the host of both rebooted) or when their export is gone (a reboot
empties ``/dev/shm``). With every server stale no rollout finishes, so no update would ever
come to load them: the run would stall. The keeper then sets
``keys.upstreams_need_weights``, and the driver, while it waits for groups, sends the
trainer task ``restore_servers``, which loads the run's last checkpoint where the worker
holds no trainer and serves its weights under a new policy version; the updates lost are
reported with the next step.
"""

from __future__ import annotations

import logging
import time

import redis

from app.config.schema import Config
from app.driver.metrics import Metrics
from app.driver.trainer_call import call_trainer
from app.state import keys

log = logging.getLogger(__name__)


class ServerRestore:
    """Called while the driver waits for groups: sends ``restore_servers`` when the keeper
    asks for it, and after a failure not again for ``retry_s``."""

    def __init__(self, client: redis.Redis, cfg: Config, run_id: str,
                 retry_s: float = 30.0) -> None:
        self.client, self.cfg, self.run_id, self.retry_s = client, cfg, run_id, retry_s
        self._next_try = 0.0

    def __call__(self) -> Metrics | None:
        """The task's metrics when it ran, else None."""
        why = self.client.get(keys.upstreams_need_weights())
        if why is None or time.monotonic() < self._next_try:
            return None
        log.warning("the upstream keeper cannot restore an inference server (%s): asking the "
                    "trainer worker to serve the run's weights", why)
        try:
            metrics = call_trainer(self.client, self.cfg,
                                   "workers.trainer.tasks.restore_servers", self.run_id,
                                   "restore", [self.run_id])
        except Exception as exc:  # noqa: BLE001 - a failed restore is retried, not fatal
            self._next_try = time.monotonic() + self.retry_s
            log.error("restoring the inference servers failed (%s: %s); trying again in "
                      "%.0f s", exc.__class__.__name__, exc, self.retry_s)
            return None
        if "trainer/restored_policy_version" in metrics:
            log.warning("the inference servers serve the run's weights again as policy "
                        "version %s", metrics["trainer/restored_policy_version"])
        return metrics
