"""A stand-in of a vLLM server's CUDA IPC weight-transfer routes (``inference.transfer_engine:
ipc``, packed), for the sender's tests on CPU and the GPU check on a machine without vLLM:

    python -m bench.ipc_receiver PORT OUT_DIR UUID [UUID ...] [--fail-at N] [--open cuda]

Where vLLM is importable (the inference environment: the CPU tests), each body is parsed by
vLLM's own ``IPCWeightTransferInitInfo`` and ``IPCWeightTransferUpdateInfo`` (the handles
unpickled behind vLLM's ``VLLM_ALLOW_INSECURE_SERIALIZATION`` gate) and each bucket is
unpacked by vLLM's own ``unpack_tensor``; elsewhere the same fields are read plainly. Every
GPU named by ``UUID`` (``auto``: this process's GPU) must be in every bucket's handles, as
each of a server's workers looks up its own.

How a handle is opened: ``--open cuda`` as vLLM's engine does (the receiver's device index
put in the export's arguments, then torch's ``rebuild_cuda_tensor``); ``--open file`` (the
default, for CPU, where CUDA IPC does not exist) the test's sender shares a buffer as
``(file in /dev/shm, bytes)`` and the file is mapped instead.

``/finish_weight_update`` writes what each GPU received to ``OUT_DIR/<uuid>.safetensors``
and every call to ``OUT_DIR/calls.json``. ``--fail-at N`` answers the N-th
``/update_weights`` with 500, as a server whose load fails.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

try:
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCWeightTransferInitInfo,
        IPCWeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
    VLLM = True
except ImportError:  # the GPU check's machine: the same fields, read plainly
    VLLM = False

    @dataclass
    class IPCWeightTransferInitInfo:  # type: ignore[no-redef]
        packed: bool = False

    @dataclass
    class IPCWeightTransferUpdateInfo:  # type: ignore[no-redef]
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        ipc_handles_pickled: str | None = None
        tensor_sizes: list[int] | None = None

        def __post_init__(self) -> None:
            self.ipc_handles = pickle.loads(base64.b64decode(self.ipc_handles_pickled or ""))

    def unpack_tensor(packed: torch.Tensor, names: list[str], shapes: list[list[int]],
                      dtypes: list[torch.dtype], sizes: list[int]
                      ) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.view(d).view(s)) for n, s, d, t in
                zip(names, shapes, dtypes, packed.split(sizes), strict=True)]


def open_file(handle: Any) -> torch.Tensor:
    path, nbytes = handle
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def open_cuda(handle: Any) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle)
    args[6] = torch.cuda.current_device()  # the export's device index, as this process sees it
    return rebuild_cuda_tensor(*args)


class Receiver:
    def __init__(self, out: Path, gpus: list[str], fail_at: int, cuda: bool) -> None:
        self.out, self.gpus, self.fail_at = out, gpus, fail_at
        self.open_handle = open_cuda if cuda else open_file
        self.packed: bool | None = None
        self.open = False
        self.updates = 0
        self.received: dict[str, dict[str, torch.Tensor]] = {g: {} for g in gpus}
        self.calls: list[dict[str, object]] = []

    def handle(self, route: str, body: dict) -> tuple[int, str]:
        self.calls.append({"route": route, "open": self.open})
        if route == "/init_weight_transfer_engine":
            self.packed = IPCWeightTransferInitInfo(**body["init_info"]).packed
            self.calls[-1]["vllm_parser"] = VLLM
        elif route == "/start_weight_update":
            if self.open:
                return 400, "a weight update is already in progress"
            self.open = True
        elif route == "/update_weights":
            if not self.open:
                return 400, "no weight update in progress"
            self.updates += 1
            if self.updates == self.fail_at:
                self.open = False  # as vLLM's worker: a failed update ends the session
                return 500, "load failed (stand-in)"
            info = IPCWeightTransferUpdateInfo(**body["update_info"])
            if not self.packed or not isinstance(info.ipc_handles, dict):
                return 400, "expected a packed transfer"
            sizes = info.tensor_sizes or []
            self.calls[-1].update(nbytes=sum(sizes), names=info.names)
            for gpu in self.gpus:
                if gpu not in info.ipc_handles:
                    return 500, f"IPC handle not found for GPU UUID {gpu}"
                buffer = self.open_handle(info.ipc_handles[gpu])
                dtypes = [getattr(torch, d) for d in info.dtype_names]
                for name, tensor in unpack_tensor(buffer[:sum(sizes)], info.names,
                                                  info.shapes, dtypes, sizes):
                    self.received[gpu][name] = tensor.to("cpu", copy=True)
                del buffer  # this export released: the next bucket comes as a fresh one
        elif route == "/finish_weight_update":
            if not self.open:
                return 500, ("finish_weight_update called without a matching "
                             "start_weight_update.")
            self.open = False
            for gpu, tensors in self.received.items():
                if tensors:
                    save_file(tensors, str(self.out / f"{gpu}.safetensors"))
        else:
            return 404, route
        (self.out / "calls.json").write_text(json.dumps(self.calls))
        return 200, "{}"


def main() -> None:
    args = sys.argv[1:]
    opts = {"--fail-at": "0", "--open": "file"}
    for flag in opts:
        if flag in args:
            i = args.index(flag)
            opts[flag] = args[i + 1]
            del args[i:i + 2]
    cuda = opts["--open"] == "cuda"
    port, out = int(args[0]), Path(args[1])
    gpus = [str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            if g == "auto" else g for g in args[2:]]
    out.mkdir(parents=True, exist_ok=True)
    receiver = Receiver(out, gpus, int(opts["--fail-at"]), cuda)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # /health
            self._answer(200, "{}")

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                code, text = receiver.handle(self.path, json.loads(raw or b"null") or {})
            except Exception as exc:  # noqa: BLE001 - a bad body is the sender's fault
                code, text = 400, f"{exc.__class__.__name__}: {exc}"
            self._answer(code, text)

        def _answer(self, code: int, text: str) -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_: object) -> None:
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
