"""Calls a weight update cut short, carried on (``gateway.drain_mode: continue``).

The trainer pauses the engines with ``/pause?mode=abort``: vLLM ends every request in
flight with ``finish_reason: abort`` and returns the tokens sampled so far with their
log-probs (streamed or not). The gateway keeps them, waits until the pause ends (the new
weights are loaded and the engines resumed), and sends the prompt plus the partial response
as token ids, with ``max_tokens`` reduced by what was generated. The agent sees one answer;
the capture is one call whose tokens switch version at the first re-sent token. The KV
cache is rebuilt by one prefill. This is verl's colocated partial rollout, done at the
gateway (verl re-sends from its own rollout client).

Calls that cannot be carried on exactly are ended as ``abort`` ends them (a retryable
error; the agent sends the call again):

- ``n > 1`` or a batch of prompts (each choice would need its own continuation);
- a continuation whose server did not read the ids it was sent as its prompt (vLLM renders
  the messages instead when it cannot take them);
- constrained decoding: the grammar would start again at the re-sent tokens;
- a tool call cut in its markup: the server parses tool calls from the text it generated
  itself, so the continuation's half would be parsed alone. Without tools, or when the cut
  came before any call (the markup is known for the ``hermes`` parser), the call goes on; a
  streamed call with tools is not continued (the stream's parser may hold back text).

The trainer marks its pause as one that carries calls on (``keys.pause_carries_on``); a cut
answer without that mark (an operator's ``/pause?mode=abort``) reaches the agent as it is.
Pure functions but :func:`carries_on` and :func:`wait_for_resume`; the resends themselves
are ``gateway.carry_on`` (and ``gateway.stream`` for a streamed call).
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Literal

import redis

from app.state import keys
from gateway.bodies import Answer, Request
from gateway.capture import constrained_by
from gateway.leases import UpstreamCancelled

ABORT = "abort"
# where a tool call starts in the text, per vLLM tool-call parser
CALL_MARKUP = {"hermes": "<tool_call>"}


def refusal(body: Request, tool_call_parser: str | None) -> str | None:
    """Why a call of this request cannot be continued after an abort, or None."""
    if int(body.get("n") or 1) > 1:
        return "n > 1"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return "a batch of prompts"
    # (under tool_choice auto the grammar holds inside a call only: cut_in_call's case)
    constrained = constrained_by(body)
    if constrained:
        return f"constrained decoding ({constrained})"
    if body.get("tools") and (body.get("stream") or tool_call_parser not in CALL_MARKUP):
        return "tools in a streamed call" if body.get("stream") else \
            f"tools with the {tool_call_parser!r} parser"
    return None


def one_choice(resp: Answer) -> bool:
    return len(resp.get("choices") or []) == 1


def aborted(resp: Answer) -> bool:
    return any(c.get("finish_reason") == ABORT for c in resp.get("choices") or [])


def finished(chunk: Answer) -> bool:
    """A stream's chunk gives its finish reason. vLLM sends no abort chunk for a call that
    had sampled nothing when its engine was paused (it waited for a slot, or was in chunked
    prefill): its stream ends after its first chunk with none."""
    return any(c.get("finish_reason") for c in chunk.get("choices") or [])


def reasoned(resp: Answer) -> bool:
    """The partial answer (or a stream's chunk) carries a reasoning parser's text. A
    continuation's answer is parsed without the prompt's part of the answer: a tail past the
    end of the reasoning would come back as reasoning, the answer and any tool call in it
    lost."""
    return any((c.get("message") or c.get("delta") or {}).get(k)
               for c in resp.get("choices") or [] for k in ("reasoning", "reasoning_content"))


def cut_in_call(resp: Answer, tool_call_parser: str | None) -> bool:
    """The partial answer stops inside a tool call's markup (its text has the call's start:
    the parser could not read it whole)."""
    marker = CALL_MARKUP.get(str(tool_call_parser))
    for choice in resp.get("choices") or []:
        msg = choice.get("message") or {}
        text = msg.get("content") or ""
        if msg.get("tool_calls") or (marker and marker in text):
            return True
        # or the cut came inside the marker itself (a tokenizer without a token for it
        # spells it in pieces): the continuation's parser would see half a marker
        if marker and any(text.endswith(marker[:k]) for k in range(2, len(marker))):
            return True
    return False


def prompt_and_response(resp: Answer) -> tuple[list[int], list[int]]:
    """The prompt's and the (one) choice's token ids of a chat or completions answer."""
    choice = (resp.get("choices") or [{}])[0]
    prompt = choice.get("prompt_token_ids") or resp.get("prompt_token_ids") or []
    return list(prompt), list(choice.get("token_ids") or [])


def resend_body(body: Request, endpoint: str, prompt_ids: list[int],
                so_far: list[int]) -> Request | None:
    """The upstream request that carries the call on from ``so_far``; None when the tokens
    already reached the call's limit (the answer ends there, by length)."""
    out = body.copy()
    key: Literal["max_completion_tokens", "max_tokens"] = (
        "max_completion_tokens" if out.get("max_completion_tokens") is not None
        else "max_tokens")
    limit = out.get(key)
    assert limit is not None, "prepare_upstream_body fills max_tokens in"
    left = int(limit) - len(so_far)
    if left <= 0:
        return None
    out[key] = left
    ids = [*prompt_ids, *so_far]
    if endpoint == "completions":
        out["prompt"] = ids
    else:  # vLLM takes these ids instead of rendering the messages (as token continuity)
        out["kv_transfer_params"] = {**(out.get("kv_transfer_params") or {}),
                                     "prompt_token_ids": ids}
    return out


def ended_by_length(resp: Answer) -> Answer:
    out = copy.deepcopy(resp)
    for choice in out.get("choices") or []:
        if choice.get("finish_reason") == ABORT:
            choice["finish_reason"] = "length"
    return out


def merge(first: Answer, more: Answer, endpoint: str) -> Answer:
    """One answer from a cut one and its continuation (one choice each): tokens, log-probs
    and text joined, the prompt and the id of the first, the end of the second."""
    out = copy.deepcopy(first)
    a, b = out["choices"][0], (more.get("choices") or [{}])[0]
    ids = a["token_ids"] = [*(a.get("token_ids") or []), *(b.get("token_ids") or [])]
    a["finish_reason"] = b.get("finish_reason")
    a["stop_reason"] = b.get("stop_reason")
    lp_a, lp_b = a.get("logprobs") or {}, b.get("logprobs") or {}
    if endpoint == "chat.completions":
        msg, tail = a.setdefault("message", {}), b.get("message") or {}
        msg["content"] = (msg.get("content") or "") + (tail.get("content") or "")
        if tail.get("tool_calls"):
            msg["tool_calls"] = tail["tool_calls"]
        if lp_a or lp_b:
            a["logprobs"] = {"content": [*(lp_a.get("content") or []),
                                         *(lp_b.get("content") or [])]}
    else:
        before = a.get("text") or ""
        a["text"] = before + (b.get("text") or "")
        if lp_a or lp_b:
            a["logprobs"] = {
                "tokens": [*(lp_a.get("tokens") or []), *(lp_b.get("tokens") or [])],
                "token_logprobs": [*(lp_a.get("token_logprobs") or []),
                                   *(lp_b.get("token_logprobs") or [])],
                "top_logprobs": [*(lp_a.get("top_logprobs") or []),
                                 *(lp_b.get("top_logprobs") or [])],
                # the continuation's offsets count from its own text's start
                "text_offset": [*(lp_a.get("text_offset") or []),
                                *(o + len(before) for o in lp_b.get("text_offset") or [])]}
    usage_a, usage_b = out.get("usage") or {}, more.get("usage") or {}
    if usage_a or usage_b:
        done = len(ids)
        prompt = usage_a.get("prompt_tokens", 0)
        out["usage"] = {**usage_a, "completion_tokens": done, "total_tokens": prompt + done}
    return out


def sent_prompt(resp: Answer) -> list[int]:
    """The prompt ids a continuation's answer (or its first streamed chunk) says it read."""
    choice = (resp.get("choices") or [{}])[0]
    return list(choice.get("prompt_token_ids") or resp.get("prompt_token_ids") or [])


def without_abort(chunk: Answer) -> Answer:
    """A streamed chunk that ended the cut call, as the agent sees it: the call goes on."""
    out = chunk.copy()
    out["choices"] = [{**c, "finish_reason": None} if c.get("finish_reason") == ABORT else c
                      for c in chunk.get("choices") or []]
    return out


def as_part_of_call(chunk: Answer, done: int, text_done: int = 0) -> Answer:
    """A continuation's streamed chunk as part of the agent's call, ``done`` tokens and
    ``text_done`` characters in: its prompt is the call's (so no second prompt's ids), its
    usage counts the whole answer, its text offsets (completions) the whole text."""
    out = chunk.copy()
    out.pop("prompt_token_ids", None)
    out["choices"] = [c.copy() for c in chunk.get("choices") or []]
    for choice in out["choices"]:
        choice.pop("prompt_token_ids", None)
        lp = choice.get("logprobs")
        if text_done and isinstance(lp, dict) and lp.get("text_offset"):
            choice["logprobs"] = {**lp, "text_offset": [o + text_done
                                                        for o in lp["text_offset"]]}
    usage = chunk.get("usage")
    if usage:
        out["usage"] = {**usage,
                        "prompt_tokens": max(0, int(usage.get("prompt_tokens", 0)) - done),
                        "completion_tokens": int(usage.get("completion_tokens", 0)) + done}
    return out


def carries_on(redis_client: redis.Redis) -> bool:
    """The pause under way carries cut calls on (its trainer's drain is ``continue``): read
    when an answer comes back cut, so a gateway follows whatever mode the run uses. The mark
    holds its pause's token: a pause taken over since (an operator's) does not carry on. It
    outlives its pause a lease TTL, for the answers read after the resume."""
    mark, pause = redis_client.mget(keys.pause_carries_on(), keys.paused())
    return mark is not None and (pause is None or mark == pause)


def wait_for_resume(redis_client: redis.Redis, cancel: threading.Event, timeout_s: float,
                    poll_s: float = 0.05) -> None:
    """Until the gateway's pause ends (the weights are loaded and the engines resumed).
    Raises :class:`UpstreamCancelled` if the call's lease is cancelled meanwhile, and
    TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    # read, not cached: a cached False from before the pause would send the call at once
    while redis_client.exists(keys.paused()):
        if cancel.is_set():
            raise UpstreamCancelled
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the pause lasted more than {timeout_s:.0f} s")
        time.sleep(poll_s)
