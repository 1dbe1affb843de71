"""The gateway's gunicorn worker: gunicorn's gevent worker, except that a graceful stop does
not wait for idle keep-alive connections.

On SIGTERM gunicorn's gevent worker stops accepting and waits, up to ``graceful_timeout``,
until no connection handler is left. A handler includes a keep-alive connection waiting for
its client's next request (an agent's SDK keeps its connections open between calls), so
one idle client held every stop for the whole timeout, a restart of the gateway with it.
Here, once the worker stops, the read side of each connection that is between requests is
shut down: its handler sees the end of the stream and returns. A request already being
served is not touched; it finishes within the timeout, its answer sent with
``Connection: close``.
"""

from __future__ import annotations

import socket
from typing import Any

import gevent
from gunicorn.workers.ggevent import GeventWorker

STOP_POLL_S = 0.2


class GatewayWorker(GeventWorker):
    def init_process(self) -> None:
        self._open: set[Any] = set()   # the connections this worker handles
        self._busy: set[Any] = set()   # those serving a request now
        super().init_process()

    def run(self) -> None:
        gevent.spawn(self._close_idle_once_stopping)
        super().run()

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        self._open.add(client)
        try:
            super().handle(listener, client, addr)
        finally:
            self._open.discard(client)

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> bool:
        self._busy.add(sock)
        try:
            keep_open = super().handle_request(listener_name, req, sock, addr)
        finally:
            self._busy.discard(sock)
        if not self.alive:
            raise StopIteration  # gunicorn's way to close the connection after the answer
        return bool(keep_open)

    def _close_idle_once_stopping(self) -> None:
        while self.alive:
            gevent.sleep(STOP_POLL_S)
        # a request served now closes its connection once answered (handle_request), so
        # one pass over those between requests is enough
        for sock in list(self._open - self._busy):
            _stop_reading(sock)


def _stop_reading(sock: Any) -> None:
    """Shut down the read side of ``sock``: its handler's wait for the next request ends
    with the end of the stream. Done on a duplicate of the descriptor (a shutdown acts on
    the connection, whichever descriptor names it): gevent's own ``shutdown`` would instead
    raise EBADF into the waiting handler, which gunicorn logs as a socket error."""
    try:
        dup = socket.fromfd(sock.fileno(), sock.family, sock.type)
    except OSError:
        return  # closed meanwhile
    try:
        dup.shutdown(socket.SHUT_RD)  # the reply side stays open
    except OSError:
        pass
    finally:
        dup.close()
