"""One model call through the gateway, whatever protocol the agent speaks: authenticate the
rollout's token, take an in-flight lease (or refuse while paused), apply the sampling
policy and the context check, forward to an inference server with token ids and log-probs
requested, record the call for training, release the lease, and answer in the agent's
protocol (``gateway.protocols``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import orjson
import redis
from flask import Response

from app.state.cached_reads import policy_version
from gateway import capture, continuation, sampling
from gateway.admission import admit
from gateway.auth import rollout_token_sha256
from gateway.body import check_int, json_body, loads
from gateway.errors import GatewayError, bad_request, retryable
from gateway.leases import Lease, UpstreamCancelled
from gateway.protocols import OPENAI, Protocol, StreamTranslator, ToolGrammar
from gateway.send import cancelled, overflowed, send, stream_error
from gateway.state import GatewayState, get_state
from gateway.upstream import UpstreamResponse, UpstreamUnreachable

log = logging.getLogger(__name__)

# the chat content parts vLLM reads as text (refusal, thinking: an assistant turn echoed)
TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")


def validate_body(body: Any, endpoint: str) -> dict:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if endpoint == "chat.completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad_request("'messages' must be a non-empty array", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a string 'role'",
                                  param="messages")
            content = m.get("content")
            if not isinstance(content, (str, list, type(None))):
                raise bad_request(f"messages[{i}].content must be a string or an array",
                                  param="messages")
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if isinstance(part, str):  # a plain string part: text (LangChain sends them)
                    continue
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in TEXT_PARTS:
                    # an image's placeholder tokens would be captured without its pixels:
                    # the trainer could not score the call
                    raise bad_request(f"messages[{i}].content[{j}]: content of type {kind!r} "
                                      "is not served (text only)",
                                      param=f"messages[{i}].content[{j}].type")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise bad_request("'prompt' must be a string or a non-empty array", param="prompt")
        if body.get("echo"):  # vLLM would put the prompt's ids into the response's
            raise bad_request("'echo' is not served: the prompt is the agent's own",
                              param="echo")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be true or false", param="stream")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    temp = body.get("temperature")
    if temp is not None and (isinstance(temp, bool) or not isinstance(temp, (int, float))
                             or temp < 0):
        raise bad_request("'temperature' must be a number >= 0", param="temperature")
    check_int(body, "max_tokens", 1)
    check_int(body, "max_completion_tokens", 1)
    check_int(body, "n", 1, 16)
    _guided_to_structured(body)
    return body


# vLLM's removed guided-decoding fields and what each is in ``structured_outputs``
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _guided_to_structured(body: dict[str, Any]) -> None:
    """An agent written for an older vLLM asks for a constraint in ``guided_*`` fields, which
    vLLM 0.32 ignores (it samples freely, and only its log says so): they go on as the
    ``structured_outputs`` they became, so the call is constrained as the agent meant."""
    given = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    for name in ("guided_decoding_backend", "guided_whitespace_pattern"):
        body.pop(name, None)  # the server's choice, as in vLLM's structured_outputs
    if not given:
        return
    if len(given) > 1 or body.get("structured_outputs") is not None:
        raise bad_request(f"{given[0]}: one constraint at a time (guided_json, guided_regex, "
                          "guided_choice, guided_grammar or structured_outputs)",
                          param=given[0])
    body["structured_outputs"] = {GUIDED_FIELDS[given[0]]: body.pop(given[0])}
    for name in GUIDED_FIELDS:
        body.pop(name, None)  # the others, given as null


def forward(rollout_id: str, endpoint: str, protocol: Protocol = OPENAI) -> Response:
    """``endpoint``: what is sent upstream (chat.completions or completions); ``protocol``
    translates the agent's request to it and the answer back."""
    state = get_state()
    s = state.settings
    # Authentication comes first (as in the OpenAI API) and rides in the admission script;
    # from then on the lease is released on every way out but two: recorded with the
    # call's capture, or handed to the stream that will end it.
    lease_id, version, own = admit(state, rollout_id, rollout_token_sha256())
    # An evaluation rollout (its own temperature) is never trained: its sampling is always
    # set to what the evaluation asks, whatever the agent sends, in either mode.
    temperature = s.default_temperature if own is None else own
    mode = s.sampling if own is None else "enforce"
    with state.leases.held(lease_id) as lease:
        request = json_body()
        grammar = ToolGrammar(s.tool_call_parser, s.tool_strict_level)
        body = sampling.apply(validate_body(protocol.to_chat(request, grammar), endpoint),
                              mode, temperature)
        upstream = state.upstreams.pick(rollout_id)
        if upstream is None:
            raise retryable("no inference server is reachable", s.retry_after_s,
                            code="upstream_unavailable")
        wants_lp, wants_ids = capture.agent_wants(body, endpoint)
        shows = (wants_lp, wants_ids, capture.hides_reasoning(body))
        up_body = capture.prepare_upstream_body(body, endpoint, s.served_model(version),
                                                s.default_max_tokens, temperature)
        continued = None
        if endpoint == "chat.completions" and state.continuity is not None:
            continued = state.continuity.prompt_ids(rollout_id, up_body)
        if state.context is not None:
            # a continued prompt is counted as the ids vLLM gets, not rendered once more
            over = state.context.check(up_body, endpoint, continued)
            if over is not None:
                raise overflowed(state, rollout_id, protocol.overflow(
                    *over, state.context.max_model_len, endpoint))
        if continued is not None:  # vLLM takes these ids instead of rendering
            up_body["kv_transfer_params"] = {**(up_body.get("kv_transfer_params") or {}),
                                             "prompt_token_ids": continued}
        stream = bool(body.get("stream"))
        cancel = state.leases.add(lease_id)
        started = time.time()
        resp, data = send(state, rollout_id, lease_id, upstream, endpoint, up_body, stream)
        meta = capture.CallMeta(endpoint=endpoint, version=version,
                                temperature=float(up_body["temperature"]),
                                upstream=upstream, started_at=started,
                                constrained=capture.constrained_by(
                                    body, s.tool_call_parser, s.tool_strict_level),
                                continued=continued is not None)
        if stream:
            lease.handed_over = True
            return Response(_stream(state, resp, rollout_id, lease, cancel, meta, shows,
                                    protocol.stream(request), up_body),
                            mimetype="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        assert data is not None  # read above: not streamed
        answer = loads(data)
        switches: dict[int, list[list[int]]] = {}
        if continuation.aborted(answer):
            answer = _carry_on(state, rollout_id, lease_id, cancel, endpoint, up_body, answer,
                               version, switches)
        # a call frozen across a weight update ends on a later version than it started
        calls = meta.calls(answer, switches=switches, version_end=policy_version(state.redis))
        if not lease.record([c.to_json() for c in calls], _turn(state, up_body, answer)):
            raise cancelled(state)
    shown = capture.strip_for_agent(answer, endpoint, *shows)
    return Response(orjson.dumps(protocol.answer(shown, request)), mimetype="application/json")


def _resend(state: GatewayState, rollout_id: str, lease_id: str, cancel: Any,
            endpoint: str, body: dict[str, Any], stream: bool
            ) -> tuple[UpstreamResponse, bytes | None, int, str]:
    """Send a cut call's continuation once the pause has ended, to whichever server is
    usable then (the re-sent tokens are a prefill anywhere); -> (the response, its body
    unless streamed, the policy version it is sampled on, the server)."""
    s = state.settings
    try:
        continuation.wait_for_resume(state.redis, cancel, s.upstream_timeout_s)
    except UpstreamCancelled:
        raise cancelled(state) from None
    except TimeoutError as exc:
        raise retryable(f"a cut call could not be carried on: {exc}", s.retry_after_s,
                        code="cancelled_by_update") from None
    # the trainer sets the version before it resumes the engines, the pause after
    version = policy_version(state.redis, 0.0)
    body["model"] = s.served_model(version)  # LoRA: the new version's adapter
    upstream = state.upstreams.pick(rollout_id)
    if upstream is None:
        raise retryable("no inference server is reachable", s.retry_after_s,
                        code="upstream_unavailable")
    resp, data = send(state, rollout_id, lease_id, upstream, endpoint, body, stream)
    return resp, data, version, upstream


def _not_carried_on(state: GatewayState, rollout_id: str, body: dict[str, Any],
                    answer: dict[str, Any], reasoning: bool = False) -> GatewayError | None:
    """The retryable error that ends a cut call the gateway cannot carry on exactly.
    ``reasoning``: a stream's deltas held a reasoning parser's text (its accumulated
    answer keeps none)."""
    parser = state.settings.tool_call_parser
    why = continuation.refusal(body, parser)
    if why is None and not continuation.one_choice(answer):
        why = "several choices"
    if why is None and (reasoning or continuation.reasoned(answer)):
        why = "a reasoning parser's answer"
    # without tools the server parses no call out of the text: a cut anywhere carries on
    if why is None and body.get("tools") and continuation.cut_in_call(answer, parser):
        why = "a tool call cut in its markup"
    if why is None:
        return None
    log.info("rollout %s: a call cut by a weight update is not carried on (%s); the agent "
             "retries it", rollout_id, why)
    return cancelled(state)


def _misread(state: GatewayState, rollout_id: str) -> GatewayError:
    log.warning("rollout %s: the continuation of a cut call was not read from the ids it "
                "was sent; the agent retries the call", rollout_id)
    return cancelled(state)


def _carry_on(state: GatewayState, rollout_id: str, lease_id: str, cancel: Any,
              endpoint: str, body: dict[str, Any], data: dict[str, Any], version: int,
              switches: dict[int, list[list[int]]]) -> dict[str, Any]:
    """A plain answer that a weight update cut (``finish_reason: abort``), carried on after
    the update until it ends (``gateway.continuation``); ``switches`` gets where its tokens
    changed version."""
    current = version
    while continuation.aborted(data) and continuation.carries_on(state.redis):
        refused = _not_carried_on(state, rollout_id, body, data)
        if refused is not None:
            raise refused
        prompt_ids, so_far = continuation.prompt_and_response(data)
        more_body = continuation.resend_body(body, endpoint, prompt_ids, so_far)
        if more_body is None:
            return continuation.ended_by_length(data)
        _, raw, now, _ = _resend(state, rollout_id, lease_id, cancel, endpoint, more_body,
                                 False)
        assert raw is not None
        more = loads(raw)
        if continuation.sent_prompt(more) != [*prompt_ids, *so_far]:
            raise _misread(state, rollout_id)
        if now != current:
            switches.setdefault(0, []).append([len(so_far), now])
            current = now
        data = continuation.merge(data, more, endpoint)
    return data


def _turn(state: GatewayState, body: dict[str, Any],
          answer: dict[str, Any]) -> tuple[str, str] | None:
    """What keeps a one-choice chat answer for its conversation's next turn (token
    continuity), recorded with the call."""
    choices = answer.get("choices") or []
    if state.continuity is None or len(choices) != 1:
        return None
    msg = choices[0].get("message") or {}
    return state.continuity.turn(body, {"content": msg.get("content"),
                                        "tool_calls": msg.get("tool_calls")},
                                 choices[0].get("token_ids") or [])


def _lines(resp: UpstreamResponse) -> Iterator[str]:
    for line in resp.lines():
        yield line.rstrip(b"\r\n").decode("utf-8")


def _stream(state: GatewayState, resp: UpstreamResponse, rollout_id: str, lease: Lease,
            cancel: Any, meta: capture.CallMeta, shows: tuple[bool, bool, bool],
            out: StreamTranslator, body: dict[str, Any]) -> Iterator[bytes]:
    """``shows``: what the agent sees of each chunk (``capture.strip_for_agent``)."""
    acc = capture.StreamAccumulator(meta.endpoint)
    current = meta.version
    done: int | None = None         # tokens before a continuation (drain_mode continue)
    text_done = 0                   # and the characters of their text
    expected: list[int] | None = None  # the prompt ids its server must say it read
    upstream = meta.upstream
    try:
        reasoning = False  # a reasoning parser's text came (such a call is not carried on)
        while True:
            cut = False  # a weight update aborted this upstream stream (drain_mode continue)
            ended = False  # the upstream's [DONE] came
            finish = False  # this upstream stream gave its finish reason (the answer so far
            # may hold an earlier stream's abort)
            lines = _lines(resp)
            while True:
                try:
                    line = next(lines, None)
                except UpstreamUnreachable as exc:
                    if not ended:  # after the [DONE], the answer is whole
                        yield out.error(_cut_off(state, rollout_id, upstream, lease, cancel,
                                                 exc))
                    return
                if line is None:
                    break
                # The trainer bumps the version while the engines are frozen and before they
                # resume (gateway.drain_mode keep): the first chunk read under a new version
                # holds the first tokens sampled on it. A cut stream's tail holds none.
                now = policy_version(state.redis)
                if now != current and not cut:
                    acc.switch(now)
                    current = now
                if cancel.is_set():
                    yield out.error(cancelled(state))
                    return
                if not line or not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    if cut:
                        break
                    if not finish:
                        # ended with nothing sampled (continuation.finished): carried on
                        # from its prompt's ids, as any cut call, where they came
                        answer = acc.response()
                        if continuation.carries_on(state.redis) \
                                and continuation.prompt_and_response(answer)[0]:
                            refused = _not_carried_on(state, rollout_id, body, answer,
                                                      reasoning)
                            if refused is not None:
                                yield out.error(refused)
                                return
                            cut = True
                            break
                        yield out.error(_unfinished(state, rollout_id, lease, cancel))
                        return
                    ended = True
                    yield from _end_stream(state, acc, lease, meta, body, current, out)
                    continue
                chunk = loads(payload)
                if isinstance(chunk, dict) and chunk.get("error"):
                    # vLLM's error inside a stream (then [DONE]): the agent gets it in its
                    # protocol's shape, and the partial call is not captured
                    err = stream_error(chunk["error"])
                    log.warning("inference server error in the stream for %s: %s",
                                rollout_id, err.message)
                    yield out.error(err)
                    return
                if cut:
                    continue  # the cut stream's usage: the continuation counts anew
                if done is not None:  # a continuation's chunk, as part of the agent's call
                    if expected is not None and continuation.sent_prompt(chunk):
                        if continuation.sent_prompt(chunk) != expected:
                            yield out.error(_misread(state, rollout_id))
                            return
                        expected = None
                    chunk = continuation.as_part_of_call(chunk, done, text_done)
                acc.add(chunk)
                finish = finish or continuation.finished(chunk)
                reasoning = reasoning or continuation.reasoned(chunk)
                shown = chunk
                if continuation.aborted(chunk) and continuation.carries_on(state.redis):
                    refused = _not_carried_on(state, rollout_id, body, acc.response(),
                                              reasoning)
                    if refused is not None:
                        yield out.error(refused)
                        return
                    cut = True
                    shown = continuation.without_abort(chunk)
                yield from out.chunk(capture.strip_for_agent(shown, meta.endpoint, *shows))
            if not cut:
                if not ended:  # the connection closed before the answer's end
                    yield out.error(_cut_off(state, rollout_id, upstream, lease, cancel,
                                             None))
                return
            resp.release()
            prompt_ids, so_far = continuation.prompt_and_response(acc.response())
            more_body = continuation.resend_body(body, meta.endpoint, prompt_ids, so_far)
            if more_body is None:  # the cut came at the call's last token
                acc.end_by_length()
                last: dict[str, Any] = {"index": 0, "finish_reason": "length"}
                if meta.endpoint == "chat.completions":
                    last["delta"] = {}
                else:
                    last["text"] = ""
                yield from out.chunk({"choices": [last]})
                yield from _end_stream(state, acc, lease, meta, body, current, out)
                return
            try:
                resp, _, now, upstream = _resend(state, rollout_id, lease.id, cancel,
                                                 meta.endpoint, more_body, True)
            except GatewayError as err:
                yield out.error(err)
                return
            except redis.RedisError as exc:
                yield out.error(retryable(f"a cut call could not be carried on ({exc})",
                                          state.settings.retry_after_s,
                                          code="cancelled_by_update"))
                return
            if now != current:  # the re-sent tokens are sampled on the version after it
                acc.switch(now)
                current = now
            done, expected = len(so_far), [*prompt_ids, *so_far]
            text_done = acc.text_length()
    except redis.RedisError as exc:
        # the stream had begun: the agent gets an error event in its protocol, as for any
        # other failure past the headers, never a connection that just drops
        log.warning("Redis failed in the stream for %s (%s); nothing captured", rollout_id, exc)
        yield out.error(retryable(f"the gateway lost its state store mid-answer ({exc}); retry",
                                  state.settings.retry_after_s, code="state_unavailable"))
    finally:
        resp.release()
        if not lease.ended:
            try:
                lease.release()
            except redis.RedisError:  # its TTL ends it: the stream's end is not held up
                log.warning("lease of %s not released (Redis unreachable)", rollout_id)
            log.info("stream for %s ended early; nothing captured", rollout_id)


def _cut_off(state: GatewayState, rollout_id: str, upstream: str, lease: Lease, cancel: Any,
             exc: UpstreamUnreachable | None) -> GatewayError:
    """A stream its server cut (closed, or silent past ``upstream_timeout_s``): the agent
    gets an error, never an answer that just stops, and the server is routed around as
    when a call to it fails (``_send``). A weight update under way (the call's lease
    cancelled, which this process learns only at its next check, or the gateway paused)
    is what ended it: the usual retryable cancel, and the server is left alone."""
    if cancel.is_set() or _updating(state, lease.id):
        return cancelled(state)
    why = str(exc) if exc is not None else "closed before the answer's end"
    state.upstreams.mark_down(upstream, restarted=exc is None or not exc.timed_out)
    log.warning("inference server %s cut the stream for %s (%s); nothing captured",
                upstream, rollout_id, why)
    return retryable(f"inference server cut the answer off ({why})",
                     state.settings.retry_after_s, code="upstream_unavailable")


def _unfinished(state: GatewayState, rollout_id: str, lease: Lease, cancel: Any
                ) -> GatewayError:
    """A stream that ended before its answer did, not carried on: never recorded; the
    agent retries it (a weight update's cancel, or the server's own abort)."""
    if cancel.is_set() or _updating(state, lease.id):
        return cancelled(state)
    log.warning("the stream for %s ended before its answer's end; nothing captured",
                rollout_id)
    return retryable("inference server ended the answer before its end",
                     state.settings.retry_after_s, code="upstream_unavailable")


def _updating(state: GatewayState, lease_id: str) -> bool:
    admission = state.leases.admission
    try:
        return bool(admission.cancelled_among([lease_id])) or admission.is_paused()
    except redis.RedisError:
        return False


def _end_stream(state: GatewayState, acc: capture.StreamAccumulator, lease: Lease,
                meta: capture.CallMeta, body: dict[str, Any], version_end: int,
                out: StreamTranslator) -> Iterator[bytes]:
    """Record a whole streamed call as its lease goes, and end the agent's stream."""
    calls = meta.calls(acc.response(), stream=True, version_end=version_end,
                       switches=acc.switches)
    if not lease.record([c.to_json() for c in calls], _turn(state, body, acc.response())):
        yield out.error(cancelled(state))
        return
    yield from out.done()
