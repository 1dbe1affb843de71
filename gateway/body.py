"""Reading a request's JSON body, for every route that takes one."""

from __future__ import annotations

import json
from typing import Any

import orjson
from flask import request

from gateway.errors import bad_request


def loads(raw: bytes | str) -> Any:
    """orjson (several times faster on the hot path), falling back to the json module for
    what only it reads (NaN and Infinity tokens)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def check_int(body: dict, name: str, lo: int, hi: int | None = None) -> None:
    """An optional integer field of a request body, within bounds, or a 400 naming it."""
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        limit = f" and <= {hi}" if hi is not None else ""
        raise bad_request(f"'{name}' must be an integer >= {lo}{limit}", param=name)


def json_body() -> Any:
    # get_data() enforces MAX_CONTENT_LENGTH (413); get_json(silent=True) would hide that.
    raw = request.get_data(cache=True)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("request body is not valid JSON") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    # What only the json module reads: NaN and Infinity (sent on as null), or what nothing
    # downstream can write: a lone UTF-16 surrogate (text cut inside an emoji), an integer
    # past 64 bits.
    try:
        orjson.dumps(body)
    except TypeError as exc:
        why = ("a lone UTF-16 surrogate escape (half of a character, as when text is cut "
               "inside an emoji): not valid Unicode" if "surrogate" in str(exc)
               else f"a value that cannot be sent on ({exc})")
        raise bad_request(f"request body has {why}") from None
    return body
