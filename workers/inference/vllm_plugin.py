"""vLLM general plugin: registers the project's CPU weight-transfer engine in vLLM's
registry (``WeightTransferEngineFactory``), so a server started with
``--weight-transfer-config '{"backend": "carryover_shm"}'`` takes weights through vLLM's own
RL routes (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) on a
machine where none of vLLM's engines (CUDA IPC, NCCL) runs. vLLM may load plugins several
times in several processes: registering is idempotent."""

from __future__ import annotations

from app.services.transfer_wire import SHM_BACKEND


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if SHM_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            SHM_BACKEND, "workers.inference.shm_transfer", "SharedMemoryTransferEngine")
