"""config/templates/smollm2-tools.jinja: SmolLM2's own template where no tools are involved
(so serving with it changes nothing for a chat agent), and Hermes function calling where
they are."""

from __future__ import annotations

import pytest

from gateway.context import served_tokenizer
from tests.conftest import REPO, SMOLLM2

TEMPLATE = str(REPO / "config" / "templates" / "smollm2-tools.jinja")
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "a\nb"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""},
     {"role": "system", "content": "late"}],
]


@pytest.fixture(scope="module")
def tokenizers():
    assert (SMOLLM2 / "tokenizer.json").exists(), "scripts/setup.sh builds the model"
    return served_tokenizer(SMOLLM2), served_tokenizer(SMOLLM2, TEMPLATE)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_it_renders_as_the_models_own(tokenizers, conversation,
                                                     generation_prompt):
    own, tools = tokenizers
    assert tools.apply_chat_template(conversation, tokenize=False,
                                     add_generation_prompt=generation_prompt) == \
        own.apply_chat_template(conversation, tokenize=False,
                                add_generation_prompt=generation_prompt)


def test_tools_calls_and_results_in_the_hermes_format(tokenizers):
    _, tools = tokenizers
    spec = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    text = tools.apply_chat_template([
        {"role": "system", "content": "You add."},
        {"role": "user", "content": "3+4?"},
        {"role": "assistant", "content": "Adding.\n", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "7"},
        {"role": "tool", "tool_call_id": "c2", "content": None}],
        tools=spec, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou add.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    # content trimmed before the calls, as vLLM's hermes parser hands it back
    assert ('<|im_start|>assistant\nAdding.\n<tool_call>\n{"name": "add", "arguments": '
            '{"a": 3, "b": 4}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": '
            '{"a": 1, "b": 2}}\n</tool_call><|im_end|>\n') in text
    # consecutive tool results share one user turn
    assert ("<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
