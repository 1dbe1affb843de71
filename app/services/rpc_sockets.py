"""Where the vLLM servers put their ZMQ IPC sockets, and the sweep of dead ones.

vLLM's API server and its engine process talk over Unix sockets it names
``$VLLM_RPC_BASE_PATH/<uuid>`` (the system temporary directory by default) and never
unlinks, even on a clean stop: every server start used to leave a few socket files in
``/tmp`` for good. The servers this project starts use one directory of their own, private
to the user, and each start removes the sockets there that nobody listens on any more.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

# A socket younger than this is left alone even when a connect is refused: a server starting
# beside this one may have bound it and not yet be listening.
_MIN_AGE_S = 120.0
_DEAD = {errno.ECONNREFUSED, errno.ENOENT}
# A Unix socket's path holds at most 107 bytes on Linux; vLLM adds "/" and a uuid4.
_PATH_MAX, _NAME_BYTES = 107, 37


def rpc_dir() -> Path:
    """The directory for this user's vLLM IPC sockets (created, mode 0700), in the temporary
    directory, or in /tmp where that one's path is too long for a socket's."""
    name = f"carryover-vllm-rpc-{os.getuid()}"
    fits = [p for p in (Path(tempfile.gettempdir()) / name, Path("/tmp") / name)
            if len(os.fsencode(p)) + _NAME_BYTES <= _PATH_MAX]
    if not fits:
        raise RuntimeError(f"no directory for vLLM's IPC sockets: a socket path holds at most "
                           f"{_PATH_MAX} bytes; set TMPDIR to a shorter path")
    path = fits[0]
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        # in a shared /tmp another user could have made it first, to read the sockets
        raise RuntimeError(f"{path} is not a directory of this user's: remove it, or set "
                           "TMPDIR to a directory of your own")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)
    return path


def _dead(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        # never wait: the listen queue of a server that stopped accepting (SIGSTOP, a
        # debugger) fills up, and a blocking connect would then hang every later start
        sock.setblocking(False)
        try:
            sock.connect(str(path))
        except OSError as exc:
            return exc.errno in _DEAD
    return False


def sweep(directory: Path, min_age_s: float = _MIN_AGE_S) -> int:
    """Remove the sockets in ``directory`` that refuse a connection and are older than
    ``min_age_s``; return how many were removed. Anything else there is left alone."""
    removed = 0
    now = time.time()
    for path in directory.iterdir():
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue  # a server's own stop, or another sweep, got there first
        if not stat.S_ISSOCK(info.st_mode) or now - info.st_mtime < min_age_s:
            continue
        if _dead(path):
            path.unlink(missing_ok=True)
            removed += 1
    return removed
