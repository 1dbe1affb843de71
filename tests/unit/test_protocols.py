"""The Messages and Responses protocols, translated to chat completions and back (pure
functions; the SDK tests in tests/integration/test_agent_sdks.py run them on the real
stack)."""

from __future__ import annotations

import json

import pytest

from gateway.errors import GatewayError
from gateway.protocols import ToolGrammar
from gateway.protocols.anthropic import Messages, error_body
from gateway.protocols.responses import Responses

TOOL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def events(raw: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for chunk in raw:
        head, data = chunk.decode().strip().split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ")
        body = json.loads(data[6:])
        assert body["type"] == head[7:]
        out.append((head[7:], body))
    return out


def chat_chunks(*deltas: dict, finish: str = "stop") -> list[dict]:
    chunks = [{"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "delta": d}],
               "usage": {"prompt_tokens": 5, "completion_tokens": i + 1}}
              for i, d in enumerate(deltas)]
    chunks[-1]["choices"][0]["finish_reason"] = finish
    return chunks


# --- Anthropic Messages ----------------------------------------------------------------

def test_messages_become_chat_messages_in_order():
    chat = Messages().to_chat({
        "model": "x", "max_tokens": 20, "system": [{"type": "text", "text": "be brief"}],
        "stop_sequences": ["END"], "temperature": 0.5,
        "tools": [{"name": "add", "description": "Add", "input_schema": TOOL_SCHEMA}],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": "3+4?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 3}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "so?"},
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "7"}]}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "3+4?"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 3}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "7"},  # results before the text
        {"role": "user", "content": "so?"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "add", "parameters": TOOL_SCHEMA, "description": "Add"}}]
    assert chat["tool_choice"] == "required" and chat["stop"] == ["END"]
    assert chat["max_tokens"] == 20 and chat["temperature"] == 0.5


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 100},
      "messages": [{"role": "user", "content": "hi"}]}, "thinking"),
    ({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "hi"}]}, "tools[0].type"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    # a string, not a list: taken whole it would stop at any of its letters
    ({"max_tokens": 5, "stop_sequences": "END", "messages": [{"role": "user", "content": "hi"}]},
     "stop_sequences"),
    ({"max_tokens": 5, "stop_sequences": ["END", 3],
      "messages": [{"role": "user", "content": "hi"}]}, "stop_sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": [{"type": "tool_use", "name": "add", "input": {}}]}]},
     "messages[1].content[0].id"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}]},
     "messages[1].content[0].name"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "7"}]}]}, "messages[0].content[0].tool_use_id"),
])
def test_what_messages_cannot_serve_is_a_400_naming_it(body, param):
    with pytest.raises(GatewayError) as err:
        Messages().to_chat(body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("thinking", [{"type": "disabled"}, {"type": "adaptive"}])
def test_thinking_the_model_may_skip_is_served_without_it(thinking):
    chat = Messages().to_chat({"max_tokens": 5, "thinking": thinking,
                               "messages": [{"role": "user", "content": "hi"}]})
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "thinking" not in chat


def test_messages_keep_the_meaning_of_their_options():
    user = {"role": "user", "content": "3+4?"}
    tools = [{"name": "add", "input_schema": TOOL_SCHEMA}]
    chat = Messages().to_chat({"max_tokens": 5, "messages": [user], "tools": tools,
                               "tool_choice": {"type": "auto",
                                               "disable_parallel_tool_use": True}})
    assert chat["parallel_tool_calls"] is False and chat["tool_choice"] == "auto"
    chat = Messages().to_chat({"max_tokens": 5, "messages": [user], "tools": tools,
                               "tool_choice": {"type": "auto"}})
    assert "parallel_tool_calls" not in chat  # the model's default: several calls allowed
    # a last assistant message is a prefill: the answer continues it, in the same turn
    chat = Messages().to_chat({"max_tokens": 5, "messages": [
        user, {"role": "assistant", "content": [{"type": "text", "text": "The sum is"}]}]})
    assert chat["messages"][-1] == {"role": "assistant", "content": "The sum is"}
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    chat = Messages().to_chat({"max_tokens": 5, "messages": [user]})
    assert "continue_final_message" not in chat and "add_generation_prompt" not in chat


def test_text_blocks_are_joined_as_vllm_joins_text_parts():
    """Several text blocks (Claude Code's system prompt, a reminder beside the user's
    text) are one text each: joined with newlines, not glued together."""
    blocks = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be exact."}]
    chat = Messages().to_chat({"max_tokens": 5, "system": blocks, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "text", "text": "there"}]}]})
    assert chat["messages"] == [{"role": "system", "content": "You are terse.\nBe exact."},
                                {"role": "user", "content": "hi\nthere"}]
    chat = Responses().to_chat({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]})
    assert chat["messages"][-1] == {"role": "user", "content": "a\nb"}


def test_anthropic_structured_outputs_are_served_constrained():
    """``messages.parse(output_format=...)`` of the anthropic SDK: the schema goes to the
    chat route as its response_format (constrained, captured as such), and the SDK parses
    the answer."""
    import anthropic
    import httpx2
    from pydantic import BaseModel

    class Answer(BaseModel):
        x: int

    seen: dict = {}

    def handler(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        seen["chat"] = Messages().to_chat(body)
        chat = {"id": "chatcmpl-1", "model": "m", "choices": [{
            "finish_reason": "stop", "message": {"content": '{"x": 3}'}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 4}}
        return httpx2.Response(200, json=Messages().answer(chat, body))

    client = anthropic.Anthropic(base_url="http://gateway/rollout/r", api_key="k",
                                 max_retries=0, http_client=httpx2.Client(
                                     transport=httpx2.MockTransport(handler)))
    out = client.messages.parse(model="m", max_tokens=20, output_format=Answer,
                                messages=[{"role": "user", "content": "x?"}])
    assert out.parsed_output == Answer(x=3)
    fmt = seen["chat"]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["properties"]["x"]["type"] == "integer"
    # the earlier beta's top-level field, the same; a format not served is a 400 naming it
    schema = {"type": "object", "properties": {"y": {"type": "string"}}}
    chat = Messages().to_chat({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}],
                               "output_format": {"type": "json_schema", "schema": schema}})
    assert chat["response_format"]["json_schema"]["schema"] == schema
    with pytest.raises(GatewayError) as err:
        Messages().to_chat({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}],
                            "output_config": {"format": {"type": "regex"}}})
    assert err.value.param == "output_config.format"
    with pytest.raises(GatewayError) as err:  # a prefill: the grammar would start mid-answer
        Messages().to_chat({"max_tokens": 5, "output_format": {"type": "json_schema",
                                                               "schema": schema},
                            "messages": [{"role": "user", "content": "a"},
                                         {"role": "assistant", "content": "{"}]})
    assert err.value.param == "output_format"


def test_a_chat_answer_becomes_a_message():
    chat = {"id": "chatcmpl-9", "model": "m", "usage": {"prompt_tokens": 7,
                                                         "completion_tokens": 3},
            "choices": [{"finish_reason": "tool_calls", "message": {
                "content": "Let me add.", "tool_calls": [
                    {"id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}}]}}]}
    msg = Messages().answer(chat, {})
    assert msg["id"] == "msg_9" and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"] == [{"type": "text", "text": "Let me add."},
                              {"type": "tool_use", "id": "c1", "name": "add",
                               "input": {"a": 1}}]
    assert msg["stop_reason"] == "tool_use"
    assert msg["usage"] == {"input_tokens": 7, "output_tokens": 3}
    length = {"choices": [{"finish_reason": "length", "message": {"content": "x"}}]}
    assert Messages().answer(length, {})["stop_reason"] == "max_tokens"
    stopped = {"choices": [{"finish_reason": "stop", "stop_reason": "END",
                            "message": {"content": "x"}}]}
    out = Messages().answer(stopped, {"stop_sequences": ["END"]})
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "END")


def test_a_chat_stream_becomes_messages_events():
    stream = Messages().stream({})
    raw = []
    for chunk in chat_chunks({"content": "Hi"}, {"content": " there"},
                             {"tool_calls": [{"index": 0, "id": "c1", "function": {
                                 "name": "add", "arguments": '{"a":'}}]},
                             {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
                             finish="tool_calls"):
        raw.extend(stream.chunk(chunk))
    raw.extend(stream.done())
    got = events(raw)
    assert [k for k, _ in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]  # the arguments: one delta
    assert got[0][1]["message"]["usage"]["input_tokens"] == 5
    assert got[1][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    assert got[5][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "add",
                                          "input": {}}
    partial = "".join(b["delta"]["partial_json"] for k, b in got
                      if k == "content_block_delta" and b["index"] == 1)
    assert json.loads(partial) == {"a": 1}
    assert got[8][1]["delta"]["stop_reason"] == "tool_use"
    assert got[8][1]["usage"] == {"output_tokens": 4}


@pytest.mark.parametrize("arguments", ['"{\\"a\\": 1}"', "a=1", "[1, 2]", ""])
def test_streamed_tool_input_is_the_unstreamed_answers(arguments):
    """A small model's arguments may be a JSON string, or not JSON: the anthropic SDK
    accumulates the streamed input as the unstreamed answer has it, instead of another
    value (a string) or a parse error."""
    from anthropic._models import construct_type
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent

    whole = Messages().answer({"choices": [{"finish_reason": "tool_calls", "message": {
        "tool_calls": [{"id": "c1", "function": {"name": "add",
                                                 "arguments": arguments}}]}}]}, {})
    stream = Messages().stream({})
    raw = [b for c in chat_chunks(
        {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "add",
                                                               "arguments": arguments[:3]}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": arguments[3:]}}]},
        finish="tool_calls") for b in stream.chunk(c)] + list(stream.done())
    snapshot, buffers = None, {}
    for _, body in events(raw):
        event = construct_type(type_=RawMessageStreamEvent, value=body)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot.content[0].input == whole["content"][0]["input"]


def test_anthropic_error_types():
    assert error_body(GatewayError(503, "paused", code="paused"))["error"]["type"] == \
        "overloaded_error"
    assert error_body(GatewayError(429, "busy"))["error"]["type"] == "rate_limit_error"
    assert error_body(GatewayError(401, "no"))["error"]["type"] == "authentication_error"
    body = error_body(GatewayError(400, "too long", code="context_length_exceeded"))
    assert body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "context_length_exceeded: too long"}}


# --- OpenAI Responses ------------------------------------------------------------------

def test_responses_input_items_become_chat_messages():
    chat = Responses().to_chat({
        "model": "x", "instructions": "be brief", "max_output_tokens": 30,
        "tools": [{"type": "function", "name": "add", "parameters": TOOL_SCHEMA,
                   "strict": True}],
        "tool_choice": {"type": "function", "name": "add"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": TOOL_SCHEMA}},
        "store": False, "include": [], "truncation": "disabled",
        "input": [
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "input_text", "text": "3+4?"}]},
            {"type": "reasoning", "id": "r1", "summary": []},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "adding"}]},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":3}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a":4}'},
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
            {"type": "function_call_output", "call_id": "c2", "output": "4"}]})
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        # kept as the agent wrote it: vLLM makes it a system message for a template that
        # does not name the role, and then merges the system messages into one, first
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "3+4?"},
        {"role": "assistant", "content": "adding", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a":3}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "add", "arguments": '{"a":4}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "4"}]
    assert chat["max_tokens"] == 30
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["tools"][0]["function"]["strict"] is True
    # a forced call: the tool's schema holds the answer, not the text format
    assert "response_format" not in chat
    chat = Responses().to_chat({"input": "3+4?", "text": {"format": {
        "type": "json_schema", "name": "out", "schema": TOOL_SCHEMA}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "out", "schema": TOOL_SCHEMA}}


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),  # its own name
    ({"input": "hi", "max_output_tokens": "5"}, "max_output_tokens"),
    # written into the prompt as Python's repr, or as the word None, they were not refused
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": {"a": 1}}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
     "input[0].name"),
    ({"input": [{"type": "function_call_output", "output": "3"}]}, "input[0].call_id"),
    ({"input": "hi", "instructions": ["be", "brief"]}, "instructions"),
])
def test_what_responses_cannot_serve_is_a_400_naming_it(body, param):
    with pytest.raises(GatewayError) as err:
        Responses().to_chat(body)
    assert err.value.status == 400 and err.value.param == param


def test_a_chat_answer_becomes_a_response():
    chat = {"model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                    "total_tokens": 10},
            "choices": [{"finish_reason": "tool_calls", "message": {
                "content": "ok", "tool_calls": [
                    {"id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}}]}}]}
    resp = Responses().answer(chat, {"instructions": "x"})
    assert resp["object"] == "response" and resp["status"] == "completed"
    assert resp["id"].startswith("resp_") and resp["instructions"] == "x"
    message, call = resp["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "ok"
    assert call["type"] == "function_call" and call["call_id"] == "c1"
    assert call["name"] == "add" and call["arguments"] == '{"a": 1}'
    assert resp["usage"]["input_tokens"] == 7 and resp["usage"]["total_tokens"] == 10
    cut = Responses().answer({"choices": [{"finish_reason": "length",
                                           "message": {"content": "x"}}]}, {})
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_chat_stream_becomes_responses_events():
    stream = Responses().stream({})
    raw = []
    for chunk in chat_chunks({"content": "Hi"}, {"content": "!"},
                             {"tool_calls": [{"index": 0, "id": "c1", "function": {
                                 "name": "add", "arguments": '{"a": 1}'}}]},
                             finish="tool_calls"):
        raw.extend(stream.chunk(chunk))
    raw.extend(stream.done())
    got = events(raw)
    assert [k for k, _ in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [b["sequence_number"] for _, b in got] == list(range(len(got)))
    assert got[6][1]["text"] == "Hi!"
    final = got[-1][1]["response"]
    assert final["status"] == "completed" and len(final["output"]) == 2
    assert final["output"][0]["content"][0]["text"] == "Hi!"
    assert final["output"][1]["arguments"] == '{"a": 1}'
    assert final["output"][1]["status"] == "completed"


def test_text_between_streamed_tool_calls_is_not_shown():
    """vLLM's streamed tool parser passes on the newline the model writes between two
    calls; its whole answer drops it. Shown, it became a message item (a text block)
    between the calls, and an agent echoing the turn back split it in two."""
    def call(k: int, arguments: str) -> dict:
        return {"tool_calls": [{"index": k, "id": f"c{k}", "type": "function",
                                "function": {"name": "add", "arguments": arguments}}]}

    chunks = chat_chunks({"content": "adding"}, call(0, '{"a": 1}'), {"content": "\n"},
                         call(1, '{"a": 2}'), {"content": "\n"}, finish="tool_calls")
    stream = Responses().stream({})
    raw = [b for c in chunks for b in stream.chunk(c)] + list(stream.done())
    final = events(raw)[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "adding"
    stream = Messages().stream({})
    raw = [b for c in chunks for b in stream.chunk(c)] + list(stream.done())
    starts = [body["content_block"]["type"] for kind, body in events(raw)
              if kind == "content_block_start"]
    assert starts == ["text", "tool_use", "tool_use"]
    texts = [body["delta"]["text"] for kind, body in events(raw)
             if kind == "content_block_delta" and body["delta"]["type"] == "text_delta"]
    assert texts == ["adding"]


@pytest.mark.parametrize("finish, stop_reason, status", [
    ("abort", None, "cancelled"), ("length", "max_tokens", "incomplete"),
    ("stop", "end_turn", "completed")])
def test_an_answer_that_ended_short_is_not_reported_as_a_normal_end(finish, stop_reason,
                                                                    status):
    """An answer cut by an engine pause the gateway did not carry on (an operator's
    ``/pause?mode=abort``) is no normal end: no stop reason in Messages, "cancelled" in
    Responses, as vLLM's own routes report it. The item cut is the one marked so, the same
    in its output_item.done event as in the final response."""
    chat = {"choices": [{"finish_reason": finish, "message": {"content": "partial"}}]}
    assert Messages().answer(chat, {})["stop_reason"] == stop_reason
    whole = Responses().answer(chat, {})
    assert whole["status"] == status
    assert whole["output"][-1]["status"] == ("completed" if status == "completed"
                                             else "incomplete")
    chunks = chat_chunks({"content": "part"}, {"content": "ial"}, finish=finish)
    stream = Messages().stream({})
    raw = [b for c in chunks for b in stream.chunk(c)] + list(stream.done())
    assert [b["delta"]["stop_reason"] for k, b in events(raw) if k == "message_delta"] == [
        stop_reason]
    stream = Responses().stream({})
    got = events([b for c in chunks for b in stream.chunk(c)] + list(stream.done()))
    done = [b["item"]["status"] for k, b in got if k == "response.output_item.done"]
    kind, final = got[-1]
    assert final["response"]["status"] == status
    assert done == [final["response"]["output"][-1]["status"]]
    assert kind == ("response.completed" if status == "completed" else "response.incomplete")


# --- through the SDKs' own stream accumulators ------------------------------------------

def vllm_stream(tool: bool, finish: str) -> list[dict]:
    """Chunks as vLLM streams them: a role chunk, text, a tool call's name then its
    arguments in pieces, the finish reason, a usage-only chunk."""
    base = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": "m"}

    def usage(n: int) -> dict:
        return {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n}

    out = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            "usage": usage(0)},
           {**base, "choices": [{"index": 0, "delta": {"content": "Sure."}}], "usage": usage(1)}]
    if tool:
        out += [{**base, "usage": usage(5), "choices": [{"index": 0, "delta": {"tool_calls": [
                    {"index": 0, "type": "function", "id": "call-1",
                     "function": {"name": "add"}},
                    {"index": 0, "function": {"arguments": '{"a": '}}]}}]},
                {**base, "usage": usage(8), "choices": [{"index": 0, "finish_reason": finish,
                                                         "delta": {"tool_calls": [
                    {"index": 0, "function": {"arguments": "1}"}}]}}]}]
    else:
        out.append({**base, "usage": usage(2), "choices": [
            {"index": 0, "delta": {"content": "!"}, "finish_reason": finish}]})
    return out + [{**base, "choices": [], "usage": usage(8)}]


def sse_events(raw: list[bytes]) -> list[dict]:
    return [json.loads(chunk.decode().split("\ndata: ", 1)[1]) for chunk in raw]


@pytest.mark.parametrize("tool, finish, stop_reason", [
    (True, "tool_calls", "tool_use"), (False, "stop", "end_turn"),
    (True, "length", "max_tokens"),  # a tool call cut off is not one to run
    (False, "length", "max_tokens")])
def test_the_anthropic_sdk_accumulates_the_stream(tool, finish, stop_reason):
    from anthropic._models import construct_type
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent

    stream = Messages().stream({})
    raw = [b for c in vllm_stream(tool, finish) for b in stream.chunk(c)] + list(stream.done())
    message, buffers = None, {}
    for data in sse_events(raw):
        event = construct_type(type_=RawMessageStreamEvent, value=data)
        message = accumulate_event(event=event, current_snapshot=message, json_bufs=buffers)
    assert message.stop_reason == stop_reason
    assert message.content[0].type == "text" and message.content[0].text == \
        ("Sure." if tool else "Sure.!")
    if tool:
        assert message.content[1].type == "tool_use" and message.content[1].name == "add"
        assert message.content[1].input == {"a": 1}
    assert message.usage.input_tokens == 11 and message.usage.output_tokens == 8


@pytest.mark.parametrize("tool, finish, status", [
    (True, "tool_calls", "completed"), (False, "stop", "completed"),
    (False, "length", "incomplete")])
def test_the_openai_sdk_accumulates_the_responses_stream(tool, finish, status):
    from openai import omit
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"},
              "strict": False}]
    stream = Responses().stream({"tools": tools})
    raw = [b for c in vllm_stream(tool, finish) for b in stream.chunk(c)] + list(stream.done())
    state = ResponseStreamState(input_tools=tools, text_format=omit)
    seen = [e for data in sse_events(raw)
            for e in state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))]
    # OpenAI ends a stream cut at max_output_tokens with response.incomplete (the SDK's
    # get_final_response() then raises, as it does against OpenAI)
    assert seen[-1].type == f"response.{status}"
    final = seen[-1].response
    assert final.status == status
    assert final.output_text == ("Sure." if tool else "Sure.!")
    if tool:
        call = final.output[1]
        assert call.type == "function_call" and call.name == "add"
        assert json.loads(call.arguments) == {"a": 1} and call.call_id == "call-1"


def test_a_responses_stream_error_is_one_the_openai_sdk_raises():
    """The openai SDK raises APIError at an event whose data holds an "error" object (before
    its stream state needs a response.created)."""
    err = GatewayError(503, "request cancelled by a weight update", code="cancelled_by_update")
    data = sse_events([Responses().stream({}).error(err)])[0]
    assert data["type"] == "error" and data["error"]["message"] == err.message
    assert data["code"] == "cancelled_by_update"


# --- what both protocols share ---------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}}
RESPONSES_FORMAT = {"format": {"type": "json_schema", "name": "out", "schema": SCHEMA}}


@pytest.mark.parametrize("choice, applied", [(None, False), ("auto", False), ("none", True)])
def test_a_structured_output_with_tools_leaves_the_model_free_to_call_them(choice, applied):
    """OpenAI and Anthropic hold the final text answer to the format and still let the
    model call a tool (the OpenAI Agents SDK sends both for an agent with an output type
    and tools); vLLM would hold every token to it, so no call could ever be made. Under
    tool_choice auto the format is therefore not sent; with tool_choice none, or no
    tools, it is."""
    tools = [{"type": "function", "name": "add", "parameters": TOOL_SCHEMA}]
    body = {"input": "3+4?", "tools": tools, "text": RESPONSES_FORMAT}
    if choice is not None:
        body["tool_choice"] = choice
    chat = Responses().to_chat(body)
    assert ("response_format" in chat) is applied
    assert "response_format" in Responses().to_chat({"input": "3+4?",
                                                     "text": RESPONSES_FORMAT})
    msg = {"max_tokens": 9, "messages": [{"role": "user", "content": "3+4?"}],
           "tools": [{"name": "add", "input_schema": TOOL_SCHEMA}],
           "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    if choice is not None:
        msg["tool_choice"] = {"type": choice}
    assert ("response_format" in Messages().to_chat(msg)) is applied
    del msg["tools"]
    msg.pop("tool_choice", None)
    assert "response_format" in Messages().to_chat(msg)


@pytest.mark.parametrize("strict, grammar, kept", [
    (True, ToolGrammar("hermes"), True),
    (False, ToolGrammar("hermes"), False),
    (False, ToolGrammar("hermes", "function"), True),
    (True, ToolGrammar(None), False),
])
def test_a_structured_output_is_kept_where_the_tool_grammar_offers_a_call_beside_it(
        strict, grammar, kept):
    """Under tool_choice auto, a strict tool (the OpenAI Agents SDK's default) or a strict
    level above auto makes vLLM's tool parser sample a call or an answer in the format: the
    format is sent, as the providers apply it. Without that grammar it would shut calls out,
    so it is not."""
    tool = {"type": "function", "name": "add", "parameters": TOOL_SCHEMA, "strict": strict}
    chat = Responses().to_chat({"input": "3+4?", "tools": [tool], "text": RESPONSES_FORMAT},
                               grammar)
    assert ("response_format" in chat) is kept
    msg = {"max_tokens": 9, "messages": [{"role": "user", "content": "3+4?"}],
           "tools": [{"name": "add", "input_schema": TOOL_SCHEMA, "strict": strict}],
           "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    assert ("response_format" in Messages().to_chat(msg, grammar)) is kept
    # a forced call is the answer: the format is not sent beside it
    forced = Responses().to_chat({"input": "3+4?", "tools": [tool], "text": RESPONSES_FORMAT,
                                  "tool_choice": "required"}, grammar)
    assert "response_format" not in forced


def test_a_context_overflow_is_worded_as_each_provider_words_it():
    """The Messages API refuses input + max_tokens past the context window in its own words
    (clients such as Claude Code read them and ask again with fewer tokens), and names no
    field; the Responses API's field is input, its limit max_output_tokens."""
    err = Messages().overflow(7000, 32000, 8192)
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert "input length and `max_tokens` exceed context limit: 7000 + 32000 > 8192" \
        in error_body(err)["error"]["message"]
    assert "prompt is too long: 9000 tokens > 8192 maximum" in \
        error_body(Messages().overflow(9000, 10, 8192))["error"]["message"]
    err = Responses().overflow(7000, 32000, 8192)
    assert err.param == "input" and "max_output_tokens" in err.message


def test_chat_template_kwargs_go_on_as_on_the_chat_route():
    """An SDK's ``extra_body={"chat_template_kwargs": {"enable_thinking": False}}`` (Qwen3)
    was dropped on both routes; it renders the prompt, so it goes on as it came."""
    kwargs = {"enable_thinking": False}
    assert Responses().to_chat({"input": "hi", "chat_template_kwargs": kwargs})[
        "chat_template_kwargs"] == kwargs
    assert Messages().to_chat({"max_tokens": 5, "chat_template_kwargs": kwargs,
                               "messages": [{"role": "user", "content": "hi"}]})[
        "chat_template_kwargs"] == kwargs
    with pytest.raises(GatewayError) as err:
        Responses().to_chat({"input": "hi", "chat_template_kwargs": "no"})
    assert err.value.param == "chat_template_kwargs"


def test_a_reasoning_effort_goes_on_as_the_chat_routes():
    """The Agents SDK's ``ModelSettings(reasoning=Reasoning(effort=...))`` and Anthropic's
    ``output_config.effort`` render the prompt of a model whose template reads it: they go
    on as ``reasoning_effort``, as vLLM's own routes make them, not dropped."""
    assert Responses().to_chat({"input": "hi", "reasoning": {"effort": "low",
                                                             "summary": "auto"}})[
        "reasoning_effort"] == "low"
    assert "reasoning_effort" not in Responses().to_chat({"input": "hi", "reasoning": {}})
    assert Messages().to_chat({"max_tokens": 5, "output_config": {"effort": "high"},
                               "messages": [{"role": "user", "content": "hi"}]})[
        "reasoning_effort"] == "high"
    for body, param in (({"input": "hi", "reasoning": {"effort": "lots"}}, "reasoning.effort"),
                        ({"input": "hi", "reasoning": "low"}, "reasoning")):
        with pytest.raises(GatewayError) as err:
            Responses().to_chat(body)
        assert err.value.status == 400 and err.value.param == param
    with pytest.raises(GatewayError) as err:
        Messages().to_chat({"max_tokens": 5, "output_config": {"effort": 3},
                            "messages": [{"role": "user", "content": "hi"}]})
    assert err.value.param == "output_config.effort"
