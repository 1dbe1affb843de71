"""The gateway's gunicorn worker: gunicorn's gevent worker, except that a graceful stop does
not wait for idle keep-alive connections.

On SIGTERM gunicorn's gevent worker stops accepting and waits, up to ``graceful_timeout``,
until no connection handler is left. A handler includes a keep-alive connection waiting for
its client's next request (an agent's SDK keeps its connections open between calls), so
one idle client held every stop for the whole timeout, a restart of the gateway with it.
Here, once the worker stops, the read side of each connection that is between requests is
shut down (again every ``STOP_POLL_S``, for those accepted or idle since): its handler sees
the end of the stream and returns. A request already being served is not touched; it
finishes within the timeout, answered with ``Connection: close`` where its headers are not
sent yet, and its connection is closed after the answer.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

import gevent
from gevent.socket import socket as GreenSocket
from gunicorn.workers.ggevent import GeventWorker

if TYPE_CHECKING:
    from _typeshed import OptExcInfo
    from gunicorn.http.message import Request

# where a connection comes from: (host, port[, flow, scope]) or a Unix socket's path
Address = tuple[str | int, ...] | str

STOP_POLL_S = 0.2


class GatewayWorker(GeventWorker):
    def init_process(self) -> None:
        self._open: set[GreenSocket] = set()   # the connections this worker handles
        self._busy: set[GreenSocket] = set()   # those serving a request now (or speaking HTTP/2)
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        app: WSGIApplication = self.wsgi  # type: ignore[has-type]  # gunicorn sets it, untyped

        def closing_once_stopped(environ: WSGIEnvironment,
                                 start_response: StartResponse) -> Iterable[bytes]:
            def start(status: str, headers: list[tuple[str, str]],
                      exc_info: OptExcInfo | None = None) -> Callable[[bytes], object]:
                if not self.alive:  # the stop began while this request was served
                    # gunicorn's start_response is a method of its Response
                    start_response.__self__.force_close()  # type: ignore[attr-defined]
                return start_response(status, headers, exc_info)
            return app(environ, start)

        self.wsgi = closing_once_stopped

    def run(self) -> None:
        gevent.spawn(self._close_idle_once_stopping)
        super().run()

    def handle(self, listener: GreenSocket, client: GreenSocket, addr: Address) -> None:
        self._open.add(client)
        try:
            super().handle(listener, client, addr)
        finally:
            self._open.discard(client)

    def handle_request(self, listener_name: Address, req: Request, sock: GreenSocket,
                       addr: Address) -> bool:
        self._busy.add(sock)
        try:
            keep_open = super().handle_request(listener_name, req, sock, addr)
        finally:
            self._busy.discard(sock)
        if not self.alive:
            raise StopIteration  # gunicorn's way to close the connection after the answer
        return bool(keep_open)

    def handle_http2(self, listener: GreenSocket, client: GreenSocket, addr: Address,
                     *args: object, **kwargs: object) -> None:
        # streams share the connection: it is never idle in this sense, and gunicorn ends
        # it itself once the worker stops (a GOAWAY after the streams it has)
        self._busy.add(client)
        try:
            super().handle_http2(listener, client, addr, *args, **kwargs)
        finally:
            self._busy.discard(client)

    def _close_idle_once_stopping(self) -> None:
        while self.alive:
            gevent.sleep(STOP_POLL_S)
        done: set[GreenSocket] = set()
        while True:  # until the process exits: gunicorn accepts for up to a second more
            for sock in self._open - self._busy - done:
                done.add(sock)
                _stop_reading(sock)
            gevent.sleep(STOP_POLL_S)


def _stop_reading(sock: GreenSocket) -> None:
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
