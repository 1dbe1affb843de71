"""What the gateway checks in a request before it goes upstream, and the shape of the errors
it answers with: bad input is a 400 naming the field, never a 500."""

from __future__ import annotations

import pytest
from flask import Flask

from gateway.body import json_body
from gateway.errors import GatewayError, register_error_handlers
from gateway.forward import validate_body
from gateway.send import upstream_error

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra, param", [
    ({"stream": "yes"}, "stream"),
    ({"stream": True, "stream_options": "x"}, "stream_options"),
    ({"stream": True, "stream_options": ["include_usage"]}, "stream_options"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 17}, "n"),
])
def test_a_bad_field_is_a_400_naming_it(extra, param):
    with pytest.raises(GatewayError) as err:
        validate_body({**CHAT, **extra}, "chat.completions")
    assert err.value.status == 400 and err.value.param == param


def test_what_the_api_allows_passes():
    # null is the API's "not set" for stream and stream_options
    assert validate_body({**CHAT, "stream": None, "stream_options": None}, "chat.completions")
    assert validate_body({**CHAT, "stream": True, "stream_options": {"include_usage": True}},
                         "chat.completions")


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "cut \\ud83d"}]}',  # half an emoji
    b'{"x": "\\udc00"}',
])
def test_a_lone_surrogate_is_a_400_not_a_500(raw):
    """JSON may escape half of a UTF-16 pair (a tool's output cut inside an emoji); it is
    no text, and nothing downstream can encode it."""
    app = Flask(__name__)
    with app.test_request_context(data=raw, content_type="application/json"), \
            pytest.raises(GatewayError) as err:
        json_body()
    assert err.value.status == 400 and "surrogate" in err.value.message


@pytest.mark.parametrize("raw, says", [
    # NaN sends the body through the json module, which keeps the integer whole
    (b'{"t": NaN, "n": 123456789012345678901234567890}', "Integer exceeds 64-bit range"),
    (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
])
def test_what_cannot_be_sent_on_is_a_400(raw, says):
    app = Flask(__name__)
    with app.test_request_context(data=raw), pytest.raises(GatewayError) as err:
        json_body()
    assert err.value.status == 400 and says in err.value.message


def test_nan_still_reads():
    app = Flask(__name__)
    with app.test_request_context(data=b'{"temperature": NaN}'):
        assert json_body()["temperature"] != json_body()["temperature"]


def test_an_upstream_4xx_is_answered_in_openais_shape():
    # vLLM's own error fields: its exception's class name as the type, the status as an int
    err = upstream_error(400, b'{"error": {"message": "bad", "type": "BadRequestError", '
                              b'"param": null, "code": 400}}')
    assert err.status == 400 and err.message == "bad"
    assert err.type == "invalid_request_error" and err.code is None
    err = upstream_error(404, b'{"error": {"message": "no such model", '
                              b'"type": "NotFoundError", "code": 404}}')
    assert err.type == "not_found_error" and err.code is None
    err = upstream_error(400, b'{"error": {"message": "m", "type": "invalid_request_error", '
                              b'"code": "context_length_exceeded"}}')
    assert err.type == "invalid_request_error" and err.code == "context_length_exceeded"


@pytest.mark.parametrize("body", [b'{"error": null}', b"[1]", b"1", b"true", b'{"error": 3}',
                                  b"not json"])
def test_an_upstream_error_body_without_an_error_object_is_answered_by_its_status(body):
    # a server's error page, or JSON of another shape: the agent gets the status's error
    # (a 4xx kept, a 5xx as 502), never the gateway's own 500
    err = upstream_error(400, body)
    assert (err.status, err.message) == (400, "inference server answered 400")
    err = upstream_error(503, body)
    assert (err.status, err.code) == (502, "upstream_error")
    assert err.message == "inference server error: inference server answered 503"


def test_errors_under_the_messages_route_have_anthropics_shape():
    app = Flask(__name__)
    register_error_handlers(app)
    r = app.test_client().post("/rollout/r1/v1/messages/count_tokens", json={})
    assert r.status_code == 404
    assert r.get_json()["type"] == "error" and r.get_json()["error"]["type"] == "not_found_error"
    r = app.test_client().post("/rollout/r1/v1/chat/completions/x", json={})
    assert r.get_json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("part, param", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
     "messages[1].content[1].type"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     "messages[1].content[1].type"),
    ({"type": "file", "file": {"file_id": "f"}}, "messages[1].content[1].type"),
    ({"text": "no type"}, "messages[1].content[1].type"),  # vLLM refuses an untyped part too
])
def test_a_non_text_content_part_on_chat_is_a_400_naming_it(part, param):
    """An image's placeholder tokens would be captured without its pixels: the trainer
    could not score the call. Refused as the Messages and Responses routes refuse them."""
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, part]}]}
    with pytest.raises(GatewayError) as err:
        validate_body(body, "chat.completions")
    assert err.value.status == 400 and err.value.param == param
    assert "is not served (text only)" in err.value.message


def test_text_parts_of_every_kind_vllm_reads_pass():
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"},
             {"type": "output_text", "text": "c"}, {"type": "refusal", "refusal": "no"},
             "a plain string, as LangChain sends a tool's list of strings"]
    assert validate_body({"messages": [{"role": "assistant", "content": parts}]},
                         "chat.completions")


def test_echo_on_completions_is_a_400():
    """vLLM would put the prompt's ids at the head of the response's: the capture would
    train on the prompt as if sampled."""
    with pytest.raises(GatewayError) as err:
        validate_body({"prompt": "abc", "echo": True}, "completions")
    assert err.value.status == 400 and err.value.param == "echo"
    assert validate_body({"prompt": "abc", "echo": False}, "completions")
