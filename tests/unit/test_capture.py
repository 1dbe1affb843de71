"""What the gateway records of a call that spans a weight update (``gateway.drain_mode``
keep): start and end versions, and for a streamed call where the switch fell per choice."""

from __future__ import annotations

from gateway.capture import StreamAccumulator, calls_from_response


def chunk(index: int, ids: list[int], finish: str | None = None) -> dict:
    return {"choices": [{"index": index, "token_ids": ids, "finish_reason": finish,
                         "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]}


def test_a_streamed_call_records_where_each_choice_switched():
    acc = StreamAccumulator("completions")
    acc.add({"prompt_token_ids": [1, 2], **chunk(0, [5, 6, 7])})
    acc.add(chunk(1, [8]))
    acc.switch(4)                      # the engines resumed on version 4
    acc.add(chunk(0, [9], "length"))
    acc.add(chunk(1, [10, 11], "length"))
    calls = calls_from_response(acc.response(), "completions", 3, 1.0, "u", 0.0, stream=True,
                                version_end=4, switches=acc.switches)
    assert [(c.policy_version, c.policy_version_end) for c in calls] == [(3, 4), (3, 4)]
    assert [c.version_switches for c in calls] == [[[3, 4]], [[1, 4]]]
    assert [c.tokens_after_switch() for c in calls] == [1, 2]
    assert all(c.spans_update for c in calls)


def test_a_call_on_one_version_carries_no_switch():
    acc = StreamAccumulator("completions")
    acc.add(chunk(0, [5, 6], "stop"))
    (call,) = calls_from_response(acc.response(), "completions", 3, 1.0, "u", 0.0,
                                  stream=True, version_end=3, switches=acc.switches)
    assert (call.policy_version_end, call.version_switches) == (None, None)
    assert not call.spans_update and call.tokens_after_switch() == 0


def test_a_plain_call_that_spans_an_update_does_not_know_where():
    resp = {"choices": [{"index": 0, "token_ids": [5, 6, 7], "prompt_token_ids": [1],
                         "logprobs": {"token_logprobs": [-1.0] * 3}, "finish_reason": "length"}]}
    (call,) = calls_from_response(resp, "completions", 3, 1.0, "u", 0.0, version_end=5)
    assert (call.policy_version, call.policy_version_end, call.version_switches) == (3, 5, None)
    assert call.tokens_after_switch() is None
