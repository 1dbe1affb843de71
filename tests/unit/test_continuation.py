"""The pure half of carrying on calls a weight update cut (gateway.drain_mode continue)."""

from __future__ import annotations

import pytest

from gateway import continuation as cont

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {}}}]


@pytest.mark.parametrize(("body", "why"), [
    ({}, None),
    ({"n": 1, "tools": TOOLS}, None),            # not streamed, hermes: the markup is known
    ({"n": 2}, "n > 1"),
    ({"prompt": ["a", "b"]}, "a batch of prompts"),
    ({"prompt": [1, 2]}, None),
    ({"response_format": {"type": "json_object"}}, "constrained decoding (response_format)"),
    ({"tools": TOOLS, "tool_choice": "required"}, "constrained decoding (tool_choice)"),
    ({"tools": TOOLS, "stream": True}, "tools in a streamed call"),
])
def test_which_calls_can_be_carried_on(body, why):
    assert cont.refusal(body, "hermes") == why


def test_tools_with_a_parser_whose_markup_is_unknown_are_not_carried_on():
    assert cont.refusal({"tools": TOOLS}, "mistral") == "tools with the 'mistral' parser"
    assert cont.refusal({}, "mistral") is None


def test_a_cut_inside_a_tool_calls_markup_is_seen():
    def answer(content, calls=None):
        return {"choices": [{"message": {"content": content, "tool_calls": calls},
                             "finish_reason": "abort"}]}
    assert not cont.cut_in_call(answer("Let me add"), "hermes")
    assert cont.cut_in_call(answer('Sure. <tool_call>{"name": "ad'), "hermes")
    assert cont.cut_in_call(answer("", [{"id": "c"}]), "hermes")
    # a tokenizer without a token for the marker spells it in pieces: a cut inside it
    for half in ("<t", "<tool", "<tool_call"):
        assert cont.cut_in_call(answer(f"Sure. {half}"), "hermes"), half
    assert not cont.cut_in_call(answer("Sure. <b>bold</b>"), "hermes")
    assert not cont.cut_in_call(answer("x <"), "hermes")  # a lone "<" is text far more often


def test_the_continuation_asks_for_what_is_left_from_the_ids_so_far():
    body = {"prompt": "hi", "max_tokens": 10, "temperature": 1.0}
    out = cont.resend_body(body, "completions", [1, 2], [7, 8, 9])
    assert out == {"prompt": [1, 2, 7, 8, 9], "max_tokens": 7, "temperature": 1.0}
    assert body["max_tokens"] == 10  # the agent's request is left as it was
    chat = cont.resend_body({"messages": [], "max_completion_tokens": 4,
                             "kv_transfer_params": {"x": 1}}, "chat.completions", [1], [5])
    assert chat["max_completion_tokens"] == 3
    assert chat["kv_transfer_params"] == {"x": 1, "prompt_token_ids": [1, 5]}
    # cut at its last allowed token: nothing to send, it ends by length
    assert cont.resend_body({"max_tokens": 3}, "completions", [1], [5, 6, 7]) is None
    done = cont.ended_by_length({"choices": [{"finish_reason": "abort"}]})
    assert done["choices"][0]["finish_reason"] == "length"


def test_a_cut_answer_and_its_continuation_make_one_answer():
    first = {"id": "a", "choices": [{"index": 0, "token_ids": [5, 6],
                                     "message": {"role": "assistant", "content": "he"},
                                     "logprobs": {"content": [{"logprob": -1.0},
                                                              {"logprob": -2.0}]},
                                     "finish_reason": "abort"}],
             "prompt_token_ids": [1, 2],
             "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}}
    more = {"id": "b", "choices": [{"index": 0, "token_ids": [7],
                                    "message": {"role": "assistant", "content": "llo"},
                                    "logprobs": {"content": [{"logprob": -3.0}]},
                                    "finish_reason": "stop"}],
            "prompt_token_ids": [1, 2, 5, 6],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
    out = cont.merge(first, more, "chat.completions")
    choice = out["choices"][0]
    assert out["id"] == "a" and out["prompt_token_ids"] == [1, 2]
    assert choice["token_ids"] == [5, 6, 7] and choice["message"]["content"] == "hello"
    assert [x["logprob"] for x in choice["logprobs"]["content"]] == [-1.0, -2.0, -3.0]
    assert choice["finish_reason"] == "stop"
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert first["choices"][0]["token_ids"] == [5, 6]  # the inputs are left as they were

    text = cont.merge(
        {"choices": [{"text": "a", "token_ids": [5], "finish_reason": "abort",
                      "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0],
                                   "top_logprobs": [{"a": -1.0}], "text_offset": [0]}}]},
        {"choices": [{"text": "bc", "token_ids": [6, 7], "finish_reason": "length",
                      "logprobs": {"tokens": ["b", "c"], "token_logprobs": [-2.0, -3.0],
                                   "top_logprobs": [{"b": -2.0}, {"c": -3.0}],
                                   "text_offset": [0, 1]}}]},
        "completions")["choices"][0]
    assert text["text"] == "abc" and text["logprobs"]["token_logprobs"] == [-1.0, -2.0, -3.0]
    assert text["logprobs"]["tokens"] == ["a", "b", "c"] and text["finish_reason"] == "length"
    # vLLM counts a continuation's offsets from its own text: shifted past the first part's
    assert text["logprobs"]["text_offset"] == [0, 1, 2]


def test_the_agent_never_sees_the_abort_in_a_stream():
    chunk = {"choices": [{"index": 0, "text": "o", "finish_reason": "abort"}]}
    assert cont.aborted(chunk)
    shown = cont.without_abort(chunk)
    assert shown["choices"][0] == {"index": 0, "text": "o", "finish_reason": None}
    assert not cont.aborted(shown) and cont.aborted(chunk)


def test_a_continuations_chunks_count_as_the_whole_call():
    chunk = {"prompt_token_ids": [1, 2, 7, 8],
             "choices": [{"index": 0, "text": "x", "prompt_token_ids": [1, 2, 7, 8]}],
             "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
    assert cont.sent_prompt(chunk) == [1, 2, 7, 8]
    out = cont.as_part_of_call(chunk, 2)
    assert "prompt_token_ids" not in out and "prompt_token_ids" not in out["choices"][0]
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    # a streamed continuation's offsets go on from the text the call had before the cut
    chunk["choices"][0]["logprobs"] = {"tokens": ["x"], "token_logprobs": [-1.0],
                                       "top_logprobs": [{}], "text_offset": [0]}
    out = cont.as_part_of_call(chunk, 2, text_done=5)
    assert out["choices"][0]["logprobs"]["text_offset"] == [5]
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [0]  # the input left as it was


def test_only_the_pause_that_marked_itself_carries_calls_on(redis_client):
    from app.state import keys

    r, paused, mark = redis_client, keys.paused(), keys.pause_carries_on()
    r.mset({paused: "t1", mark: "t1"})
    assert cont.carries_on(r)
    r.set(paused, "t2")
    assert not cont.carries_on(r)  # taken over since
    r.set(paused, "t1")
    r.delete(mark)
    assert not cont.carries_on(r)  # an operator's pause
    r.set(mark, "t1")
    r.delete(paused)
    assert cont.carries_on(r)  # the pause just ended: its cut answers read late
    r.delete(mark)
    assert not cont.carries_on(r)  # and once its mark is gone


def test_waiting_for_the_resume_ends_with_the_pause_or_the_lease(redis_client):
    import threading

    from app.state import keys
    from gateway.leases import UpstreamCancelled

    cont.wait_for_resume(redis_client, threading.Event(), 1.0)  # not paused: at once
    redis_client.set(keys.paused(), "t")
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(UpstreamCancelled):
        cont.wait_for_resume(redis_client, cancel, 1.0, poll_s=0.01)
    with pytest.raises(TimeoutError):
        cont.wait_for_resume(redis_client, threading.Event(), 0.05, poll_s=0.01)
    redis_client.delete(keys.paused())


def test_an_answer_with_reasoning_is_not_carried_on():
    """A continuation's answer is parsed without its first part: past the end of the
    reasoning, vLLM's parser would return the whole tail as reasoning, and the answer (and
    any tool call in it) was lost. Such a call is retried by its agent instead."""
    import threading
    from types import SimpleNamespace

    from gateway.carry_on import CarryOn

    state = SimpleNamespace(settings=SimpleNamespace(tool_call_parser="hermes",
                                                     retry_after_s=1.0))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    carry = CarryOn(state, "r", "lease", threading.Event(), "chat.completions", body)
    plain = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "The an"},
                          "finish_reason": "abort", "token_ids": [1, 2]}]}
    assert carry.refusal(plain) is None
    for key in ("reasoning", "reasoning_content"):
        thought = {"choices": [{**plain["choices"][0], "message": {
            "role": "assistant", "content": "The an", key: "Two and two"}}]}
        refused = carry.refusal(thought)
        assert refused is not None and refused.code == "cancelled_by_update", key
        # a stream's: in its deltas (the accumulated answer keeps no reasoning)
        assert cont.reasoned({"choices": [{"index": 0, "delta": {key: "Two"}}]})
    assert not cont.reasoned({"choices": [{"index": 0, "delta": {"reasoning": None,
                                                                 "content": "x"}}]})
