"""One model call through the gateway, whatever protocol the agent speaks: authenticate the
rollout's token, take an in-flight lease (or refuse while paused), apply the sampling
policy and the context check, forward to an inference server with token ids and log-probs
requested (``gateway.send``), record the call for training, release the lease, and answer
in the agent's protocol (``gateway.protocols``).

This module is the order of those steps; a streamed answer is relayed and recorded by
``gateway.stream``, and a call a weight update cuts is carried on by ``gateway.carry_on``.
The lease is released on every way out but two: recorded with the call's capture, or
handed to the stream that will end it.
"""

from __future__ import annotations

import time
from typing import Literal

import orjson
from flask import Response

from app.state.cached_reads import policy_version
from gateway import capture, sampling
from gateway.admission import admit
from gateway.auth import rollout_token_sha256
from gateway.bodies import Request
from gateway.body import answer_of, check_int, json_object
from gateway.carry_on import CarryOn
from gateway.continuity import kept_turn
from gateway.errors import bad_request, retryable
from gateway.protocols import OPENAI, Protocol, ToolGrammar
from gateway.send import cancelled, overflowed, send
from gateway.state import GatewayState, get_state
from gateway.stream import AnswerStream

# the chat content parts vLLM reads as text (refusal, thinking: an assistant turn echoed)
TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")


def validate_body(body: Request, endpoint: str) -> Request:
    """The chat or completions body, checked where the gateway relies on its fields (a
    protocol's translation, or the agent's body as it came)."""
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
GUIDED_FIELDS: dict[Literal["guided_json", "guided_regex", "guided_choice", "guided_grammar"],
                    str] = {"guided_json": "json", "guided_regex": "regex",
                            "guided_choice": "choice", "guided_grammar": "grammar"}


def _guided_to_structured(body: Request) -> None:
    """An agent written for an older vLLM asks for a constraint in ``guided_*`` fields, which
    vLLM 0.32 ignores (it samples freely, and only its log says so): they go on as the
    ``structured_outputs`` they became, so the call is constrained as the agent meant."""
    given = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    # the server's choice, as in vLLM's structured_outputs
    body.pop("guided_decoding_backend", None)
    body.pop("guided_whitespace_pattern", None)
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
    # Authentication comes first (as in the OpenAI API) and rides in the admission script.
    lease_id, version, own = admit(state, rollout_id, rollout_token_sha256())
    # An evaluation rollout (its own temperature) is never trained: its sampling is always
    # set to what the evaluation asks, whatever the agent sends, in either mode.
    temperature = s.default_temperature if own is None else own
    mode = s.sampling if own is None else "enforce"
    with state.leases.held(lease_id) as lease:
        request = json_object()
        grammar = ToolGrammar(s.tool_call_parser, s.tool_strict_level)
        body = sampling.apply(validate_body(protocol.to_chat(request, grammar), endpoint),
                              mode, temperature)
        upstream = state.upstreams.pick(rollout_id)
        if upstream is None:
            raise retryable("no inference server is reachable", s.retry_after_s,
                            code="upstream_unavailable")
        wants_lp, wants_ids = capture.agent_wants(body, endpoint)
        shows = (wants_lp, wants_ids, capture.hides_reasoning(body))
        up_body, continued = _upstream_body(state, rollout_id, endpoint, protocol, body,
                                            version, temperature)
        stream = bool(body.get("stream"))
        cancel = state.leases.add(lease_id)
        started = time.time()
        resp, data = send(state, rollout_id, lease_id, upstream, endpoint, up_body, stream)
        sent_temperature = up_body.get("temperature")
        assert sent_temperature is not None, "prepare_upstream_body fills it in"
        meta = capture.CallMeta(endpoint=endpoint, version=version,
                                temperature=float(sent_temperature),
                                upstream=upstream, started_at=started,
                                constrained=capture.constrained_by(
                                    body, s.tool_call_parser, s.tool_strict_level),
                                continued=continued)
        carry = CarryOn(state, rollout_id, lease_id, cancel, endpoint, up_body)
        if stream:
            lease.handed_over = True
            answer_stream = AnswerStream(state, resp, lease, meta, carry, shows,
                                         protocol.stream(request))
            return Response(answer_stream.events(), mimetype="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        assert data is not None  # read above: not streamed
        answer, switches = carry.whole(answer_of(data), version)
        # a call frozen across a weight update ends on a later version than it started
        calls = meta.calls(answer, switches=switches, version_end=policy_version(state.redis))
        if not lease.record([c.to_json() for c in calls],
                            kept_turn(state.continuity, up_body, answer)):
            raise cancelled(state)
    shown = capture.strip_for_agent(answer, endpoint, *shows)
    return Response(orjson.dumps(protocol.answer(shown, request)), mimetype="application/json")


def _upstream_body(state: GatewayState, rollout_id: str, endpoint: str, protocol: Protocol,
                   body: Request, version: int, temperature: float
                   ) -> tuple[Request, bool]:
    """The request sent upstream (``capture.prepare_upstream_body``), its prompt the ids of
    the conversation so far where token continuity has them; -> (it, whether it is), or the
    agent's context-length error."""
    s = state.settings
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
    return up_body, continued is not None
