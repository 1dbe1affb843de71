"""OpenAI's Responses API (``/v1/responses``), the subset agents use, translated to chat
completions and back.

- ``instructions`` and system or developer items become system messages; message items
  become messages (text parts joined); ``function_call`` items become the assistant's
  ``tool_calls``, ``function_call_output`` items ``tool`` messages; reasoning items are
  dropped (the served model writes none).
- Function ``tools`` and ``tool_choice`` map one to one; ``text.format`` (json_schema,
  json_object) becomes ``response_format``; ``max_output_tokens`` becomes ``max_tokens``;
  ``reasoning.effort`` becomes ``reasoning_effort``, which vLLM gives the chat template.
- The answer is a ``response`` object with a message item and a ``function_call`` item per
  tool call; streamed, the events the SDKs read (created, output items and parts, text and
  argument deltas, completed).

The gateway keeps no responses: ``previous_response_id``, ``conversation`` and
``background`` are refused with a 400 naming them (send the whole input, as the OpenAI
Agents SDK does by default), as are built-in tools and non-text inputs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from typing import cast

import orjson

from gateway.bodies import Answer, Message, NamedToolChoice, Request, Tool, ToolCall, Usage
from gateway.body import check_int
from gateway.errors import GatewayError, bad_request, overflow_error
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
from gateway.protocols.responses_bodies import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    ResponseBody,
)

REFUSED_FIELDS = {
    "previous_response_id": "the gateway keeps no responses: send the whole input",
    "conversation": "the gateway keeps no conversations: send the whole input",
    "background": "background responses are not supported by this gateway",
    "prompt": "stored prompts are not supported by this gateway",
}
SAMPLING = ("temperature", "top_p")


def _tool(tool: object, i: int) -> Tool:
    kind = tool.get("type") if isinstance(tool, dict) else None
    name = tool.get("name") if isinstance(tool, dict) else None
    if kind != "function" or not isinstance(tool, dict) or not isinstance(name, str):
        raise bad_request(f"tools[{i}]: tool type {kind!r} is not supported by this gateway "
                          f"(function tools only)", param=f"tools[{i}].type")
    return function_tool(name, tool, "parameters")


def _tool_choice(choice: object) -> str | NamedToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        return choice
    name = choice.get("name") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str):
        return named_function(name)
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or "
                      "{'type': 'function', 'name': ...}", param="tool_choice")


def _response_format(text: object) -> dict[str, object] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        spec: dict[str, object] = {"name": fmt.get("name") or "output",
                                   "schema": fmt.get("schema") or {}}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"text.format: type {fmt['type']!r} is not supported",
                      param="text.format.type")


def _messages(items: object) -> list[Message]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty array of items",
                          param="input")
    out: list[Message] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ("user", "assistant", "system",
                                                         "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or "
                                  f"developer", param=f"{where}.role")
            # a developer message goes on as one: vLLM makes it a system message for a
            # template that does not name the role, and then merges every system message
            # into one, first (two system messages apart fail in some templates)
            out.append({"role": role,
                        "content": text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments")
            if arguments is not None and not isinstance(arguments, str):
                raise bad_request(f"{where}.arguments must be a string (the call's JSON)",
                                  param=f"{where}.arguments")
            call: ToolCall = {"id": required_string(item, "call_id", where), "type": "function",
                              "function": {"name": required_string(item, "name", where),
                                           "arguments": arguments or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # one turn, several calls
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": required_string(item, "call_id", where),
                        "content": output if isinstance(output, str)
                        else text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}: an item of type {kind!r} is not supported by this "
                              f"gateway (message, function_call, function_call_output)",
                              param=f"{where}.type")
    return out


class Responses(Protocol):
    name = "responses"

    def to_chat(self, body: dict[str, object], tools: ToolGrammar = ToolGrammar()) -> Request:
        for name, why in REFUSED_FIELDS.items():
            if body.get(name):
                raise bad_request(f"{name}: {why}", param=name)
        msgs = _messages(body.get("input"))
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad_request("instructions must be a string", param="instructions")
        if instructions:
            msgs.insert(0, {"role": "system", "content": instructions})
        chat: Request = {"messages": msgs}
        check_int(body, "max_output_tokens", 1)
        max_output_tokens = body.get("max_output_tokens")
        if isinstance(max_output_tokens, int):  # or None: check_int refused anything else
            chat["max_tokens"] = max_output_tokens
        # as the agent sent them: the chat body's check and gateway.sampling judge them next,
        # as on the chat route
        chat.update(cast(Request, {name: body[name] for name in SAMPLING
                                   if body.get(name) is not None}))
        tools_given = body.get("tools")
        if tools_given:
            if not isinstance(tools_given, list):
                raise bad_request("tools must be an array", param="tools")
            chat["tools"] = [_tool(t, i) for i, t in enumerate(tools_given)]
            choice = _tool_choice(body.get("tool_choice"))
            if choice is not None:
                chat["tool_choice"] = choice
            if body.get("parallel_tool_calls") is not None:
                chat["parallel_tool_calls"] = bool(body["parallel_tool_calls"])
        fmt = _response_format(body.get("text"))
        if fmt is not None and not format_shuts_out_tools(chat, tools):
            chat["response_format"] = fmt
        reasoning = body.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, dict):
            raise bad_request("reasoning must be an object", param="reasoning")
        reasoning_effort(reasoning.get("effort") if isinstance(reasoning, dict) else None,
                         "reasoning.effort", chat)
        template_kwargs(body, chat)
        if body.get("stream"):
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return chat

    def overflow(self, prompt_tokens: int, max_tokens: int, max_model_len: int,
                 endpoint: str = "chat.completions") -> GatewayError:
        return overflow_error(prompt_tokens, max_tokens, max_model_len, "input",
                              "max_output_tokens")

    def answer(self, chat: Answer, request: dict[str, object]) -> ResponseBody:
        choice = (chat.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        output: list[OutputItem] = []
        text = msg.get("content")
        if text:
            output.append(_message_item(_item_id("msg"), text))
        for call in msg.get("tool_calls") or []:
            fn = call.get("function") or {}
            output.append(_call_item(_item_id("fc"), str(call.get("id")), fn.get("name"),
                                     fn.get("arguments") or ""))
        return _response(request, chat.get("model"), output, choice.get("finish_reason"),
                         chat.get("usage"), "completed")

    def stream(self, request: dict[str, object]) -> StreamTranslator:
        return ResponsesStream(request)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# the finish reasons of an answer that ended short -> the response's status
CUT = {"length": "incomplete", "abort": "cancelled"}


def _message_item(item_id: str, text: str, status: str = "completed") -> MessageItem:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str | None, arguments: str,
               status: str = "completed") -> FunctionCallItem:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _response(request: Mapping[str, object], model: str | None, output: list[OutputItem],
              finish: str | None, usage: Usage | None, status: str,
              response_id: str | None = None, created: int | None = None) -> ResponseBody:
    if status == "completed" and finish in CUT:
        # the last item is the one cut (those before it ended); an answer cut by an engine
        # pause the gateway did not carry on is "cancelled", as vLLM's own route has it
        status = CUT[finish]
        if output:
            output[-1]["status"] = "incomplete"
    usage = usage or {}
    return {
        "id": response_id or _item_id("resp"), "object": "response",
        "created_at": created or int(time.time()), "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": request.get("instructions"), "metadata": request.get("metadata") or {},
        "max_output_tokens": request.get("max_output_tokens"),
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [], "truncation": "disabled",
        "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage.get("completion_tokens", 0),
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage.get("total_tokens", 0)},
    }


class ResponsesStream(StreamTranslator):
    """Chat chunks to Responses events, numbered by ``sequence_number``."""

    def __init__(self, request: Mapping[str, object]) -> None:
        self.request = request
        self.id = _item_id("resp")
        self.created = int(time.time())
        self.model: str | None = None
        self.seq = 0
        self.items: list[OutputItem] = []   # output items so far, in order
        self.open: OutputItem | None = None  # the item receiving deltas
        self.calls: dict[int, FunctionCallItem] = {}  # chat tool-call index -> item
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.started = False

    def _event(self, kind: str, **data: object) -> bytes:
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(
            {"type": kind, "sequence_number": self.seq - 1, **data}) + b"\n\n"

    def _snapshot(self, status: str) -> ResponseBody:
        return _response(self.request, self.model, self.items, self.finish, self.usage,
                         status, self.id, self.created)

    def _close(self) -> Iterator[bytes]:
        item, self.open = self.open, None
        if item is None:
            return
        index = self.items.index(item)
        # closed at the end of an answer that was cut: this item is the one cut
        item["status"] = "incomplete" if self.finish in CUT else "completed"
        if item["type"] == "message":
            part = item["content"][0]
            yield self._event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=part["text"],
                              logprobs=[])
            yield self._event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=part)
        else:
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"],
                              arguments=item["arguments"])
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _add(self, item: OutputItem) -> Iterator[bytes]:
        yield from self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        added = item.copy()
        added["status"] = "in_progress"
        if added["type"] == "message":
            added["content"] = []
        yield self._event("response.output_item.added", output_index=index, item=added)
        if item["type"] == "message":
            yield self._event("response.content_part.added", item_id=item["id"],
                              output_index=index, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []})

    def chunk(self, chunk: Answer) -> Iterator[bytes]:
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        self.model = chunk.get("model", self.model)
        if not self.started:
            self.started = True
            snapshot = self._snapshot("in_progress")
            yield self._event("response.created", response=snapshot)
            yield self._event("response.in_progress", response=snapshot)
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            # as the whole answer has it: no text after the first call (vLLM's streamed
            # tool parser passes on a newline between calls, which would become a message
            # item between them and, echoed back, split the turn in two)
            if text and not self.calls:
                message = self.open
                if message is None or message["type"] != "message":
                    message = _message_item(_item_id("msg"), "", "in_progress")
                    yield from self._add(message)
                message["content"][0]["text"] += text
                yield self._event("response.output_text.delta", item_id=message["id"],
                                  output_index=self.items.index(message), content_index=0,
                                  delta=text, logprobs=[])
            for call in delta.get("tool_calls") or []:
                k = call.get("index", 0)
                fn = call.get("function") or {}
                if k not in self.calls:
                    item = _call_item(_item_id("fc"), str(call.get("id")), fn.get("name"), "",
                                      "in_progress")
                    yield from self._add(item)
                    self.calls[k] = item
                item = self.calls[k]
                arguments = fn.get("arguments")
                if arguments:
                    item["arguments"] += arguments
                    yield self._event("response.function_call_arguments.delta",
                                      item_id=item["id"],
                                      output_index=self.items.index(item),
                                      delta=arguments)
            finish = choice.get("finish_reason")
            if finish:
                self.finish = finish

    def done(self) -> Iterator[bytes]:
        if not self.started:
            yield from self.chunk({})
        yield from self._close()
        final = self._snapshot("completed")
        kind = "response.completed" if final["status"] == "completed" else \
            "response.incomplete"  # the SDK's event for an answer that ended short
        yield self._event(kind, response=final)

    def error(self, err: GatewayError) -> bytes:
        # the "error" object makes the openai SDK raise an APIError at this event, also
        # when it is the first one
        return self._event("error", code=err.code, message=err.message, param=err.param,
                           error=err.body()["error"])
