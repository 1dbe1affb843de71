"""The ports a stack is given: never one the process was given before, though the kernel may
hand the same ephemeral port to two binds in a row (two services of one stack on one port:
the config refuses it)."""

from __future__ import annotations

from types import SimpleNamespace

import bench.stack


class _Socket:
    """A socket whose binds get the kernel's ports from ``ports``, in order."""

    ports: list[int] = []

    def __enter__(self) -> _Socket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = _Socket.ports.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return "127.0.0.1", self.port


def test_a_port_handed_out_is_not_handed_out_again(monkeypatch):
    monkeypatch.setattr(bench.stack, "_handed_out", set(), raising=False)
    # the module's name for the socket module, not socket.socket itself: other threads of
    # the test process (servers of earlier tests) open real sockets meanwhile
    monkeypatch.setattr(bench.stack, "socket", SimpleNamespace(socket=_Socket))
    _Socket.ports = [41000, 41000, 41000, 41001, 41000, 41002]
    assert [bench.stack.free_port() for _ in range(3)] == [41000, 41001, 41002]
