"""The trainer half of ``inference.weight_sync: transfer``: the weights go to every server
through vLLM's weight-transfer routes, in buckets, with no export written.

Rank 0 fills one bucket file at a time in a folder in shared memory from the engine's
per-tensor gather (in the server's dtype), asks each server to load it
(``/update_weights``, the server's engine maps the file: ``workers/inference``) and deletes
it: host memory holds one bucket and the tensors being copied into it, whatever the model's
size. Around the buckets: ``/init_weight_transfer_engine`` (the folder; cheap, so sent at
every sync, and a restarted server needs it again), ``/start_weight_update`` and
``/finish_weight_update`` with the policy version, which the server then reports at
``/weight_info``.

A server that fails part-way is left out of the rest of that sync (the others go on) and
reported with why; the caller marks it stale, so it serves nobody on half-loaded weights.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch

from app.services.transfer_wire import FOLDER_PREFIX, ShmBucket, aligned

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")


@dataclass
class TransferResult:
    """One sync: the servers that finished it, why the others did not (``unreachable``:
    refused the first connection, so nothing of this sync reached them), and what moved."""

    loaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    bytes_moved: int = 0      # bucket bytes written (each server reads them once)
    buckets: int = 0
    largest_bucket: int = 0   # bytes: what the transfer held in shared memory at most
    seconds: float = 0.0


class ShmSender:
    """Sends one sync to ``urls`` through buckets of at most ``bucket_bytes`` (a larger
    tensor gets a bucket of its own) under ``root``."""

    def __init__(self, urls: list[str], bucket_bytes: int, timeout: float,
                 api_key: str | None = None, root: Path = SHM) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.http = requests.Session()
        if api_key:
            self.http.headers["Authorization"] = f"Bearer {api_key}"
        self.directory = root / f"{FOLDER_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.result = TransferResult()
        self._live: list[str] = []
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0

    # -- the sync, in order -------------------------------------------------------------

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
            self._start()
            for name, tensor in tensors:
                if self._live:
                    self._add(name, tensor.detach().to("cpu", dtype))
            self._flush()
            self._finish()
        except Exception as exc:  # noqa: BLE001 - re-raised once the gather is drained
            error = exc
            self.drain(tensors)
            for url in list(self._live):
                self._drop(url, f"{exc.__class__.__name__} on the trainer: {exc}")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.http.close()
        if error is not None:
            raise error
        self.result.loaded = list(self._live)
        self.result.seconds = time.monotonic() - t
        return self.result

    def drain(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """What a rank that does not send does: take part in every gather."""
        for _ in tensors:
            pass

    def _start(self) -> None:
        for url in self.urls:
            try:
                self._post(url, "/init_weight_transfer_engine",
                           {"init_info": {"directory": str(self.directory)}})
                try:
                    self._post(url, "/start_weight_update", None)
                except _Refused:
                    # a session an earlier sync left open (it timed out on this side and
                    # the server finished later): closed, then started again
                    self._close(url)
                    self._post(url, "/start_weight_update", None)
            except requests.ConnectionError as exc:
                self.result.unreachable[url] = f"{exc.__class__.__name__}: {exc}"
                continue
            except (requests.RequestException, _Refused) as exc:
                self.result.failed[url] = str(exc)
                continue
            self._live.append(url)

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
        body: dict[str, object] = {"update_info": bucket.as_json()}
        for url in list(self._live):
            try:
                self._post(url, "/update_weights", body)
            except (requests.RequestException, _Refused) as exc:
                self._drop(url, f"/update_weights of {bucket.file}: {exc}")
        path.unlink()
        self.result.buckets += 1
        self.result.bytes_moved += offset
        self.result.largest_bucket = max(self.result.largest_bucket, offset)

    def _finish(self) -> None:
        for url in list(self._live):
            try:
                self._post(url, "/finish_weight_update", {})
            except (requests.RequestException, _Refused) as exc:
                self._drop(url, f"/finish_weight_update: {exc}")

    # -- helpers --------------------------------------------------------------------------

    def _drop(self, url: str, why: str) -> None:
        """Out of this sync: marked failed (the caller makes it stale) and its session
        closed, so the next sync or the keeper can start one (an open one refuses)."""
        self._live.remove(url)
        self.result.failed[url] = why
        log.error("weight transfer to %s failed: %s", url, why)
        self._close(url)

    def _close(self, url: str) -> None:
        try:
            self._post(url, "/finish_weight_update", {})
        except (requests.RequestException, _Refused) as exc:
            log.warning("could not close the weight-update session of %s: %s", url, exc)

    def _post(self, url: str, route: str, body: dict[str, object] | None) -> None:
        try:
            resp = self.http.post(url + route, json=body, timeout=self.timeout)
        except requests.Timeout as exc:
            raise _Refused(f"{route} did not answer within {self.timeout:.0f} s "
                           "(trainer.reload_timeout_s)") from exc
        if resp.status_code != 200:
            raise _Refused(f"{route} answered {resp.status_code}: {resp.text[:300]}")


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
