"""The messages as vLLM hands them to a chat template: what the gateway's own renderings (the
context-length count, token continuity) give the template."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.rendering import TemplateInput, content_format
from tests.conftest import REPO

STRING = "{% for m in messages %}<{{ m.role }}>{{ m['content'] | trim }}{% endfor %}"
PARTS = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
         "{% for part in m['content'] %}{{ part.text }}{% endfor %}{% endif %}{% endfor %}")
NAMED = ("{% for message in messages %}{% set content = message.content %}"
         "{% for item in content %}{{ item.text }}{% endfor %}{% endfor %}")


@pytest.mark.parametrize("template, fmt", [
    (STRING, "string"), (PARTS, "openai"), (NAMED, "openai"),
    ((REPO / "config" / "templates" / "smollm2-tools.jinja").read_text(), "string"),
    ("{% for m in messages %}{{ m.content", "string"),  # does not parse: vLLM's default
    # transformers' own tag parses (its environment)
    ("{% for m in messages %}{% generation %}{% for p in m.content %}{{ p.text }}{% endfor %}"
     "{% endgeneration %}{% endfor %}", "openai"),
    (None, "string"),
])
def test_the_content_format_is_the_one_vllm_detects(template, fmt):
    assert content_format(template) == fmt


def test_text_parts_are_joined_for_a_template_that_takes_a_string():
    convert = TemplateInput(SimpleNamespace(chat_template=STRING))
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert convert([{"role": "user", "content": parts},
                    {"role": "assistant", "content": None}]) == [
        {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]


def test_text_parts_stay_a_list_for_a_template_that_loops_over_them_except_a_tools():
    convert = TemplateInput(SimpleNamespace(chat_template=PARTS))
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert convert([{"role": "user", "content": parts},
                    {"role": "tool", "tool_call_id": "c", "content": parts}]) == [
        {"role": "user", "content": parts},
        {"role": "tool", "tool_call_id": "c", "content": "a\nb"}]


def test_a_plain_string_is_one_text_part_for_a_template_that_loops_over_parts():
    """A Gemma-3-style template takes a string or a list, and raises on a null content,
    which an assistant's tool call has: vLLM gives it parts, and so does the gateway."""
    convert = TemplateInput(SimpleNamespace(chat_template=PARTS))
    assert convert([{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]}]) == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [], "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]


def test_a_developer_message_is_a_system_one_unless_the_template_names_the_role():
    msg = [{"role": "developer", "content": "be brief"}]
    assert TemplateInput(SimpleNamespace(chat_template=STRING))(msg)[0]["role"] == "system"
    named = STRING + "{% if m.role == 'developer' %}{% endif %}"
    assert TemplateInput(SimpleNamespace(chat_template=named))(msg)[0]["role"] == "developer"
    # converted, every system message is merged into one, first (some templates refuse
    # a system message anywhere else), as vLLM does
    later = [{"role": "system", "content": "A"}, {"role": "user", "content": "u"},
             {"role": "developer", "content": [{"type": "text", "text": "B"}]}]
    assert TemplateInput(SimpleNamespace(chat_template=STRING))(later) == [
        {"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "u"}]


def test_an_assistants_reasoning_is_given_under_both_names():
    convert = TemplateInput(SimpleNamespace(chat_template=STRING))
    out = convert([{"role": "assistant", "content": "x", "reasoning_content": "think"}])
    assert out[0]["reasoning"] == out[0]["reasoning_content"] == "think"


def test_tool_call_arguments_are_given_as_an_object():
    convert = TemplateInput(SimpleNamespace(chat_template=STRING))

    def call(arguments):
        return {"id": "c", "type": "function",
                "function": {"name": "add", "arguments": arguments}}

    out = convert([{"role": "assistant", "content": None,
                    "tool_calls": [call('{"a": 1}'), call("not json"), call("[1]"),
                                   call("")]}])
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == [{"a": 1}, {}, {}, {}]
    # an empty list of calls is no call at all; the request's own message is not changed
    msgs = [{"role": "assistant", "content": "hi", "tool_calls": []}]
    assert convert(msgs) == [{"role": "assistant", "content": "hi"}]
    assert msgs[0]["tool_calls"] == []


def test_extra_template_inputs_are_vllms_for_a_reasoning_effort():
    from gateway.rendering import extra_template_inputs

    assert extra_template_inputs({"messages": []}) == {}
    assert extra_template_inputs({"reasoning_effort": "low"}) == {
        "reasoning_effort": "low", "enable_thinking": True}
    assert extra_template_inputs({"reasoning_effort": "none"}) == {
        "reasoning_effort": "none", "enable_thinking": False}
    # the agent's own enable_thinking stands
    assert extra_template_inputs({"reasoning_effort": "low",
                            "chat_template_kwargs": {"enable_thinking": False, "x": 1}}) == {
        "reasoning_effort": "low", "enable_thinking": False, "x": 1}
