"""The gateway's upstream connections (gateway/upstream.py) against raw local servers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from gateway.upstream import Upstreams, UpstreamUnreachable, _HTTPConnection

ANSWER = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}'


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return data


@pytest.fixture
def server() -> Iterator[Callable]:
    """server(handle) -> url; ``handle(conn)`` serves one accepted connection."""
    socks: list[socket.socket] = []

    def start(handle: Callable[[socket.socket], None]) -> str:
        lsock = socket.create_server(("127.0.0.1", 0))
        socks.append(lsock)

        def accept_loop() -> None:
            while True:
                try:
                    conn, _ = lsock.accept()
                except OSError:
                    return
                socks.append(conn)
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

        threading.Thread(target=accept_loop, daemon=True).start()
        return f"http://127.0.0.1:{lsock.getsockname()[1]}"

    yield start
    for s in socks:
        s.close()


def test_head_and_body_leave_in_one_send():
    sent: list[bytes] = []

    class Recorder:
        def sendall(self, data: bytes) -> None:
            sent.append(bytes(data))

    conn = _HTTPConnection("127.0.0.1", 1)
    conn.sock = Recorder()  # type: ignore[assignment]
    conn.hold_head = True
    conn.request("POST", "/v1/completions", b'{"prompt": "x"}',
                 {"Content-Type": "application/json"})
    assert len(sent) == 1
    assert sent[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert sent[0].endswith(b'\r\n\r\n{"prompt": "x"}')


def test_a_connection_the_server_closed_is_replaced(server):
    served = []

    def answer_once_then_hang_up(conn: socket.socket) -> None:
        served.append(_read_request(conn))
        conn.sendall(ANSWER)   # keep-alive answer, then the server closes anyway
        conn.close()

    url = server(answer_once_then_hang_up)
    ups = Upstreams([url])
    for _ in range(3):
        resp = ups.post(url, "/v1/completions", b"{}", 5)
        assert (resp.status, resp.read()) == (200, b"{}")
    assert len(served) == 3   # each request reached the server exactly once


def test_refused_connection_is_unreachable_not_slow():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"   # bound, never listening
        with pytest.raises(UpstreamUnreachable) as err:
            Upstreams([url]).post(url, "/v1/completions", b"{}", 5)
    assert not err.value.timed_out


def test_a_silent_server_times_out_as_a_slow_answer(server):
    def never_answer(conn: socket.socket) -> None:
        _read_request(conn)

    url = server(never_answer)
    with pytest.raises(UpstreamUnreachable) as err:
        Upstreams([url]).post(url, "/v1/completions", b"{}", 0.3)
    assert err.value.timed_out


def test_a_server_that_answers_no_connection_has_its_calls_in_flight_cut_off(server):
    """A server cut off by a partition: its health check gets no connection (twice, so it is
    skipped), and a call already sent there ends at once, retryable, instead of waiting for
    an answer that cannot come until its timeout (or a weight update's drain)."""
    from gateway.upstream import ConnectTimeout

    def silent(conn: socket.socket) -> None:
        _read_request(conn)  # and never answers

    url = server(silent)
    ups = Upstreams([url])
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            ups.post(url, "/v1/completions", b"{}", timeout_s=60).read()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - what the call ended with
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    pool = ups._pools[url]
    for _ in range(500):  # the call is sent
        if pool._busy:
            break
        time.sleep(0.01)

    def no_connection(path: str, timeout_s: float) -> tuple[int, bytes]:
        raise ConnectTimeout("no connection")

    pool.fetch = no_connection  # type: ignore[method-assign]
    assert ups.check_health() == {url: False}
    caller.join(0.5)
    assert caller.is_alive(), "one failed check is not an outage: the call goes on"
    ups.check_health()
    caller.join(5)
    assert not caller.is_alive(), "the call waits on the cut server"
    assert isinstance(outcome[0], UpstreamUnreachable) and not outcome[0].timed_out, outcome
    assert ups.healthy() == [] and not pool._busy


class _Cancelled(BaseException):
    """What a drain raises into a call's greenlet (gateway's UpstreamCancelled, a kill)."""


def _headers_then_nothing(closed: threading.Event) -> Callable[[socket.socket], None]:
    def handle(conn: socket.socket) -> None:
        _read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")  # the body never comes
        conn.settimeout(10)
        try:
            if conn.recv(1) == b"":
                closed.set()
        except OSError:
            pass

    return handle


def test_a_call_cancelled_mid_read_closes_its_connection(server):
    """The server must see its client leave (vLLM then stops generating), and the
    connection is neither kept nor pooled."""
    closed = threading.Event()
    url = server(_headers_then_nothing(closed))
    ups = Upstreams([url])
    resp = ups.post(url, "/v1/completions", b"{}", timeout_s=60)

    def cancelled_read() -> bytes:
        raise _Cancelled

    with pytest.raises(_Cancelled):
        resp._guarded(cancelled_read)
    assert closed.wait(5), "the server never saw the connection close"
    pool = ups._pools[url]
    assert not pool._busy and not pool._idle


def test_a_response_dropped_unreleased_still_closes_its_connection(server):
    import gc

    closed = threading.Event()
    url = server(_headers_then_nothing(closed))
    ups = Upstreams([url])
    ups.post(url, "/v1/completions", b"{}", timeout_s=60)  # dropped: a stream never read
    gc.collect()
    assert closed.wait(5), "the busy set kept the connection open"
    assert not ups._pools[url]._busy


def test_a_connection_shut_by_an_abort_is_not_pooled(server, monkeypatch):
    """A call that ends between the abort's look at the busy calls and its shutdown hands
    its connection back: it must not serve the next call (a shut socket, not retried)."""

    def answer(conn: socket.socket) -> None:
        while _read_request(conn):
            conn.sendall(ANSWER)

    url = server(answer)
    ups = Upstreams([url])
    pool = ups._pools[url]
    resp = ups.post(url, "/v1/completions", b"{}", timeout_s=10)
    real_shutdown = socket.socket.shutdown
    ended: list[bytes] = []

    def call_ends_first(sock: socket.socket, how: int) -> None:
        if not ended:
            ended.append(resp.read())  # the call ends and hands its connection back
        real_shutdown(sock, how)

    monkeypatch.setattr(socket.socket, "shutdown", call_ends_first)
    assert pool.abort_busy() == 1
    assert ended == [b"{}"]
    assert not pool._idle, "a shut connection went back to the pool"
    monkeypatch.undo()
    assert ups.post(url, "/v1/completions", b"{}", timeout_s=10).read() == b"{}"
