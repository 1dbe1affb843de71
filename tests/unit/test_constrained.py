"""Which request parameters make vLLM sample under a grammar mask, and the importance
weights reported for the tokens sampled so."""

from __future__ import annotations

import pytest
import torch

from gateway.capture import constrained_by
from workers.trainer.algorithms import constrained_is_metrics

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("body,name", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"structured_outputs": {"regex": "[ab]+"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "auto"}, None),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, None),  # no tools: nothing to constrain to
])
def test_constrained_by(body, name):
    assert constrained_by(body) == name


STRICT = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                            "strict": True}}]


@pytest.mark.parametrize("body,level,name", [
    ({"tools": TOOLS, "tool_choice": "auto"}, "auto", None),
    ({"tools": TOOLS}, "auto", None),
    ({"tools": STRICT, "tool_choice": "auto"}, "auto", "tools"),   # the Agents SDK's default
    ({"tools": STRICT}, "auto", "tools"),
    ({"tools": STRICT, "tool_choice": "none"}, "auto", None),
    ({"tools": TOOLS, "parallel_tool_calls": False}, "auto", "parallel_tool_calls"),
    ({"tools": TOOLS, "parallel_tool_calls": True}, "auto", None),
    ({"tools": TOOLS}, "function", "tools"),
    ({"tools": TOOLS}, "parameter", "tools"),
])
def test_tool_choice_auto_is_constrained_where_vllms_parser_applies_its_grammar(body, level,
                                                                               name):
    """vLLM's tool-call parser masks a call's markup under tool_choice auto too, when a
    tool is strict, parallel_tool_calls is false, or the servers' strict level is raised."""
    assert constrained_by(body, "hermes", level) == name
    assert constrained_by(body) is None  # no tool-call parser: no grammar under auto


def test_under_auto_only_an_answer_that_called_a_tool_is_marked():
    from gateway.capture import calls_from_response

    def choice(i, calls):
        return {"index": i, "token_ids": [5], "finish_reason": "stop",
                "logprobs": {"content": [{"logprob": -1.0}]},
                "message": {"content": "x", "tool_calls": calls}}
    resp = {"prompt_token_ids": [1], "choices": [choice(0, None), choice(1, [{"id": "c"}])]}
    marked = [c.constrained for c in calls_from_response(
        resp, "chat.completions", 0, 1.0, "u", 0.0, constrained="tools")]
    assert marked == [None, "tools"]
    forced = [c.constrained for c in calls_from_response(
        resp, "chat.completions", 0, 1.0, "u", 0.0, constrained="tool_choice")]
    assert forced == ["tool_choice", "tool_choice"]


def test_constrained_is_metrics_cover_only_the_masked_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    constrained = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    weights = torch.tensor([[2.0, 2.0, 2.0], [0.5, 0.25, 0.75]])
    out = constrained_is_metrics(weights, mask, constrained)
    assert out["rollout_corr/constrained_token_fraction"] == pytest.approx(3 / 5)
    assert out["rollout_corr/constrained_is_mean"] == pytest.approx(0.5)
    assert constrained_is_metrics(weights, mask, None) == {}
    assert "rollout_corr/constrained_is_mean" not in constrained_is_metrics(
        None, mask, constrained)


@pytest.mark.parametrize("field, kind, value", [
    ("guided_json", "json", {"type": "object"}), ("guided_regex", "regex", "[ab]+"),
    ("guided_choice", "choice", ["yes", "no"]), ("guided_grammar", "grammar", 'root ::= "a"'),
])
def test_an_older_vllms_guided_field_goes_on_as_structured_outputs(field, kind, value):
    """vLLM 0.32 ignores the removed guided_* fields and samples freely; the agent meant a
    constraint, so it is sent as the structured_outputs field it became."""
    from gateway.forward import validate_body

    body = validate_body({"messages": [{"role": "user", "content": "hi"}], field: value,
                          "guided_decoding_backend": "xgrammar"}, "chat.completions")
    assert body["structured_outputs"] == {kind: value}
    assert not [k for k in body if k.startswith("guided_")]
    assert constrained_by(body) == "structured_outputs"


def test_two_constraints_at_once_are_a_400_naming_one():
    from gateway.errors import GatewayError
    from gateway.forward import validate_body

    for extra in ({"guided_regex": "a"}, {"structured_outputs": {"regex": "a"}}):
        with pytest.raises(GatewayError) as err:
            validate_body({"messages": [{"role": "user", "content": "hi"}],
                           "guided_json": {"type": "object"}, **extra}, "chat.completions")
        assert err.value.status == 400 and err.value.param == "guided_json"
