"""The server half of a weight transfer through shared memory: each ``/update_weights``
names a bucket file the trainer wrote into the transfer directory; the engine maps it (no
copy), views each tensor in it and loads them through the model's own ``load_weights``, in
vLLM's layerwise reload (started by ``/start_weight_update``, finalized by
``/finish_weight_update``), as vLLM's CUDA IPC engine does with GPU memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from app.services.transfer_wire import FOLDER_PREFIX, ShmBucket, ShmInit

SHM_ROOT = Path("/dev/shm").resolve()


@dataclass
class ShmInitInfo(ShmInit, WeightTransferInitInfo):
    pass


@dataclass
class ShmUpdateInfo(ShmBucket, WeightTransferUpdateInfo):
    def __post_init__(self) -> None:
        self.check()


class SharedMemoryTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.directory: Path | None = None

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        directory = Path(init_info.directory)
        # only a transfer folder in shared memory, as the trainer makes them: the routes are
        # dev routes (docs/operations.md, Security), and this one reads files
        real = directory.resolve()
        if real.parent != SHM_ROOT or not real.name.startswith(FOLDER_PREFIX):
            raise ValueError(f"weight transfer directory {directory} is not a "
                             f"{SHM_ROOT}/{FOLDER_PREFIX}* folder")
        if not real.is_dir():
            raise ValueError(f"weight transfer directory {directory} does not exist on the "
                             "server's host (the trainer must share this host's memory)")
        self.directory = real

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, object]) -> None:
        # the base class synchronizes the accelerator, which a CPU server does not have
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        if self.directory is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine")
        path = self.directory / update_info.file
        if path.is_symlink():
            raise ValueError(f"bucket {path} is a symbolic link")
        size = path.stat().st_size
        if size != update_info.nbytes:
            raise ValueError(f"bucket {path} holds {size} bytes, not the {update_info.nbytes} "
                             "announced (written by another transfer?)")
        # MAP_PRIVATE: the views read the trainer's pages
        raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        tensors = []
        for name, dtype_name, shape, offset in zip(
                update_info.names, update_info.dtype_names, update_info.shapes,
                update_info.offsets, strict=True):
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"bucket {path}: {dtype_name!r} is not a torch dtype")
            count = 1
            for d in shape:
                count *= d
            if offset < 0 or count < 0 or offset + count * dtype.itemsize > size:
                raise ValueError(f"bucket {path}: {name} at {offset} runs past its end")
            view = raw[offset:offset + count * dtype.itemsize].view(dtype).view(shape)
            # vLLM's layer-wise reload keeps the tensors of a layer not yet complete: a view
            # (what .to() is on a CPU server) would keep this bucket's pages in /dev/shm,
            # unlinked, until then, beside the buckets after it
            tensors.append((name, view.clone() if self.device.type == "cpu"
                            else view.to(self.device)))
        self.model.load_weights(tensors)

    def shutdown(self) -> None:
        self.directory = None
