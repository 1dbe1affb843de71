"""Reading a request's JSON body, for every route that takes one."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import cast

import orjson
from flask import request

from gateway.bodies import Answer
from gateway.errors import bad_request


def loads(raw: bytes | str) -> object:
    """orjson (several times faster on the hot path), falling back to the json module for
    what only it reads (NaN and Infinity tokens)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def answer_of(raw: bytes | str) -> Answer:
    """An inference server's answer, or one chunk of its stream, read."""
    value = loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"an inference server answered with JSON that is not an object: "
                         f"{str(raw)[:200]}")
    return cast(Answer, value)  # the server's: vLLM's OpenAI-compatible shape


def check_int(body: Mapping[str, object], name: str, lo: int, hi: int | None = None) -> None:
    """An optional integer field of a request body, within bounds, or a 400 naming it."""
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        limit = f" and <= {hi}" if hi is not None else ""
        raise bad_request(f"'{name}' must be an integer >= {lo}{limit}", param=name)


def json_object() -> dict[str, object]:
    """The request's body, a JSON object, else a 400."""
    body = json_body()
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def json_body() -> object:
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
