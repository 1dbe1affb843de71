"""Anthropic's Messages API (``/v1/messages``), translated to chat completions and back.

vLLM serves a ``/v1/messages`` of its own, but it returns neither token ids nor log-probs,
so the gateway translates to the chat path that captures them:

- ``system`` becomes the system message; text blocks become text; an assistant's
  ``tool_use`` blocks become its ``tool_calls`` (``input`` as JSON arguments); a user's
  ``tool_result`` blocks become ``tool`` messages, ahead of the text beside them.
- ``tools`` (``input_schema``) become function tools; ``tool_choice`` auto / any / tool /
  none become auto / required / the named function / none, and its
  ``disable_parallel_tool_use`` becomes ``parallel_tool_calls: false``.
- A last assistant message is a prefill: vLLM continues it in the same turn
  (``continue_final_message``) instead of opening a new one.
- ``stop_sequences`` becomes ``stop``; ``max_tokens`` (required) and the sampling
  parameters are passed on, where the gateway's sampling policy applies to them as on
  every route; ``output_config.effort`` becomes ``reasoning_effort``, as vLLM's own
  Messages route makes it.
- A ``tool_result`` block's ``is_error`` has no place in a chat ``tool`` message and is not
  passed on (vLLM's own Messages route drops it too): the error's text is what the model
  reads.

What the gateway cannot serve is refused with a 400 naming it: image and document blocks,
extended thinking, server tools (web search, code execution and the like), MCP servers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import cast

import orjson

from gateway.bodies import Answer, Choice, Message, NamedToolChoice, Request, Tool, ToolCall
from gateway.errors import CONTEXT_LENGTH_EXCEEDED, GatewayError, bad_request
from gateway.protocols import (
    Protocol,
    StreamTranslator,
    ToolGrammar,
    format_shuts_out_tools,
    function_tool,
    named_function,
    reasoning_effort,
    required_string,
    template_kwargs,
    text_of,
)
from gateway.protocols.anthropic_bodies import (
    ContentBlock,
    ErrorBody,
    Event,
    MessageBody,
    MessageUsage,
)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
REFUSED_FIELDS = ("mcp_servers", "container")
SAMPLING = ("temperature", "top_p", "top_k")


def _tool(tool: object, i: int) -> Tool:
    name = tool.get("name") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or not isinstance(name, str):
        raise bad_request(f"tools[{i}] must be an object with a string 'name'",
                          param=f"tools[{i}]")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise bad_request(f"tools[{i}]: server tool {kind!r} is not supported by this gateway "
                          f"(custom tools with an input_schema only)", param=f"tools[{i}].type")
    return function_tool(name, tool, "input_schema")


def _tool_choice(choice: object) -> str | NamedToolChoice | None:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    name = choice.get("name") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(name, str):
        return named_function(name)
    raise bad_request("tool_choice must be {'type': 'auto' | 'any' | 'none'} or "
                      "{'type': 'tool', 'name': ...}", param="tool_choice")


def _message(m: object, i: int) -> list[Message]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of content blocks",
                          param=f"{where}.content")
    out: list[Message] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": required_string(block, "id", at), "type": "function", "function": {
                "name": required_string(block, "name", at),
                "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": required_string(block, "tool_use_id", at),
                        "content": text_of(block.get("content"), f"{at}.content")})
        else:
            raise bad_request(f"{at}: a {kind!r} block is not supported by this gateway in a "
                              f"{role} message (text, tool_use, tool_result)",
                              param=f"{at}.type")
    if role == "assistant":
        msg: Message = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _output_schema(body: Mapping[str, object]) -> dict[str, object] | None:
    """The JSON schema structured outputs ask the answer to follow (``output_config.format``,
    or the earlier beta's top-level ``output_format``), else None. Served as the chat
    route's ``response_format`` (constrained decoding, captured as such)."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("output_config must be an object", param="output_config")
    for where, fmt in (("output_config.format", (config or {}).get("format")),
                       ("output_format", body.get("output_format"))):
        if fmt is None:
            continue
        schema = fmt.get("schema") if isinstance(fmt, dict) else None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
                or not isinstance(schema, dict):
            raise bad_request(f"{where}: only {{\"type\": \"json_schema\", \"schema\": {{...}}}} "
                              f"is supported by this gateway", param=where)
        return schema
    return None


class Messages(Protocol):
    name = "anthropic"

    def to_chat(self, body: dict[str, object], tools: ToolGrammar = ToolGrammar()) -> Request:
        max_tokens = _refuse_unsupported(body)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad_request("messages: a non-empty array is required", param="messages")
        chat_msgs: list[Message] = []
        if body.get("system"):
            chat_msgs.append({"role": "system", "content": text_of(body["system"], "system")})
        for i, m in enumerate(msgs):
            chat_msgs.extend(_message(m, i))
        chat: Request = {"messages": chat_msgs, "max_tokens": max_tokens}
        _add_sampling(body, chat)
        _add_tools(body, chat)
        last = chat_msgs[-1]
        if last["role"] == "assistant" and not last.get("tool_calls"):
            # a prefill: the answer continues the assistant's text, in the same turn
            chat["continue_final_message"] = True
            chat["add_generation_prompt"] = False
        _add_output_format(body, chat, tools)
        config = body.get("output_config")  # an object or None: _output_schema checked it
        reasoning_effort(config.get("effort") if isinstance(config, dict) else None,
                         "output_config.effort", chat)
        template_kwargs(body, chat)
        if body.get("stream"):
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return chat

    def overflow(self, prompt_tokens: int, max_tokens: int, max_model_len: int,
                 endpoint: str = "chat.completions") -> GatewayError:
        """Anthropic's words for it (clients such as Claude Code read the figures and ask
        again with a smaller ``max_tokens``); the Messages API names no field."""
        if prompt_tokens > max_model_len:
            message = f"prompt is too long: {prompt_tokens} tokens > {max_model_len} maximum"
        else:
            message = (f"input length and `max_tokens` exceed context limit: {prompt_tokens} "
                       f"+ {max_tokens} > {max_model_len}, decrease input length or "
                       "`max_tokens` and try again")
        return GatewayError(400, message, code=CONTEXT_LENGTH_EXCEEDED)

    def answer(self, chat: Answer, request: dict[str, object]) -> MessageBody:
        choice = (chat.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        content: list[ContentBlock] = []
        text = msg.get("content")
        if text:
            content.append({"type": "text", "text": text})
        for call in msg.get("tool_calls") or []:
            fn = call.get("function") or {}
            content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                            "input": _arguments(fn.get("arguments"))})
        reason, sequence = _stop(choice, request, bool(msg.get("tool_calls")))
        usage = chat.get("usage") or {}
        return {"id": _message_id(chat), "type": "message", "role": "assistant",
                "model": chat.get("model"), "content": content, "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0)}}

    def stream(self, request: dict[str, object]) -> StreamTranslator:
        return MessagesStream(request)


def _arguments(raw: str | dict[str, object] | None) -> dict[str, object]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return {"arguments": raw}  # what the model wrote is kept, not dropped
    return value if isinstance(value, dict) else {"arguments": value}


def _message_id(chat: Answer) -> str:
    raw = str(chat.get("id") or f"{time.time_ns():x}")
    return "msg_" + raw.removeprefix("chatcmpl-")


def _stop(choice: Choice, request: Mapping[str, object],
          tool_called: bool) -> tuple[str | None, str | None]:
    finish = choice.get("finish_reason")
    if finish is None or finish == "abort":
        # cut by an engine pause the gateway did not carry on (an operator's
        # /pause?mode=abort): no reason the answer would have ended for, as vLLM's own
        # Messages route reports it, rather than a normal end
        return None, None
    matched = choice.get("stop_reason")  # vLLM: the stop string that ended the text
    stops = request.get("stop_sequences")  # an array of strings or None: to_chat checked it
    if isinstance(matched, str) and isinstance(stops, list) and matched in stops:
        return "stop_sequence", matched
    if finish == "length":  # a tool call cut off is not one to run
        return "max_tokens", None
    if tool_called:
        return "tool_use", None
    return STOP_REASONS.get(finish, "end_turn"), None


def _event(event: Event) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class MessagesStream(StreamTranslator):
    """Chat chunks to Messages events: message_start, a content block per text run or tool
    call (start, deltas, stop), message_delta with the stop reason and usage, message_stop.
    A tool call's arguments come as one ``input_json_delta`` when its block closes, read as
    the whole answer reads them (:func:`_arguments`): a small model's arguments may be a
    JSON string or not JSON at all, which streamed piece by piece the SDK would take as
    another input than the unstreamed answer has, or fail to parse."""

    def __init__(self, request: Mapping[str, object]) -> None:
        self.request = request
        self.started = False
        self.block: str | None = None   # the open block's kind: "text" or "tool_use"
        self.index = -1
        self.tool_calls: dict[int, int] = {}  # chat tool-call index -> block index
        self.arguments: dict[int, str] = {}   # the open tool call's arguments so far
        self.finish: Choice = {}
        self.tool_called = False
        self.usage: MessageUsage = {"input_tokens": 0, "output_tokens": 0}

    def _start(self, chunk: Answer) -> Iterator[bytes]:
        self.started = True
        yield _event({"type": "message_start", "message": {
            "id": _message_id(chunk), "type": "message", "role": "assistant",
            "model": chunk.get("model"), "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": self.usage.copy()}})

    def _open(self, block: ContentBlock) -> Iterator[bytes]:
        yield from self._close()
        self.index += 1
        self.block = block["type"]
        yield _event({"type": "content_block_start", "index": self.index,
                      "content_block": block})

    def _close(self) -> Iterator[bytes]:
        if self.block is not None:
            for raw in self.arguments.values():
                yield _event({"type": "content_block_delta", "index": self.index, "delta": {
                    "type": "input_json_delta",
                    "partial_json": json.dumps(_arguments(raw), ensure_ascii=False)}})
            self.arguments = {}
            yield _event({"type": "content_block_stop", "index": self.index})
            self.block = None

    def chunk(self, chunk: Answer) -> Iterator[bytes]:
        usage = chunk.get("usage")
        if usage:
            self.usage = {"input_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0)}
        if not self.started:
            yield from self._start(chunk)
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            # vLLM's streamed tool parser passes on what the model writes between calls
            # (a newline), which its whole answer drops: an agent that echoes the message
            # back would send text the model never wrote in that place
            if text and not self.tool_calls:
                if self.block != "text":
                    yield from self._open({"type": "text", "text": ""})
                yield _event({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "text_delta", "text": text}})
            for call in delta.get("tool_calls") or []:
                k = call.get("index", 0)
                fn = call.get("function") or {}
                if k not in self.tool_calls:
                    self.tool_called = True
                    yield from self._open({"type": "tool_use", "id": call.get("id"),
                                           "name": fn.get("name"), "input": {}})
                    self.tool_calls[k] = self.index
                    self.arguments[k] = ""
                arguments = fn.get("arguments")
                if arguments and k in self.arguments:
                    self.arguments[k] += arguments
            if choice.get("finish_reason"):
                self.finish = choice

    def done(self) -> Iterator[bytes]:
        if not self.started:
            yield from self._start({})
        yield from self._close()
        reason, sequence = _stop(self.finish or {"finish_reason": "stop"}, self.request,
                                 self.tool_called)
        yield _event({"type": "message_delta",
                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                      "usage": {"output_tokens": self.usage["output_tokens"]}})
        yield _event({"type": "message_stop"})

    def error(self, err: GatewayError) -> bytes:
        return _event(error_body(err))


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_body(err: GatewayError) -> ErrorBody:
    """Anthropic's error shape; the gateway's code leads the message so it is not lost."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500
                           else "invalid_request_error")
    message = f"{err.code}: {err.message}" if err.code else err.message
    return {"type": "error", "error": {"type": kind, "message": message}}


def _refuse_unsupported(body: Mapping[str, object]) -> int:
    """``max_tokens`` (required by the Messages API); what this gateway cannot serve is
    refused with a 400 naming the field."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request("max_tokens: a positive integer is required", param="max_tokens")
    thinking = body.get("thinking")
    # adaptive lets the model choose not to think: served as a call without thinking is, as
    # vLLM's own Messages route does; a budget the model must spend on it cannot be
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled",
                                                                   "adaptive"):
        raise bad_request("thinking: extended thinking is not supported by this gateway",
                          param="thinking")
    for name in REFUSED_FIELDS:
        if body.get(name):
            raise bad_request(f"{name}: not supported by this gateway", param=name)
    return max_tokens


def _add_sampling(body: Mapping[str, object], chat: Request) -> None:
    # as the agent sent them: the chat body's check and gateway.sampling judge them next, as
    # on the chat route
    chat.update(cast(Request, {name: body[name] for name in SAMPLING
                               if body.get(name) is not None}))
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list)
                              or not all(isinstance(x, str) for x in stops)):
        raise bad_request("stop_sequences must be an array of strings",
                          param="stop_sequences")
    if stops:
        chat["stop"] = list(stops)


def _add_tools(body: Mapping[str, object], chat: Request) -> None:
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad_request("tools must be an array", param="tools")
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    raw = body.get("tool_choice")
    choice = _tool_choice(raw)
    if choice is not None and tools:
        chat["tool_choice"] = choice
        if isinstance(raw, dict) and raw.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False


def _add_output_format(body: Mapping[str, object], chat: Request, tools: ToolGrammar
                       ) -> None:
    """Structured outputs (``output_config.format`` or ``output_format``) as a JSON schema
    the answer must follow."""
    schema = _output_schema(body)
    if schema is None:
        return
    if chat.get("continue_final_message"):
        # the grammar would start at the prefill's end, the schema at the answer's
        raise bad_request("structured outputs cannot continue a prefilled assistant message",
                          param="output_config.format" if body.get("output_config")
                          else "output_format")
    if not format_shuts_out_tools(chat, tools):
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": schema, "strict": True}}
