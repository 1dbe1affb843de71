"""A streamed answer: the server's chunks relayed to the agent as they come, and the whole
call recorded when they end.

One :class:`AnswerStream` per streamed call. Its :meth:`~AnswerStream.events` runs in the
WSGI server after the route has returned, outside the app context, so it holds the gateway
state itself. What it does to the server's events, each in methods of its own:

- plain pass-through (:meth:`~AnswerStream._relay`, :meth:`~AnswerStream._chunk`): each
  chunk goes to the agent in its protocol, without what it did not ask for, and into the
  accumulator the capture is made from;
- ``gateway.drain_mode: keep`` version switches (:meth:`~AnswerStream._follow_version`):
  the trainer bumps the policy version while the engines are frozen and before they
  resume, so the first chunk read under a new version holds the first tokens sampled on
  it, and the capture switches version there;
- ``gateway.drain_mode: continue`` carry-on (:meth:`~AnswerStream._carried_on`,
  :meth:`~AnswerStream._resume`, :meth:`~AnswerStream._as_part_of_call`): an answer a
  weight update cut is sent again from its tokens so far once the update is done
  (``gateway.carry_on``); the agent never sees the cut, and the continuation's chunks
  read as the rest of one answer.

Invariants:

- The agent's stream ends with its protocol's end, after the call is recorded, or with
  one error event (a cut connection, a cancel, a refused carry-on, a Redis failure);
  never by just stopping.
- The call's lease ends exactly once: recorded with the capture when the answer ends,
  else released at the end with nothing captured.
- The upstream answer being read is released however the stream ends.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import redis

from app.state.cached_reads import policy_version
from gateway import capture, continuation
from gateway.bodies import Answer, Choice
from gateway.body import answer_of
from gateway.carry_on import CarryOn
from gateway.continuity import kept_turn
from gateway.errors import GatewayError, retryable
from gateway.leases import Lease
from gateway.protocols import StreamTranslator
from gateway.send import cancelled, stream_error
from gateway.state import GatewayState
from gateway.upstream import UpstreamResponse, UpstreamUnreachable

log = logging.getLogger(__name__)


class _Ends(Exception):
    """The agent's stream ends with ``error`` (one event in its protocol)."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class _Resumed:
    """Where a continuation stands in the agent's call (``gateway.drain_mode: continue``)."""

    done: int                  # tokens before it
    text_done: int             # and the characters of their text
    expected: list[int] | None  # the prompt ids its server must say it read (None: it did)


def _lines(resp: UpstreamResponse) -> Iterator[str]:
    for line in resp.lines():
        yield line.rstrip(b"\r\n").decode("utf-8")


class AnswerStream:
    """``resp``: the first upstream answer, streamed; ``shows``: what the agent sees of each
    chunk (``capture.strip_for_agent``); ``out``: the agent's protocol."""

    def __init__(self, state: GatewayState, resp: UpstreamResponse, lease: Lease,
                 meta: capture.CallMeta, carry: CarryOn, shows: tuple[bool, bool, bool],
                 out: StreamTranslator) -> None:
        self.state, self.resp, self.lease, self.meta = state, resp, lease, meta
        self.carry, self.shows, self.out = carry, shows, out
        self.rollout_id = carry.rollout_id
        self.acc = capture.StreamAccumulator(meta.endpoint)
        self.version = meta.version   # the version the chunks read now were sampled on
        self.upstream = meta.upstream  # the server answering now
        self.reasoning = False  # a reasoning parser's text came (such a call is not carried on)
        self.resumed: _Resumed | None = None  # the continuation under way, if any
        # of the upstream answer being read:
        self.cut = False     # a weight update cut it, and the call is carried on
        self.ended = False   # its [DONE] came
        self.finish = False  # it gave its finish reason (the answer so far may hold an
        # earlier answer's abort)

    def events(self) -> Iterator[bytes]:
        """The agent's stream, as server-sent events in its protocol."""
        try:
            while (yield from self._relay()):
                if not (yield from self._resume()):
                    return
        except _Ends as end:
            yield self.out.error(end.error)
        except redis.RedisError as exc:
            # the stream had begun: the agent gets an error event in its protocol, as for
            # any other failure past the headers, never a connection that just drops
            log.warning("Redis failed in the stream for %s (%s); nothing captured",
                        self.rollout_id, exc)
            yield self.out.error(retryable(
                f"the gateway lost its state store mid-answer ({exc}); retry",
                self.state.settings.retry_after_s, code="state_unavailable"))
        finally:
            self.resp.release()
            if not self.lease.ended:
                try:
                    self.lease.release()
                except redis.RedisError:  # its TTL ends it: the stream's end is not held up
                    log.warning("lease of %s not released (Redis unreachable)",
                                self.rollout_id)
                log.info("stream for %s ended early; nothing captured", self.rollout_id)

    # -- plain pass-through

    def _relay(self) -> Generator[bytes, None, bool]:
        """One upstream answer, relayed to its end; -> whether a weight update cut it and
        the call is carried on."""
        self.cut = self.ended = self.finish = False
        lines = _lines(self.resp)
        while True:
            try:
                line = next(lines, None)
            except UpstreamUnreachable as exc:
                if self.ended:  # after the [DONE], the answer is whole
                    return False
                raise _Ends(self._cut_off(exc)) from None
            if line is None:
                break
            self._follow_version()
            if self.carry.cancel.is_set():
                raise _Ends(cancelled(self.state))
            if not line or not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload != "[DONE]":
                yield from self._chunk(answer_of(payload))
                continue
            if self.cut:
                break
            if not self.finish:
                # ended with nothing sampled (continuation.finished): carried on from its
                # prompt's ids, as any cut call, where they came
                if self._carried_on(from_prompt=True):
                    break
                raise _Ends(self._unfinished())
            self.ended = True
            yield from self._end()  # and read on to the end: a cut past here loses nothing
        if not self.cut and not self.ended:  # the connection closed before the answer's end
            raise _Ends(self._cut_off(None))
        return self.cut

    def _chunk(self, chunk: Answer) -> Iterator[bytes]:
        """One chunk of the upstream answer, into the capture and on to the agent."""
        if chunk.get("error"):
            # vLLM's error inside a stream (then [DONE]): the agent gets it in its
            # protocol's shape, and the partial call is not captured
            err = stream_error(chunk["error"])
            log.warning("inference server error in the stream for %s: %s", self.rollout_id,
                        err.message)
            raise _Ends(err)
        if self.cut:
            return  # the cut answer's usage: the continuation counts anew
        if self.resumed is not None:
            chunk = self._as_part_of_call(chunk, self.resumed)
        self.acc.add(chunk)
        self.finish = self.finish or continuation.finished(chunk)
        self.reasoning = self.reasoning or continuation.reasoned(chunk)
        shown = chunk
        if continuation.aborted(chunk) and self._carried_on():
            shown = continuation.without_abort(chunk)
        yield from self.out.chunk(capture.strip_for_agent(shown, self.meta.endpoint,
                                                          *self.shows))

    def _end(self) -> Iterator[bytes]:
        """Record the whole call as its lease goes, and end the agent's stream."""
        calls = self.meta.calls(self.acc.response(), stream=True, version_end=self.version,
                                switches=self.acc.switches)
        if not self.lease.record([c.to_json() for c in calls],
                                 kept_turn(self.state.continuity, self.carry.body,
                                           self.acc.response())):
            yield self.out.error(cancelled(self.state))
            return
        yield from self.out.done()

    def _cut_off(self, exc: UpstreamUnreachable | None) -> GatewayError:
        """A stream its server cut (closed, or silent past ``upstream_timeout_s``): the agent
        gets an error, never an answer that just stops, and the server is routed around as
        when a call to it fails (``gateway.send``). A weight update under way (the call's
        lease cancelled, which this process learns only at its next check, or the gateway
        paused) is what ended it: the usual retryable cancel, and the server is left
        alone."""
        if self.carry.cancel.is_set() or self._updating():
            return cancelled(self.state)
        why = str(exc) if exc is not None else "closed before the answer's end"
        self.state.upstreams.mark_down(self.upstream,
                                       restarted=exc is None or not exc.timed_out)
        log.warning("inference server %s cut the stream for %s (%s); nothing captured",
                    self.upstream, self.rollout_id, why)
        return retryable(f"inference server cut the answer off ({why})",
                         self.state.settings.retry_after_s, code="upstream_unavailable")

    def _unfinished(self) -> GatewayError:
        """A stream that ended before its answer did, not carried on: never recorded; the
        agent retries it (a weight update's cancel, or the server's own abort)."""
        if self.carry.cancel.is_set() or self._updating():
            return cancelled(self.state)
        log.warning("the stream for %s ended before its answer's end; nothing captured",
                    self.rollout_id)
        return retryable("inference server ended the answer before its end",
                         self.state.settings.retry_after_s, code="upstream_unavailable")

    def _updating(self) -> bool:
        admission = self.state.leases.admission
        try:
            return bool(admission.cancelled_among([self.lease.id])) or admission.is_paused()
        except redis.RedisError:
            return False

    # -- gateway.drain_mode: keep

    def _follow_version(self) -> None:
        """The first chunk read under a new policy version holds the first tokens sampled on
        it (the trainer bumps the version while the engines are frozen and before they
        resume). A cut answer's tail holds none."""
        now = policy_version(self.state.redis)
        if now != self.version and not self.cut:
            self.acc.switch(now)
            self.version = now

    # -- gateway.drain_mode: continue

    def _carried_on(self, from_prompt: bool = False) -> bool:
        """A weight update cut the upstream answer: whether the call goes on past the cut
        (``from_prompt``: it had sampled nothing, and goes on only from its prompt's ids,
        where they came). A call that cannot go on exactly ends here."""
        answer = self.acc.response()
        if not self.carry.applies():
            return False
        if from_prompt and not continuation.prompt_and_response(answer)[0]:
            return False
        refused = self.carry.refusal(answer, self.reasoning)
        if refused is not None:
            raise _Ends(refused)
        self.cut = True
        return True

    def _resume(self) -> Generator[bytes, None, bool]:
        """Send the cut call on from its tokens so far, once the pause has ended; -> False
        when it ends instead, cut at its last allowed token."""
        self.resp.release()
        prompt_ids, so_far = continuation.prompt_and_response(self.acc.response())
        more_body = continuation.resend_body(self.carry.body, self.meta.endpoint, prompt_ids,
                                             so_far)
        if more_body is None:  # the cut came at the call's last token
            self.acc.end_by_length()
            last: Choice = {"index": 0, "finish_reason": "length"}
            if self.meta.endpoint == "chat.completions":
                last["delta"] = {}
            else:
                last["text"] = ""
            yield from self.out.chunk({"choices": [last]})
            yield from self._end()
            return False
        try:
            self.resp, _, now, self.upstream = self.carry.resend(more_body, True)
        except GatewayError as err:
            raise _Ends(err) from None
        except redis.RedisError as exc:
            raise _Ends(retryable(f"a cut call could not be carried on ({exc})",
                                  self.state.settings.retry_after_s,
                                  code="cancelled_by_update")) from None
        if now != self.version:  # the re-sent tokens are sampled on the version after it
            self.acc.switch(now)
            self.version = now
        self.resumed = _Resumed(len(so_far), self.acc.text_length(), [*prompt_ids, *so_far])
        return True

    def _as_part_of_call(self, chunk: Answer, resumed: _Resumed) -> Answer:
        """A continuation's chunk as part of the agent's call; the first that names the
        prompt ids its server read must name the ones sent."""
        if resumed.expected is not None and continuation.sent_prompt(chunk):
            if continuation.sent_prompt(chunk) != resumed.expected:
                raise _Ends(self.carry.misread())
            resumed.expected = None
        return continuation.as_part_of_call(chunk, resumed.done, resumed.text_done)
