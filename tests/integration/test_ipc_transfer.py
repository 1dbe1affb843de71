"""The ``ipc`` weight-transfer sender (vLLM's CUDA IPC engine, packed) on CPU: two trainer
ranks in a gloo group each copy every bucket into their own buffer and share it; rank 0
gathers the handles and sends them, and a stand-in of the server's routes
(``bench/ipc_receiver.py``, in the inference environment) parses each body with vLLM's own
dataclasses and unpacks each bucket with vLLM's own ``unpack_tensor``. The one thing not
run here is CUDA's export and open of the buffer: the test's buffers are files in
/dev/shm, shared by name. The GPU check runs the real handles (``bench.gpu_trainer
--ipc``)."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from bench.stack import free_port
from tests.conftest import REPO, wait_http

BUCKET = 1536  # bytes: the tensors below (bf16) fill 4 buckets, and "big" (3200) goes alone


def tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"embed": (16, 24), "layer0.w": (24, 24), "layer0.norm": (24,),
              "big": (40, 40), "layer1.w": (24, 24), "layer1.b": (7,), "head": (16, 24)}
    return [(n, torch.randn(s, generator=gen)) for n, s in shapes.items()]


def rank_main(rank: int, world: int, init: str, urls: list[str], shm: str, result: str,
              fail_share_at: int) -> None:
    """One trainer rank: its buffers are files in /dev/shm, its handle names the file."""
    from workers.trainer.transfer import IpcSender

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank,
                                         world_size=world)
    made: dict[int, Path] = {}  # the file behind each buffer, by its storage
    shares = [0]

    def allocate(nbytes: int) -> torch.Tensor:
        path = Path(f"{shm}-r{rank}-{len(made)}")
        buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        made[buffer.untyped_storage().data_ptr()] = path
        return buffer

    def share(buffer: torch.Tensor) -> dict[str, Any]:
        shares[0] += 1
        if shares[0] == fail_share_at:
            raise RuntimeError(f"share failed on rank {rank}")
        path = made[buffer.untyped_storage().data_ptr()]
        return {f"gpu-{rank}": (str(path), buffer.numel())}

    out: dict[str, Any] = {"rank": rank}
    try:
        sender = IpcSender(urls, BUCKET, 30, None, is_sender=rank == 0,
                           allocate=allocate, share=share)
        res = sender.send(iter(tensors()), torch.bfloat16)
        out["result"] = res.__dict__
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{exc.__class__.__name__}: {exc}"
        out["trace"] = traceback.format_exc()
    finally:
        out.update(buffers=len(made), shares=shares[0])
        torch.distributed.destroy_process_group()
        for path in made.values():
            path.unlink(missing_ok=True)
    Path(result).write_text(json.dumps(out))


@pytest.fixture
def receivers(tmp_path: Path):
    """Start stand-ins: ``receivers(n, fail_at=[...])`` -> [(url, out_dir)]."""
    procs: list[subprocess.Popen] = []

    def start(n: int, fail_at: list[int] | None = None, venv: str = ".venv-vllm"
              ) -> list[tuple[str, Path]]:
        out = []
        for i in range(n):
            port, folder = free_port(), tmp_path / f"server{i}"
            argv = [str(REPO / venv / "bin/python"), "-m", "bench.ipc_receiver",
                    str(port), str(folder), "gpu-0", "gpu-1"]
            if fail_at and fail_at[i]:
                argv += ["--fail-at", str(fail_at[i])]
            procs.append(subprocess.Popen(argv, cwd=REPO))
            out.append((f"http://127.0.0.1:{port}", folder))
        for url, _ in out:
            wait_http(url + "/health", 120)
        return out

    yield start
    for p in procs:
        p.kill()
        p.wait()


def run_ranks(tmp_path: Path, urls: list[str], fail_share_at: dict[int, int] | None = None
              ) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_port()}"
    shm = f"/dev/shm/carryover-test-ipc-{tmp_path.name}"
    results = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=rank_main,
                         args=(r, 2, init, urls, shm, str(results[r]),
                               (fail_share_at or {}).get(r, 0)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, "a rank hung or died: the ranks left their collectives"
    return [json.loads(r.read_text()) for r in results]


@pytest.mark.parametrize("venv", [".venv-vllm", ".venv"])
def test_every_gpu_gets_every_tensor_in_buckets_vllm_parses(tmp_path, receivers, venv):
    # .venv: the stand-in without vLLM, as the GPU check runs it
    (url, out), = receivers(1, venv=venv)
    rank0, rank1 = run_ranks(tmp_path, [url])
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
    res = rank0["result"]
    assert res["loaded"] == [url] and not res["failed"]
    expected = {n: t.to(torch.bfloat16) for n, t in tensors()}
    for gpu in ("gpu-0", "gpu-1"):  # each of the server's workers finds its own GPU's copy
        got = load_file(str(out / f"{gpu}.safetensors"))
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (gpu, name)
    updates = [c for c in json.loads((out / "calls.json").read_text())
               if c["route"] == "/update_weights"]
    # the bucket bound holds except for the tensor larger than a bucket, sent alone
    assert all(c["nbytes"] <= BUCKET or c["names"] == ["big"] for c in updates)
    assert ["big"] in [c["names"] for c in updates]
    assert len(updates) == res["buckets"] == 5
    assert res["bytes_moved"] == sum(t.numel() * 2 for t in expected.values())
    calls = json.loads((out / "calls.json").read_text())
    # vLLM's own dataclasses read every body (in the inference environment)
    assert calls[0]["vllm_parser"] is (venv == ".venv-vllm")
    routes = [c["route"] for c in calls]
    assert routes[:2] == ["/init_weight_transfer_engine", "/start_weight_update"]
    assert routes[-1] == "/finish_weight_update"
    # one bucket buffer per rank, and one for the tensor larger than a bucket
    assert rank0["buffers"] == rank1["buffers"] == 2


def test_no_export_is_made_when_no_server_takes_part(tmp_path):
    # torch frees an exported buffer only once a reader releases it: an export no server
    # opens would be GPU memory lost, so with no server left none is made
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    rank0, rank1 = run_ranks(tmp_path, [url])
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
    assert url in rank0["result"]["unreachable"] and rank0["result"]["loaded"] == []
    assert rank0["buffers"] == rank1["buffers"] == 0 and rank0["shares"] == 0


def test_a_server_that_fails_is_dropped_and_the_other_loads(tmp_path, receivers):
    (good, good_out), (bad, bad_out) = receivers(2, fail_at=[0, 2])
    rank0, rank1 = run_ranks(tmp_path, [good, bad])
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
    res = rank0["result"]
    assert res["loaded"] == [good]
    assert "/update_weights of bucket 1" in res["failed"][bad]
    assert len(load_file(str(good_out / "gpu-1.safetensors"))) == len(tensors())
    bad_calls = json.loads((bad_out / "calls.json").read_text())
    # the failed update ended its session there (as in vLLM), so the close found none and
    # cleared what the failed bucket left with an empty one; nothing more sent after that
    assert bad_calls[-3:] == [{"route": "/finish_weight_update", "open": False},
                              {"route": "/start_weight_update", "open": False},
                              {"route": "/finish_weight_update", "open": True}]
    assert [c["route"] for c in bad_calls].count("/update_weights") == 2


def test_an_error_on_one_rank_fails_every_server_and_no_rank_hangs(tmp_path, receivers):
    (url, out), = receivers(1)
    rank0, rank1 = run_ranks(tmp_path, [url], fail_share_at={1: 3})
    # the rank that failed raises its error; rank 0 finished the collectives and failed
    # the server, whose copy from rank 1's GPU is missing
    assert rank1["error"] == "RuntimeError: share failed on rank 1"
    assert "error" not in rank0, rank0
    res = rank0["result"]
    assert res["loaded"] == []
    assert res["failed"][url].startswith("the transfer failed on the trainer: rank 1: ")
    calls = json.loads((out / "calls.json").read_text())
    assert [c["route"] for c in calls].count("/update_weights") == 2
    assert calls[-1]["route"] == "/finish_weight_update"
    # no bucket after the failed one was exported: no server was left to open it
    assert rank0["shares"] == rank1["shares"] == 3
