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
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, None),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, None),  # no tools: nothing to constrain to
])
def test_constrained_by(body, name):
    assert constrained_by(body) == name


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
