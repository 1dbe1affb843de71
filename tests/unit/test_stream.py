"""A streamed answer (``gateway.stream``) without services: scripted upstream answers, a fake
Redis for the policy version and the pause's mark, and a lease that keeps what it records.
The same paths against real servers: tests/faults/test_stream_cuts.py,
tests/integration/test_interruptible.py."""

from __future__ import annotations

import contextlib
import json
import threading
from types import SimpleNamespace

import orjson
import pytest
import redis

from app.state import cached_reads, keys
from gateway.capture import CallMeta
from gateway.carry_on import CarryOn
from gateway.protocols import OPENAI
from gateway.stream import AnswerStream
from gateway.upstream import UpstreamUnreachable

PROMPT = [1, 2, 3]
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "stream": True, "return_token_ids": True, "logprobs": True, "temperature": 1.0}
DONE = b"data: [DONE]\n"


def chunk(text: str, ids: list[int], finish: str | None = None,
          prompt: list[int] | None = None) -> bytes:
    c = {"id": "c1", "choices": [{"index": 0, "delta": {"content": text}, "token_ids": ids,
                                  "finish_reason": finish, "logprobs": {"content": [
                                      {"logprob": -0.5} for _ in ids]}}]}
    if prompt is not None:
        c["prompt_token_ids"] = prompt
    return b"data: " + orjson.dumps(c) + b"\n"


class FakeRedis:
    """The policy version read by read (the last one stays), the pause's mark carrying cut
    calls on or not, cut by cut; never paused."""

    def __init__(self, versions=(1,), carries=(True,), fail_after: int | None = None):
        self.versions, self.carries, self.fail_after = list(versions), list(carries), fail_after
        self.gets = self.marks_read = 0

    def get(self, key):
        assert key == keys.policy_version()
        self.gets += 1
        if self.fail_after is not None and self.gets > self.fail_after:
            raise redis.ConnectionError("Redis went away")
        return str(self.versions[min(self.gets, len(self.versions)) - 1])

    def mget(self, *names):
        self.marks_read += 1
        carries = self.carries[min(self.marks_read, len(self.carries)) - 1]
        return ("token", "token") if carries else (None, None)

    def exists(self, key):
        return 0


class Upstream:
    def __init__(self, items):
        self.items, self.status, self.released = items, 200, False

    def lines(self):
        for item in self.items:
            if isinstance(item, Exception):
                raise item
            yield item

    def release(self):
        self.released = True


class Lease:
    id = "lease"

    def __init__(self):
        self.ended, self.recorded, self.released = False, None, False

    def record(self, calls, turn=None):
        self.ended, self.recorded = True, [json.loads(c) for c in calls]
        return True

    def release(self):
        self.ended = self.released = True


class NothingSeen(dict):
    def get(self, key, default=None):
        return None


@pytest.fixture(autouse=True)
def _every_version_read_reaches_redis(monkeypatch):
    monkeypatch.setattr(cached_reads, "_version", NothingSeen())


def run(answers, fake_redis=None, body=BODY):
    """-> (the agent's events as JSON, or "[DONE]"), the lease, the state, the upstreams."""
    sent, down = [], []
    first, *more = [Upstream(items) for items in answers]

    @contextlib.contextmanager
    def abortable(lease_id):
        yield

    def post(upstream, path, raw, timeout):
        sent.append(orjson.loads(raw))
        return more.pop(0)

    state = SimpleNamespace(
        settings=SimpleNamespace(retry_after_s=1.0, upstream_timeout_s=5.0,
                                 tool_call_parser="hermes", lora=False, model="m",
                                 served_model=lambda v: "m"),
        redis=fake_redis or FakeRedis(), continuity=None,
        upstreams=SimpleNamespace(pick=lambda rid: "up2", post=post,
                                  mark_down=lambda up, restarted: down.append(up)),
        leases=SimpleNamespace(abortable=abortable, admission=SimpleNamespace(
            cancelled_among=lambda ids: [], is_paused=lambda: False)))
    lease = Lease()
    meta = CallMeta(endpoint="chat.completions", version=1, temperature=1.0, upstream="up1",
                    started_at=0.0, constrained=None, continued=False)
    carry = CarryOn(state, "r1", lease.id, threading.Event(), "chat.completions", dict(body))
    stream = AnswerStream(state, first, lease, meta, carry, (True, True, False),
                          OPENAI.stream({}))
    events = [e.decode().removeprefix("data: ").strip() for e in stream.events()]
    shown = [e if e == "[DONE]" else json.loads(e) for e in events]
    assert first.released
    return shown, lease, SimpleNamespace(sent=sent, down=down, redis=state.redis)


def text(events) -> str:
    return "".join(c["delta"].get("content") or "" for e in events if isinstance(e, dict)
                   for c in e.get("choices") or [])


def test_a_plain_stream_is_relayed_and_recorded_whole():
    events, lease, _ = run([[chunk("He", [5], prompt=PROMPT), b"\n",
                             chunk("llo", [6], "stop"), DONE]])
    assert text(events) == "Hello" and events[-1] == "[DONE]"
    (call,) = lease.recorded
    assert call["prompt_ids"] == PROMPT and call["response_ids"] == [5, 6]
    assert call["stream"] and call["policy_version_end"] is None


def test_the_first_chunk_read_under_a_new_version_switches_the_capture_there():
    """drain_mode keep: the trainer bumps the version while the engines are frozen."""
    _, lease, _ = run([[chunk("He", [5], prompt=PROMPT), chunk("l", [6]),
                        chunk("lo", [7], "stop"), DONE]], FakeRedis(versions=[1, 1, 2]))
    (call,) = lease.recorded
    assert call["policy_version"] == 1 and call["policy_version_end"] == 2
    assert call["version_switches"] == [[2, 2]]  # from its third token on


CUT = [chunk("He", [5], prompt=PROMPT), chunk("l", [6], "abort"), DONE]


def test_a_cut_stream_is_carried_on_as_one_answer():
    """drain_mode continue: the agent never sees the abort; the call is one capture whose
    tokens switch version where the continuation began."""
    events, lease, up = run([CUT, [chunk("lo", [7], prompt=[*PROMPT, 5, 6]),
                                   chunk("!", [8], "stop"), DONE]],
                            FakeRedis(versions=[1, 1, 1, 2]))
    assert text(events) == "Hello!" and events[-1] == "[DONE]"
    assert all(c["finish_reason"] != "abort" for e in events if isinstance(e, dict)
               for c in e["choices"])
    (resent,) = up.sent
    assert resent["kv_transfer_params"]["prompt_token_ids"] == [*PROMPT, 5, 6]
    assert resent["max_tokens"] == 6
    (call,) = lease.recorded
    assert call["prompt_ids"] == PROMPT and call["response_ids"] == [5, 6, 7, 8]
    assert call["version_switches"] == [[2, 2]] and call["finish_reason"] == "stop"
    assert up.redis.marks_read == 1  # once for the one cut


def test_the_pause_mark_is_read_again_at_each_cut():
    """A second cut may come from a pause that does not carry calls on (an operator's):
    its abort reaches the agent."""
    events, lease, up = run([CUT, [chunk("lo", [7], prompt=[*PROMPT, 5, 6]),
                                   chunk("", [8], "abort"), DONE]],
                            FakeRedis(carries=[True, False]))
    assert up.redis.marks_read == 2
    assert events[-2]["choices"][0]["finish_reason"] == "abort" and events[-1] == "[DONE]"
    assert lease.recorded[0]["finish_reason"] == "abort"


def test_a_continuation_read_from_other_ids_ends_with_a_retryable_error():
    events, lease, _ = run([CUT, [chunk("lo", [7], prompt=[9, 9]), DONE]])
    assert events[-1]["error"]["code"] == "cancelled_by_update"
    assert lease.recorded is None and lease.released


def test_a_call_cut_at_its_last_token_ends_by_length():
    events, lease, up = run([CUT], body={**BODY, "max_tokens": 2})
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    assert up.sent == [] and lease.recorded[0]["finish_reason"] == "length"


@pytest.mark.parametrize("end", [UpstreamUnreachable("answer cut off"), None])
def test_a_stream_its_server_cuts_ends_with_an_error_and_the_server_is_routed_around(end):
    events, lease, up = run([[chunk("He", [5], prompt=PROMPT), *([end] if end else [])]])
    assert events[-1]["error"]["code"] == "upstream_unavailable"
    assert up.down == ["up1"] and lease.recorded is None and lease.released


def test_redis_failing_mid_stream_ends_with_an_error_event():
    events, lease, _ = run([[chunk("He", [5], prompt=PROMPT), chunk("l", [6], "stop"), DONE]],
                           FakeRedis(fail_after=1))
    assert events[-1]["error"]["code"] == "state_unavailable"
    assert lease.recorded is None and lease.released
