"""What ended a role's process: its exit status and, where the kernel says so, its OOM killer.

The supervisor, which started the process and reaps it, builds a ``RoleExit`` when it sees a
role exit and records it in Redis (``keys.role_exits``). The driver reads the trainer's when
it gives up on a step whose trainer worker kept dying, the one place that would otherwise
know only that a heartbeat expired. Two witnesses of an OOM kill, either of which may be
unreadable (a kernel log restricted to root, a container without its memory cgroup): the
kernel's log (``/dev/kmsg``), which names the killed pid, and the memory cgroup's
``oom_kill`` count, which also counts the kills of the role's children. What could not be
read is said in the record, never raised: recording an exit must never stop a restart.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from app.state import keys
from app.state.records import RoleExit

if TYPE_CHECKING:
    import redis

EXITS_KEPT = 1000  # the stream's length, about (MAXLEN ~)
KMSG = Path("/dev/kmsg")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")  # the roles are in the supervisor's own cgroup
_KILLED = re.compile(r"Killed process (\d+) ")


def role_exit(role: str, proc: subprocess.Popen, oom_kills_at_start: int | None) -> RoleExit:
    """The exit of ``role``'s process ``proc`` (reaped), with the kernel's word on it."""
    line, unreadable = oom_kill_line(proc.pid)
    now_kills = cgroup_oom_kills()
    grew = now_kills - oom_kills_at_start if now_kills is not None \
        and oom_kills_at_start is not None else 0
    return RoleExit(role, socket.gethostname(), proc.pid, int(proc.returncode or 0),
                    at=time.time(), oom=line, oom_kills=max(0, grew), kernel_log=unreadable)


def write_exit(client: redis.Redis, record: RoleExit) -> None:
    """Append ``record`` to the stream: its id is Redis's clock, so a reader on another host
    takes the exits since a moment of its own (``XRANGE`` from Redis's ``TIME``)."""
    client.xadd(keys.role_exits(), record.to_hash(),  # type: ignore[arg-type]
                maxlen=EXITS_KEPT, approximate=True)


def oom_kill_line(pid: int, kmsg: Path = KMSG) -> tuple[str, str]:
    """(the kernel's last "Killed process <pid>" line, "") or ("", why its log could not be
    read). ``/dev/kmsg`` gives one record a read, opened non-blocking so that the end of the
    buffer ends the read instead of waiting for the next record."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return "", f"{kmsg}: {exc.strerror or exc}"
    chunks: list[bytes] = []
    try:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break  # the end of the buffer
            except BrokenPipeError:
                continue  # records overwritten while we read: go on from the next
            except OSError as exc:
                return "", f"{kmsg}: {exc.strerror or exc}"
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    found = ""
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        message = line.partition(";")[2] if ";" in line else line  # kmsg: "<prefix>;<text>"
        match = _KILLED.search(message)
        if match and int(match.group(1)) == pid:
            found = message.strip()
    return found, ""


def cgroup_oom_kills(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """How many processes the OOM killer ended in this process's memory cgroup (v2
    ``memory.events``, v1 ``memory.oom_control``), or None where neither is readable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    files = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            files.append(root / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            files.append(root / "memory" / path.lstrip("/") / "memory.oom_control")
    for file in files:
        try:
            for entry in file.read_text().splitlines():
                name, _, value = entry.partition(" ")
                if name == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None
