"""The ranks of verl's training engine, driven by one controller (the trainer worker).

``RankEngine`` is what each rank holds: verl's ``TrainingWorker`` for the actor (FSDP2 engine
from verl's engine registry) and, with a KL loss, a forward-only one for the reference. Each
method is SPMD: every rank calls it with its own slice of the rows, and collectives inside
verl (gradient reduction, token counts, weight gathering) line up.

Two groups run them:
- ``LocalRanks``: one rank in the controller's own process (the default; the demo).
- ``SpawnedRanks``: N processes on this host over torch.distributed (gloo on CPU), for tests
  and CPU hosts. A command is sent to every rank and the answers come back in rank order.
  On GPU hosts verl's Ray worker group is the way to spread ranks over machines.

Invariant: a rank's answer is returned only after every rank finished the same command, so
the controller never sees a half-applied update.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import traceback
from collections.abc import Sequence
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import torch

from workers.trainer.engine_config import EngineSpec

if TYPE_CHECKING:
    import datetime

    from tensordict import TensorDict

    from workers.trainer.verl_batch import VerlBatch

log = logging.getLogger(__name__)

# A call's positional arguments, one tuple per rank.
PerRank = Sequence[tuple[object, ...]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world: int, port: int | None, device: str,
                       timeout_s: float = 1800.0) -> None:
    """torch.distributed before verl touches it: verl skips its own init when a group
    exists (on CPU it would build the backend string "cpu:gloo,cpu:gloo", which torch
    rejects). ``port`` None: the rendezvous is already in the environment (Ray workers).
    ``timeout_s``: ``EngineSpec.collective_timeout_s``."""
    import datetime

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("LOCAL_RANK", "0" if port is None else str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port is not None:
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_PORT=str(port))
    if device == "cpu":
        from workers.trainer import verl_cpu

        verl_cpu.activate()
    if not dist.is_initialized():
        if device != "cpu":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # verl's own convention: gloo for CPU-side collectives, NCCL for the accelerator
        backend = "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = None if port is None else _loopback_store(rank, world, port, timeout)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                store=store)


def _loopback_store(rank: int, world: int, port: int, timeout: datetime.timedelta
                    ) -> torch.distributed.TCPStore:
    """The rendezvous of ranks all on this host. torch's TCPStore server takes no bind
    address: it listens on every one, and answers whoever connects without a credential.
    Rank 0 makes its socket on loopback and hands it over, so no other host reaches it."""
    import torch.distributed as dist

    fd = None
    if rank == 0:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        fd = sock.detach()
    return dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout,
                         master_listen_fd=fd, use_libuv=True)


class TokenBound(TypedDict):
    """A rank's bound on a micro-batch's tokens, with how it was derived: given
    (``ppo_max_token_len_per_gpu``), from a budget (``micro_batch_memory_gb``), or from the
    memory available less what the step adds (auto)."""

    bytes_per_token: int
    available_bytes: NotRequired[int]
    reserve_bytes: NotRequired[int]
    budget_bytes: NotRequired[int]
    max_token_len: int


def _plain(value: Any) -> Any:
    """A verl metric (a ``Metric``, a per-data-parallel-rank list of them, or numbers) as a
    float, aggregated the way verl's ``train_mini_batch`` does."""
    from verl.utils.metric import Metric

    if isinstance(value, list) and value and isinstance(value[0], Metric):
        return float(Metric.aggregate_dp(value))
    if isinstance(value, Metric):
        return float(value.aggregate())
    if isinstance(value, list):  # per rank, possibly per micro-batch: flattened
        flat: list[float] = []
        for v in value:
            flat.extend(_plain(v) if isinstance(v, list) else [float(_plain(v))])
        return flat
    return value


class RankEngine:
    """One rank's actor (and reference) engine. ``spec`` is plain data (picklable)."""

    def __init__(self, spec: EngineSpec) -> None:
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import ppo_loss

        from workers.trainer import engine_config

        self.spec = spec
        if spec.device == "cpu" and spec.cpu_threads:
            torch.set_num_threads(int(spec.cpu_threads))
        torch.manual_seed(int(spec.seed))
        self.actor_cfg = engine_config.actor_config(spec)
        self.actor = TrainingWorker(config=engine_config.worker_config(spec, forward_only=False))
        self.actor.reset()
        self.actor.set_loss_fn(partial(ppo_loss, config=self.actor_cfg))
        self.ref = None
        # with LoRA the reference is the actor with its adapter disabled (as verl does):
        # no second copy of the base
        if spec.use_kl_loss and not spec.lora_rank:
            # verl's forward-only engine parks the reference in pinned host memory, which a
            # CPU-only torch cannot pin: there the reference is a full engine that is only ever
            # run forward (its optimizer state is never created).
            forward_only = spec.device != "cpu"
            self.ref = TrainingWorker(config=engine_config.worker_config(
                spec, forward_only=forward_only))
            self.ref.reset()
        self.rank = int(os.environ.get("RANK", "0"))
        # read once both engines hold their weights: what is left is the step's to use
        self.tokens = self._token_bound()

    def _token_bound(self) -> TokenBound:
        """This rank's bound on a micro-batch's tokens (``ppo_max_token_len_per_gpu``, or
        what ``micro_batch_memory_gb`` and the model's per-token cost give), with how it was
        derived."""
        import torch.distributed as dist
        from transformers import AutoConfig

        from workers.trainer import token_budget as tb

        spec = self.spec
        per_token = tb.bytes_per_token(
            tb.model_shape(AutoConfig.from_pretrained(spec.model_path)),
            2 if spec.compute_dtype in ("bfloat16", "float16") else 4,
            spec.gradient_checkpointing)
        if spec.max_token_len_per_gpu is not None:
            return {"bytes_per_token": per_token, "max_token_len": spec.max_token_len_per_gpu}
        if spec.micro_batch_memory_gb is not None:
            budget = int(spec.micro_batch_memory_gb * tb.GB)
            return {"bytes_per_token": per_token, "budget_bytes": budget,
                    "max_token_len": tb.max_token_len(budget, per_token)}
        available = tb.available_bytes(spec.device)
        reserve = tb.step_reserve(self.fsdp_units(), self.trainable_count(),
                                  dist.get_world_size() if dist.is_initialized() else 1)
        budget = tb.auto_budget(available, reserve, tb.sharing_ranks(spec.device))
        return {"bytes_per_token": per_token, "available_bytes": available,
                "reserve_bytes": reserve, "budget_bytes": budget,
                "max_token_len": tb.max_token_len(budget, per_token)}

    def token_bound(self) -> TokenBound:
        return self.tokens

    def _meta(self, td: TensorDict, rows: int, micro: int | None, max_tokens: int | None,
              **extra: bool | int) -> None:
        from verl.utils import tensordict_utils as tu

        spec = self.spec
        # the controller sends every rank the same bound, at least the longest row (verl's
        # token cut refuses a row longer than it)
        tu.assign_non_tensor(
            td, use_dynamic_bsz=bool(spec.use_dynamic_bsz),
            max_token_len_per_gpu=int(max_tokens or self.tokens["max_token_len"]),
            micro_batch_size_per_gpu=int(micro or rows), pad_token_id=int(spec.pad_id),
            global_token_num=None, **extra)

    def log_probs(self, vb: VerlBatch, ref: bool = False, micro: int | None = None,
                  max_tokens: int | None = None) -> torch.Tensor:
        """[rows, R] log-probs of the response tokens (0 where nothing is scored), in
        micro-batches of ``micro`` rows (None = all at once), or with ``use_dynamic_bsz``
        of up to ``max_tokens`` tokens (verl's token-count cut)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = vb.tensordict()
        self._meta(td, len(vb), micro, max_tokens, calculate_entropy=False,
                   compute_loss=False)
        worker = self.ref if ref and self.ref is not None else self.actor
        if ref and worker is self.actor:
            assert self.spec.lora_rank, "a reference log-prob needs actor.use_kl_loss"
            tu.assign_non_tensor(td, no_lora_adapter=True)
        out = worker.infer_batch(td)
        lp = no_padding_2_padding(tu.get(out, "log_probs"), td).float()
        return lp * (vb.response_attention > 0)

    def train(self, vb: VerlBatch, fields: dict[str, torch.Tensor], lr: float,
              global_batch_size: int, micro: int | None = None,
              max_tokens: int | None = None) -> dict[str, object]:
        """One optimizer step on this rank's rows (micro-batches of ``micro`` rows, or of up
        to ``max_tokens`` tokens, accumulate)."""
        from verl.utils import tensordict_utils as tu

        for group in self.actor.engine.optimizer.param_groups:
            group["lr"] = lr
        td = vb.tensordict(**fields)
        self._meta(td, len(vb), micro, max_tokens,
                   calculate_entropy=float(self.spec.entropy_coeff) > 0,
                   compute_loss=True, global_batch_size=int(global_batch_size))
        out = self.actor.train_batch(td)
        if out is None:
            return {}
        return {k: _plain(v) for k, v in tu.get(out, "metrics").items()}

    def export(self, path: str | None, dtype: str) -> dict[str, torch.Tensor] | None:
        """Gather every full tensor (a collective: all ranks iterate); rank 0 keeps them, in
        ``dtype``, and writes ``path/model.safetensors`` when ``path`` is given."""
        from safetensors.torch import save_file

        target = getattr(torch, dtype)
        params, _ = self.actor.engine.get_per_tensor_param()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in params:
            if self.rank == 0:
                # clone: on one rank the gathered tensor can be the live parameter itself
                state[name] = tensor.detach().to("cpu", target).contiguous().clone()
        if self.rank != 0:
            return None
        if path is not None:
            Path(path).mkdir(parents=True, exist_ok=True)
            save_file(state, str(Path(path) / "model.safetensors"))
            return None
        return state

    def transfer(self, urls: list[str], dtype: str, bucket_bytes: int,
                 timeout: float, api_key: str | None, engine: str = "shm"
                 ) -> dict[str, object] | None:
        """Send the weights to ``urls`` through vLLM's weight-transfer routes
        (``transfer.py``) with ``engine`` (``shm``: rank 0 sends while the others take part
        in each tensor's gather; ``ipc``: every rank hands its GPU's copy over).
        -> rank 0's ``TransferResult`` as a dict."""
        from dataclasses import asdict

        from workers.trainer.transfer import IpcSender, ShmSender, drain

        params, _ = self.actor.engine.get_per_tensor_param()
        target = getattr(torch, dtype)
        if engine == "ipc":
            ipc = IpcSender(urls, bucket_bytes, timeout, api_key, is_sender=self.rank == 0)
            result = ipc.send(params, target)
            return asdict(result) if self.rank == 0 else None
        if self.rank != 0:
            drain(params)
            return None
        return asdict(ShmSender(urls, bucket_bytes, timeout, api_key).send(params, target))

    def export_adapter(self, path: str, dtype: str) -> None:
        """The LoRA adapter only (verl's peft parameters, in peft's names), in ``dtype``, as
        ``adapter_model.safetensors`` + ``adapter_config.json``: what vLLM loads by name."""
        import json

        from safetensors.torch import save_file

        target = getattr(torch, dtype)
        params, peft_config = self.actor.engine.get_per_tensor_param(base_sync_done=True)
        state = {name: t.detach().to("cpu", target).contiguous().clone() for name, t in params}
        if self.rank != 0:
            return
        if peft_config is None:
            raise RuntimeError("export_adapter on an engine without a LoRA adapter")
        Path(path).mkdir(parents=True, exist_ok=True)
        save_file(state, str(Path(path) / "adapter_model.safetensors"))
        plain = {k: sorted(v) if isinstance(v, set) else v for k, v in peft_config.items()}
        (Path(path) / "adapter_config.json").write_text(json.dumps(plain, default=str))

    def save(self, path: str) -> None:
        try:
            self.actor.save_checkpoint(path)
        finally:  # a failed save (a full disk) leaves them too
            _drop_mkdir_locks(path, os.path.join(path, "huggingface"))

    def load(self, path: str) -> None:
        self.actor.load_checkpoint(path, del_local_after_load=False)

    def parameter_count(self) -> int:
        # a DTensor's numel is the full tensor's: the same on every rank
        return sum(p.numel() for p in self.actor.engine.module.parameters())

    def fsdp_units(self) -> list[int]:
        """The actor's parameters by FSDP unit (what one all-gather brings together), full
        size, the root's first: a parameter counts for the innermost unit holding it, and the
        root keeps those of no other unit (the final norm; a tied embedding)."""
        from torch.distributed.fsdp import FSDPModule

        module = self.actor.engine.module
        # modules() lists a unit before the units inside it
        units = [module] + [m for m in module.modules()
                            if isinstance(m, FSDPModule) and m is not module]
        owner = {id(p): i for i, unit in enumerate(units) for p in unit.parameters()}
        sizes = [0] * len(units)
        for p in module.parameters():  # a tied weight once
            sizes[owner[id(p)]] += p.numel()
        return sizes

    def trainable_count(self) -> int:
        """Parameters the optimizer updates (a LoRA adapter's only, with ``lora_rank``)."""
        return sum(p.numel() for p in self.actor.engine.module.parameters() if p.requires_grad)

    def memory(self) -> dict[str, float]:
        """This rank's accelerator memory in GB: what torch allocated and what its caching
        allocator reserves (on CPU: the bytes of the parameters, gradients and optimizer
        state the engine holds, for both)."""
        if self.spec.device != "cpu" and torch.cuda.is_available():
            return {"allocated_gb": torch.cuda.memory_allocated() / 1e9,
                    "reserved_gb": torch.cuda.memory_reserved() / 1e9}
        engine = self.actor.engine
        tensors = [p for p in engine.module.parameters()]
        tensors += [p.grad for p in tensors if p.grad is not None]
        if engine.optimizer is not None:
            tensors += [v for state in engine.optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor)]
        held = sum(_local(t).numel() * t.element_size() for t in tensors) / 1e9
        return {"allocated_gb": held, "reserved_gb": held}

    def release_memory(self, offload: bool) -> dict[str, float]:
        """Give accelerator memory back before an engine wakes beside this rank: with
        ``offload``, the parameters and optimizer state that ``fsdp_config`` parks in host
        memory go there now (verl's train mode loads them again for the next update); then
        the caching allocator's blocks go back to the driver. -> :meth:`memory` after."""
        import gc

        engine = self.actor.engine
        if offload and (engine.is_param_offload_enabled or engine.is_optimizer_offload_enabled):
            engine.to("cpu", model=engine.is_param_offload_enabled,
                      optimizer=engine.is_optimizer_offload_enabled, grad=False)
        gc.collect()
        if self.spec.device != "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return self.memory()

    def master_dtype(self) -> str:
        p = next(self.actor.engine.module.parameters())
        return str(p.dtype).replace("torch.", "")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what it holds), or the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _drop_mkdir_locks(*paths: str) -> None:
    """Remove the lock files verl's checkpoint manager leaves in the temp directory: it makes
    each directory of a save under ``ckpt_<hash of the path>.lock`` (``verl.utils.fs.
    local_mkdir_safe``) and never removes it, so every checkpoint left two files per rank
    for good. Removed once this rank's save is over: every rank makes the directories
    before the save's first barrier, and the locked step is an idempotent makedirs, so a
    rank that shares the names (a fixed PYTHONHASHSEED) loses nothing. A verl that names
    them otherwise leaves its files, as before."""
    for path in paths:
        full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
        lock = os.path.join(tempfile.gettempdir(), f"ckpt_{hash(full) & 0xFFFFFFFF:08x}.lock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)


class LocalRanks:
    """One rank, in this process."""

    size = 1

    def __init__(self, spec: EngineSpec) -> None:
        init_process_group(0, 1, free_port(), spec.device, spec.collective_timeout_s)
        self.engine = RankEngine(spec)

    def call(self, method: str, per_rank: PerRank | None = None, **kwargs: object
             ) -> list[Any]:
        args = per_rank[0] if per_rank else ()
        return [getattr(self.engine, method)(*args, **kwargs)]

    def close(self) -> None:
        del self.engine
        _free_accelerator()


def _free_accelerator() -> None:
    """Drop what a closed engine left: the garbage holding its tensors, then the caching
    allocator's blocks (a next run in this process, or a woken inference engine, gets
    them)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _rank_main(rank: int, world: int, port: int, spec: EngineSpec, conn: Connection) -> None:
    try:
        init_process_group(rank, world, port, spec.device, spec.collective_timeout_s)
        engine = RankEngine(spec)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, args, kwargs = msg
        try:
            conn.send(("ok", getattr(engine, method)(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class RankError(RuntimeError):
    pass


class SpawnedRanks:
    """N ranks in child processes of this one (torch.distributed, gloo on CPU)."""

    def __init__(self, spec: EngineSpec, size: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.size = size
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, size, port, spec, child),
                               daemon=True, name=f"carryover-rank{rank}")
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._gather("start")

    def _gather(self, what: str) -> list[object]:
        out, errors = [], []
        for rank, conn in enumerate(self.conns):
            try:
                status, value = conn.recv()
            except EOFError:
                status, value = "error", f"process exited ({self.procs[rank].exitcode})"
            if status != "ok":
                errors.append(f"rank {rank}: {value}")
            out.append(value)
        if errors:
            raise RankError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return out

    def call(self, method: str, per_rank: PerRank | None = None, **kwargs: object
             ) -> list[Any]:
        for rank, conn in enumerate(self.conns):
            conn.send((method, per_rank[rank] if per_rank else (), kwargs))
        return self._gather(method)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


class RayRanks:
    """verl's Ray worker group: one rank per accelerator over ``nnodes x n_gpus_per_node``
    (on CPU, one rank per CPU slot: for tests). Attaches to the Ray cluster at
    ``trainer.ray_address``, or starts a local one when it is null."""

    def __init__(self, spec: EngineSpec, nnodes: int, per_node: int,
                 address: str | None) -> None:
        import ray
        from verl.single_controller.ray import (
            RayClassWithInitArgs,
            RayResourcePool,
            RayWorkerGroup,
        )

        if not ray.is_initialized():
            local = {} if address else {"num_cpus": max(os.cpu_count() or 1, nnodes * per_node)}
            ray.init(address=address, include_dashboard=False, **local)
        use_gpu = spec.device != "cpu"
        pool = RayResourcePool([per_node] * nnodes, use_gpu=use_gpu,
                               name_prefix="carryover_trainer", max_colocate_count=1)
        actor = RayClassWithInitArgs(cls=ray.remote(_ray_rank_class()), spec=spec)
        self.pool = pool
        # rank 0 (the export's writer) runs on this host only in a local Ray of one node
        self.on_this_host = nnodes == 1 and not address
        self.group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=actor,
                                    device_name=spec.device)
        self.size = nnodes * per_node

    def call(self, method: str, per_rank: PerRank | None = None, **kwargs: object
             ) -> list[Any]:
        n = self.size
        # verl splits an argument across the ranks only when it is a list
        return self.group.execute_all_sync("run", [method] * n,
                                           list(per_rank) if per_rank else [()] * n,
                                           [kwargs] * n)

    def close(self) -> None:
        """Kill the rank actors and give their placement group back: its bundles (every
        GPU of the update) would otherwise stay reserved, and the next run in this worker
        would wait for them forever."""
        import ray
        from ray.util import remove_placement_group

        for worker in self.group.workers:
            try:
                ray.kill(worker)
            except Exception as exc:  # noqa: BLE001 - an actor already dead is fine
                log.warning("could not kill a trainer rank actor: %s", exc)
        for pg in self.pool.pgs or []:
            remove_placement_group(pg)
        self.pool.pgs = None
        _free_accelerator()


def _ray_rank_class() -> type[object]:
    """A verl ``Worker`` holding one ``RankEngine`` (verl's worker group sets the rendezvous:
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from verl.single_controller.base import Worker

    class RankActor(Worker):
        def __init__(self, spec: EngineSpec) -> None:
            super().__init__()
            init_process_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None,
                               spec.device, spec.collective_timeout_s)
            self.engine = RankEngine(spec)

        def run(self, method: str, args: tuple[object, ...], kwargs: dict[str, object]
                ) -> object:
            return getattr(self.engine, method)(*args, **kwargs)

    return RankActor
