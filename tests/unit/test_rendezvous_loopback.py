"""The trainer's ranks on one host meet over loopback only: torch's TCPStore server listens
on every address unless handed a socket, and it answers anyone who connects, without a
credential (a host outside the stack could read or rewrite the rendezvous)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

from app.config.loader import REPO_ROOT
from workers.trainer.ranks import free_port

# a rank of its own process (this one may hold a group already): joins the group, sums a
# tensor with the others, prints the sum and the addresses its process listens on
_RANK = """
import json, sys
import psutil, torch
import torch.distributed as dist
from workers.trainer.ranks import init_process_group
rank, world, port = map(int, sys.argv[1:4])
init_process_group(rank, world, port, "cpu", 120.0)
t = torch.ones(1)
dist.all_reduce(t)
listening = [c.laddr.ip for c in psutil.Process().net_connections("tcp")
             if c.status == psutil.CONN_LISTEN]
print(json.dumps([t.item(), listening]))
"""


def _ranks(world: int) -> list[tuple[float, list[str]]]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), str(port)],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        out.append(tuple(json.loads(stdout.strip().splitlines()[-1])))
    return out


def test_one_rank_listens_on_loopback_only():
    [(total, listening)] = _ranks(1)
    assert total == 1.0
    assert listening, "no rendezvous socket found: the check would pass vacuously"
    assert all(ipaddress.ip_address(a).is_loopback for a in listening), listening


def test_ranks_on_one_host_still_meet():
    out = _ranks(2)
    assert [total for total, _ in out] == [2.0, 2.0]
    for _, listening in out:
        assert all(ipaddress.ip_address(a).is_loopback for a in listening), listening
