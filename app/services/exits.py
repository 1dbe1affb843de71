"""What ended a role's process: its exit status and, where the kernel says so, its OOM killer.

The supervisor, which started the process and reaps it, builds a ``RoleExit`` when it sees a
role exit and records it in Redis (``keys.role_exits``). The driver reads the trainer's when
it gives up on a step whose trainer worker kept dying, the one place that would otherwise
know only that a heartbeat expired. Two witnesses of an OOM kill, either of which may be
unreadable (a kernel log restricted to root, a container without its memory cgroup): the
kernel's log (``/dev/kmsg``), which names the killed pid, and the memory cgroup's
``oom_kill`` count, which also counts the kills of the role's children. What could not be
read is said in the record, never raised: recording an exit must never stop a restart.

The kernel's log is believed only about the process it names: a record written after the
role started (its sequence number past the last one at the start, so an old line of a pid
since reused is not this exit's), naming the pid the kernel knows it by. That is the pid the
supervisor sees only in the initial pid namespace; in a container's the kernel's pids are
others, and the log is said not to be matched rather than to hold no OOM kill of it.
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
PID_NAMESPACE = Path("/proc/self/ns/pid")
PROC_STATUS = Path("/proc/self/status")
# the inode of the initial pid namespace: a constant of the kernel (PROC_PID_INIT_INO)
INITIAL_PID_NAMESPACE_INO = 0xEFFFFFFC
_KILLED = re.compile(r"Killed process (\d+) ")


def role_exit(role: str, proc: subprocess.Popen, oom_kills_at_start: int | None,
              kmsg_at_start: int | None) -> RoleExit:
    """The exit of ``role``'s process ``proc`` (reaped), with the kernel's word on it:
    ``oom_kills_at_start`` (``cgroup_oom_kills``) and ``kmsg_at_start`` (``kmsg_position``)
    were read when the role was started."""
    line, unreadable, unmatched = "", "", ""
    if not pids_are_the_kernels():
        unmatched = ("the supervisor runs in a pid namespace of its own, as in a container: "
                     "the kernel knows the process by another pid")
    elif kmsg_at_start is None:
        unreadable = f"{KMSG}: not readable when the role started"
    else:
        line, unreadable, unmatched = oom_kill_line(proc.pid, kmsg_at_start)
    now_kills = cgroup_oom_kills()
    grew = now_kills - oom_kills_at_start if now_kills is not None \
        and oom_kills_at_start is not None else 0
    return RoleExit(role, socket.gethostname(), proc.pid, int(proc.returncode or 0),
                    at=time.time(), oom=line, oom_kills=max(0, grew), kernel_log=unreadable,
                    kernel_log_unmatched=unmatched)


def write_exit(client: redis.Redis, record: RoleExit) -> None:
    """Append ``record`` to the stream: its id is Redis's clock, so a reader on another host
    takes the exits since a moment of its own (``XRANGE`` from Redis's ``TIME``)."""
    client.xadd(keys.role_exits(), record.to_hash(),  # type: ignore[arg-type]
                maxlen=EXITS_KEPT, approximate=True)


def pids_are_the_kernels(ns: Path = PID_NAMESPACE, status: Path = PROC_STATUS) -> bool:
    """Whether this process's pids are the ones the kernel's log names: it is in the initial
    pid namespace. Not where ``NSpid`` lists more than one pid (a namespace nested below the
    one /proc shows), nor where the namespace is another (a container, whose /proc shows its
    own pids only, one each), nor where either cannot be read."""
    try:
        for entry in status.read_text().splitlines():
            if entry.startswith("NSpid:") and len(entry.split()) > 2:
                return False
        return os.stat(ns).st_ino == INITIAL_PID_NAMESPACE_INO
    except OSError:
        return False


def _kmsg_records(kmsg: Path) -> tuple[list[tuple[int, str]], bool, str]:
    """The kernel's log as (sequence number, message) records, whether records were
    overwritten while it was read, and "" or why it could not be read. ``/dev/kmsg`` gives
    one record a read, "<priority>,<sequence>,<microseconds>,<flags>;<message>" with its
    continuation lines after (" KEY=value"); opened non-blocking so that the end of the
    buffer ends the read instead of waiting for the next record."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return [], False, f"{kmsg}: {exc.strerror or exc}"
    chunks: list[bytes] = []
    lost = False
    try:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break  # the end of the buffer
            except BrokenPipeError:
                lost = True
                continue  # records overwritten while we read: go on from the next
            except OSError as exc:
                return [], False, f"{kmsg}: {exc.strerror or exc}"
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    records = []
    for text in b"".join(chunks).decode(errors="replace").splitlines():
        header, sep, message = text.partition(";")
        fields = header.split(",")
        if not sep or text.startswith(" ") or len(fields) < 3 or not fields[1].isdigit():
            continue  # a continuation line
        records.append((int(fields[1]), message.strip()))
    return records, lost, ""


def kmsg_position(kmsg: Path = KMSG) -> int | None:
    """The sequence number of the kernel log's last record (-1 when it holds none), or
    None where it cannot be read: what ``oom_kill_line`` later reads after."""
    records, _, unreadable = _kmsg_records(kmsg)
    if unreadable:
        return None
    return max((seq for seq, _ in records), default=-1)


def oom_kill_line(pid: int, after: int, kmsg: Path = KMSG) -> tuple[str, str, str]:
    """(the kernel's last "Killed process <pid>" line written after the record numbered
    ``after``, why its log could not be read, why it could not be matched), each "" where
    there is nothing to say. Unmatched: records after ``after`` were overwritten before they
    were read (the kill may have been among them)."""
    records, lost, unreadable = _kmsg_records(kmsg)
    if unreadable:
        return "", unreadable, ""
    found = ""
    for seq, message in records:
        match = _KILLED.search(message)
        if seq > after and match and int(match.group(1)) == pid:
            found = message
    if found:
        return found, "", ""
    oldest = min((seq for seq, _ in records), default=after + 1)
    if lost or oldest > after + 1:
        return "", "", "records written since the role started were overwritten before they " \
            "were read"
    return "", "", ""


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
