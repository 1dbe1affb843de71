"""The trainer half of ``inference.weight_sync: transfer``: the weights go to every server
through vLLM's weight-transfer routes, in buckets, with no export written.

Around the buckets, for either engine: ``/init_weight_transfer_engine`` (cheap, so sent at
every sync: a restarted server needs it again), ``/start_weight_update``, one
``/update_weights`` per bucket and ``/finish_weight_update``; the caller then sets the
policy version, which the server reports at ``/weight_info``. The engines
(``inference.transfer_engine``):

- ``shm`` (``ShmSender``): rank 0 fills one bucket file at a time in a folder in shared
  memory from the engine's per-tensor gather (in the server's dtype), asks each server to
  load it (the server's engine, ``workers/inference``, maps the file) and deletes it: host
  memory holds one bucket and the tensors being copied into it, whatever the model's size.
- ``ipc`` (``IpcSender``), for servers on the trainer's own GPUs: vLLM's CUDA IPC engine in
  its packed form. Every rank copies each bucket into one buffer on its GPU and exports it
  as a CUDA IPC handle; rank 0 gathers the handles (one per GPU) and sends them, and each of
  a server's workers maps the buffer on its own GPU and copies its tensors out. Nothing goes
  through the host.

A server that fails part-way is left out of the rest of that sync (the others go on) and
reported with why; the caller marks it stale, so it serves nobody on half-loaded weights.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import requests
import torch

from app.services.transfer_wire import FOLDER_PREFIX, ShmBucket, aligned
from workers.trainer.server_http import server_session

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
# vLLM's refusal of a finish with no session open (a failed bucket ended it)
NO_SESSION = "finish_weight_update called without a matching start_weight_update"
CLOSE_TIMEOUT_S = 60.0  # the longest wait to close a dropped server's session
T = TypeVar("T")


@dataclass
class TransferResult:
    """One sync: the servers that finished it, why the others did not (``unreachable``:
    refused the first connection, so nothing of this sync reached them), and what moved."""

    loaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    bytes_moved: int = 0      # bucket bytes written (each server reads them once)
    buckets: int = 0
    largest_bucket: int = 0   # bytes: the largest bucket the transfer held at once
    seconds: float = 0.0


class _Sessions:
    """The servers of one sync and their weight-update sessions: which are still in it,
    and dropping one that fails (marked failed, its session closed)."""

    def __init__(self, urls: list[str], timeout: float, api_key: str | None) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self.http = server_session(api_key)
        self.result = TransferResult()
        self.live: list[str] = []

    def start(self, init_info: dict[str, object]) -> None:
        for url in self.urls:
            try:
                self.post(url, "/init_weight_transfer_engine", {"init_info": init_info})
                try:
                    self.post(url, "/start_weight_update", None)
                except _Refused:
                    # a session an earlier sync left open (it timed out on this side and
                    # the server finished later): closed, then started again
                    self.close(url)
                    self.post(url, "/start_weight_update", None)
            except requests.ConnectionError as exc:
                self.result.unreachable[url] = f"{exc.__class__.__name__}: {exc}"
                continue
            except (requests.RequestException, _Refused) as exc:
                self.result.failed[url] = str(exc)
                continue
            self.live.append(url)

    def update(self, update_info: dict[str, object], what: str, nbytes: int) -> None:
        """One bucket to every server still in the sync."""
        for url in list(self.live):
            try:
                self.post(url, "/update_weights", {"update_info": update_info})
            except (requests.RequestException, _Refused) as exc:
                self.drop(url, f"/update_weights of {what}: {exc}")
        self.result.buckets += 1
        self.result.bytes_moved += nbytes
        self.result.largest_bucket = max(self.result.largest_bucket, nbytes)

    def finish(self) -> None:
        for url in list(self.live):
            try:
                self.post(url, "/finish_weight_update", {})
            except (requests.RequestException, _Refused) as exc:
                self.drop(url, f"/finish_weight_update: {exc}")

    def fail_all(self, why: str) -> None:
        for url in list(self.live):
            self.drop(url, why)

    def done(self, started: float) -> TransferResult:
        self.http.close()
        self.result.loaded = list(self.live)
        self.result.seconds = time.monotonic() - started
        return self.result

    def drop(self, url: str, why: str) -> None:
        """Out of this sync: marked failed (the caller makes it stale) and its session
        closed, so the next sync or the keeper can start one (an open one refuses)."""
        self.live.remove(url)
        self.result.failed[url] = why
        log.error("weight transfer to %s failed: %s", url, why)
        self.close(url)

    def close(self, url: str) -> None:
        # a server already out of the sync: not worth the load's whole timeout (the other
        # ranks wait in a collective meanwhile, engine_config.collective_timeout_s)
        timeout = min(self.timeout, CLOSE_TIMEOUT_S)
        try:
            self.post(url, "/finish_weight_update", {}, timeout)
        except _Refused as exc:
            if NO_SESSION not in str(exc):
                log.warning("could not close the weight-update session of %s: %s", url, exc)
                return
            # vLLM ends the weight update itself when a bucket fails in it, and leaves the
            # layers that bucket had begun part-loaded: the next update would not re-arm
            # them and fail on them. An empty update finalizes them (on weights the server
            # does not serve: it is stale until a whole sync reaches it).
            try:
                self.post(url, "/start_weight_update", None, timeout)
                self.post(url, "/finish_weight_update", {}, timeout)
            except (requests.RequestException, _Refused) as again:
                log.warning("could not clear the failed weight update of %s: %s", url, again)
        except requests.RequestException as exc:
            log.warning("could not close the weight-update session of %s: %s", url, exc)

    def post(self, url: str, route: str, body: dict[str, object] | None,
             timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        try:
            resp = self.http.post(url + route, json=body, timeout=timeout)
        except requests.Timeout as exc:
            raise _Refused(f"{route} did not answer within {timeout:.0f} s"
                           + (" (trainer.reload_timeout_s)" if timeout == self.timeout
                              else "")) from exc
        if resp.status_code != 200:
            raise _Refused(f"{route} answered {resp.status_code}: {resp.text[:300]}")


def drain(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """What a rank that sends nothing does: take part in every gather."""
    for _ in tensors:
        pass


class ShmSender:
    """Sends one sync to ``urls`` through buckets of at most ``bucket_bytes`` (a larger
    tensor gets a bucket of its own) under ``root``. Rank 0 only: the other ranks
    ``drain`` the gather."""

    def __init__(self, urls: list[str], bucket_bytes: int, timeout: float,
                 api_key: str | None = None, root: Path = SHM) -> None:
        self.sessions = _Sessions(urls, timeout, api_key)
        self.bucket_bytes = bucket_bytes
        self.directory = root / f"{FOLDER_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0

    @property
    def result(self) -> TransferResult:
        return self.sessions.result

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
             ) -> TransferResult:
        """The sync. The version is not named here: the caller sets it after the prefix
        cache is reset (as after a reload), so a server never reports a version it does not
        fully serve. An error on this rank is raised only after the gather is drained (the
        other ranks wait in its collectives), and every server still in the sync gets its
        session closed."""
        t = time.monotonic()
        error: BaseException | None = None
        tensors = iter(tensors)
        try:
            _prune_dead(self.directory.parent)
            self.directory.mkdir(parents=True)
            self.sessions.start({"directory": str(self.directory)})
            for name, tensor in tensors:
                if self.sessions.live:
                    self._add(name, tensor.detach().to("cpu", dtype))
            self._flush()
            self.sessions.finish()
        except Exception as exc:  # noqa: BLE001 - re-raised once the gather is drained
            error = exc
            drain(tensors)
            self.sessions.fail_all(f"{exc.__class__.__name__} on the trainer: {exc}")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        result = self.sessions.done(t)
        if error is not None:
            raise error
        return result

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and aligned(self._pending_bytes) + size > self.bucket_bytes:
            self._flush()
        self._pending_bytes = aligned(self._pending_bytes) + size
        self._pending.append((name, tensor))

    def _flush(self) -> None:
        if not self._pending:
            return
        bucket = ShmBucket(file=f"bucket-{self.result.buckets:05d}")
        offset = 0
        for name, tensor in self._pending:
            offset = aligned(offset)
            bucket.names.append(name)
            bucket.dtype_names.append(str(tensor.dtype).removeprefix("torch."))
            bucket.shapes.append(list(tensor.shape))
            bucket.offsets.append(offset)
            offset += tensor.numel() * tensor.element_size()
        bucket.nbytes = offset
        path = self.directory / bucket.file
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # the pages reserved now: a full /dev/shm is an OSError (ENOSPC) here, not a
            # SIGBUS when the copy below touches a page that is not there
            os.posix_fallocate(fd, 0, max(offset, 1))
        except OSError as exc:
            raise OSError(exc.errno, f"{self.directory.parent} cannot hold a bucket of "
                          f"{offset / 2**20:.0f} MiB ({exc.strerror}): lower "
                          "inference.transfer_bucket_mb or enlarge it") from exc
        finally:
            os.close(fd)
        raw = torch.from_file(str(path), shared=True, size=offset, dtype=torch.uint8)
        for (_, tensor), at in zip(self._pending, bucket.offsets, strict=True):
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            raw[at:at + flat.numel()].copy_(flat)
        del raw
        self._pending, self._pending_bytes = [], 0
        self.sessions.update(bucket.as_json(), bucket.file, offset)
        path.unlink()


# -- CUDA IPC ------------------------------------------------------------------------------

# a buffer's CUDA IPC export by GPU UUID: the arguments torch's rebuild function takes
Share = Callable[[torch.Tensor], dict[str, tuple[object, ...]]]


def cuda_ipc_handle(buffer: torch.Tensor) -> dict[str, tuple[object, ...]]:
    """``buffer``'s CUDA IPC export under its GPU's UUID, as vLLM's IPC engine looks it up
    (a worker finds the copy on its own GPU). A fresh export each time: torch pairs one
    export with one rebuild and release on the other side, which vLLM's importer does once
    per distinct handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(buffer.device).synchronize()  # the copies in it are done
    _, args = reduce_tensor(buffer)
    return {str(torch.cuda.get_device_properties(buffer.device).uuid): args}


def _cuda_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())


@dataclass
class _Packed:
    """The tensors of one bucket, back to back (vLLM's packed layout: no padding)."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    tensor_sizes: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.tensor_sizes)


class IpcSender:
    """One sync through vLLM's ``ipc`` engine, packed, with every rank taking part.

    Each rank copies a bucket's tensors into a buffer on its GPU; at each bucket's end the
    ranks gather their handles (and any error) to rank 0, which sends them to every
    server, and then tells every rank whether any server is left (which also keeps each
    buffer until the servers have read it). Once none is, no rank makes another export.
    Every export must be opened by exactly one server worker (each trainer GPU hosts one):
    torch frees an exported buffer only once its reader releases it. The bucket
    boundaries follow from the tensors' sizes alone, so every rank reaches the same
    collectives whatever fails, and an error on any rank fails every server of the sync
    (that GPU's copy is not there) and is raised on its rank once the gather is done.

    ``allocate`` and ``share`` make the buffer and its handle (CUDA by default)."""

    def __init__(self, urls: list[str], bucket_bytes: int, timeout: float,
                 api_key: str | None, is_sender: bool,
                 allocate: Callable[[int], torch.Tensor] = _cuda_buffer,
                 share: Share = cuda_ipc_handle) -> None:
        self.sessions = _Sessions(urls, timeout, api_key)
        self.bucket_bytes = bucket_bytes
        self.is_sender = is_sender
        self.allocate = allocate
        self.share = share
        self._buffer: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._sending = True

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
             ) -> TransferResult:
        t = time.monotonic()
        if self.is_sender:
            self.sessions.start({"packed": True})
        # no server to read an export: none is made (torch frees an exported buffer only
        # once its reader releases it, so an export nobody opens is GPU memory lost)
        self._sending = self._rank0_sends()
        if self._sending:
            self._buffer = self._guard(partial(self.allocate, self.bucket_bytes))
        packed = _Packed()
        for name, tensor in tensors:
            if not self._sending:
                continue  # the gather goes on: every rank takes part in it
            size = tensor.numel() * dtype.itemsize
            if packed.names and packed.nbytes + size > self.bucket_bytes:
                self._flush(packed, self._buffer)
                packed = _Packed()
            if size > self.bucket_bytes:
                # a tensor larger than the bucket goes alone, in a buffer of its own
                one_off = self._guard(partial(self.allocate, size))
                alone = _Packed()
                self._pack(alone, name, tensor, dtype, one_off)
                self._flush(alone, one_off)
                del one_off
                continue
            self._pack(packed, name, tensor, dtype, self._buffer)
        if packed.names and self._sending:
            self._flush(packed, self._buffer)
        if self.is_sender:
            self.sessions.finish()
        _barrier()  # every server is done with every buffer
        self._buffer = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        result = self.sessions.done(t)
        if self._error is not None:
            raise self._error
        return result

    def _rank0_sends(self) -> bool:
        """Whether rank 0 still has a server in the sync, as every rank learns it (a
        collective: it also keeps each rank's buffer until the servers have read it)."""
        return bool(_gather(bool(self.sessions.live) if self.is_sender else None)[0])

    def _pack(self, packed: _Packed, name: str, tensor: torch.Tensor, dtype: torch.dtype,
              buffer: torch.Tensor | None) -> None:
        """``tensor`` appended to ``packed`` and, where this rank has a buffer, copied into
        it at the bucket's end."""
        at, size = packed.nbytes, tensor.numel() * dtype.itemsize
        packed.names.append(name)
        packed.dtype_names.append(str(dtype).removeprefix("torch."))
        packed.shapes.append(list(tensor.shape))
        packed.tensor_sizes.append(size)
        if buffer is not None:
            self._guard(lambda: buffer[at:at + size].copy_(
                tensor.detach().to(buffer.device, dtype).contiguous().view(-1)
                .view(torch.uint8)))

    def _flush(self, packed: _Packed, buffer: torch.Tensor | None) -> None:
        """One bucket: the handles gathered (a collective), sent by rank 0, then a barrier
        so no rank reuses its buffer while a server reads it."""
        handle = self._guard(partial(self.share, buffer)) if buffer is not None else None
        mine = (handle or {}, None if self._error is None else
                f"{self._error.__class__.__name__}: {self._error}")
        gathered = _gather(mine)
        if self.is_sender:
            errors = [f"rank {r}: {why}" for r, (_, why) in enumerate(gathered) if why]
            if errors:
                self.sessions.fail_all(f"the transfer failed on the trainer: {errors[0]}")
            elif self.sessions.live:
                merged: dict[str, tuple[object, ...]] = {}
                for part, _ in gathered:
                    merged.update(part)
                info: dict[str, object] = {"names": packed.names, "dtype_names": packed.dtype_names,
                        "shapes": packed.shapes, "tensor_sizes": packed.tensor_sizes,
                        # the HTTP route takes the handles pickled (the server must run
                        # with VLLM_ALLOW_INSECURE_SERIALIZATION: docs/operations.md)
                        "ipc_handles_pickled":
                            base64.b64encode(pickle.dumps(merged)).decode("ascii")}
                self.sessions.update(info, f"bucket {self.sessions.result.buckets}",
                                     packed.nbytes)
        self._sending = self._rank0_sends()

    def _guard(self, step: Callable[[], T]) -> T | None:
        """Run a step of this rank's part; an error is kept (and the rank goes on through
        the collectives with nothing to give) until the end of the sync."""
        if self._error is not None:
            return None
        try:
            return step()
        except Exception as exc:  # noqa: BLE001 - raised at the end of the sync
            log.error("weight transfer on this rank failed: %s", exc)
            self._error = exc
            return None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def _gather(item: T) -> list[T]:
    if not _distributed():
        return [item]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, item)
    return out


def _barrier() -> None:
    if _distributed():
        torch.distributed.barrier()


def _prune_dead(root: Path) -> None:
    """Folders of transfers whose process died (SIGKILL, OOM) mid-sync: host memory."""
    for folder in root.glob(f"{FOLDER_PREFIX}*"):
        try:
            pid = int(folder.name.split("-")[2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


class _Refused(RuntimeError):
    """A server answered a transfer route with an error, or not in time."""
