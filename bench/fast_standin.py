"""A near-free OpenAI-compatible upstream for the gateway benchmark: one asyncio process,
HTTP/1.1 keep-alive, a fixed vLLM-shaped answer (token ids and log-probs) prepared once.

On 2 cores the benchmark's upstream shares the CPU with the proxy it measures; a stand-in
that costs as much per call as the proxy (a Flask app under gunicorn) halves what the proxy
can show. This one costs tens of microseconds per call, and the benchmark reports its CPU per
call beside the gateway's.

Usage: python -m bench.fast_standin PORT
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

# an answer that ends with the end-of-turn token (id 2 in the demo's model), as most do: the
# gateway keeps such a turn for token continuity, so that write is in what is measured
_IDS = [3, 4, 5, 2]
_CHAT = json.dumps({
    "id": "standin", "object": "chat.completion", "created": int(time.time()),
    "model": "standin", "prompt_token_ids": [1, 2, 3],
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "abcd"},
                 "logprobs": {"content": [{"token": "a", "logprob": -0.5 - 0.01 * i,
                                           "bytes": [97], "top_logprobs": []}
                                          for i in range(len(_IDS))]},
                 "finish_reason": "stop", "token_ids": _IDS}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
}).encode()


def _response(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\nconnection: keep-alive\r\n\r\n").encode() + body


_OK_CHAT = _response("200 OK", _CHAT)
_OK_EMPTY = _response("200 OK", b"", "text/plain")
_NOT_FOUND = _response("404 Not Found", b"{}")


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line, _, rest = head.partition(b"\r\n")
            method, path = line.split(b" ", 2)[:2]
            length = 0
            for header in rest.split(b"\r\n"):
                name, _, value = header.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            if path == b"/v1/chat/completions" and method == b"POST":
                writer.write(_OK_CHAT)
            elif path == b"/health":
                writer.write(_OK_EMPTY)
            else:
                writer.write(_NOT_FOUND)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def _main(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port, backlog=512)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1])))
