"""One call carried on past the weight updates that cut it (``gateway.drain_mode: continue``):
the half of ``gateway.continuation`` that reads Redis and talks to the servers.

A :class:`CarryOn` is built once per call, streamed or not, and holds what each resend of
it needs. Invariants:

- Whether a cut is carried on is read from the pause's mark in one place,
  :meth:`CarryOn.applies`, once per cut, when the cut answer comes back: a call may be cut
  by several pauses, and one taken over by an operator's does not carry on.
- A cut call goes on only if it can go on exactly (:meth:`CarryOn.refusal`); otherwise the
  agent gets the retryable ``cancelled_by_update``, as for any call a weight update ends.
- A continuation is sent only once the pause has ended, and its answer counts only if its
  server says it read the ids it was sent (:meth:`CarryOn.misread` otherwise).
"""

from __future__ import annotations

import logging
import threading

from app.state.cached_reads import policy_version
from gateway import continuation
from gateway.bodies import Answer, Request
from gateway.body import answer_of
from gateway.errors import GatewayError, retryable
from gateway.leases import UpstreamCancelled
from gateway.send import cancelled, send
from gateway.state import GatewayState
from gateway.upstream import UpstreamResponse

log = logging.getLogger(__name__)

# per choice index, [index of the first response token sampled on a version, that version]
Switches = dict[int, list[list[int]]]


class CarryOn:
    """The carrying on of one admitted call: ``body`` is what was sent upstream, ``cancel``
    the call's lease's cancel event."""

    def __init__(self, state: GatewayState, rollout_id: str, lease_id: str,
                 cancel: threading.Event, endpoint: str, body: Request) -> None:
        self.state = state
        self.rollout_id = rollout_id
        self.lease_id = lease_id
        self.cancel = cancel
        self.endpoint = endpoint
        self.body = body

    def applies(self) -> bool:
        """The pause that cut the call carries cut calls on (``continuation.carries_on``);
        asked once per cut, as its answer comes back cut."""
        return continuation.carries_on(self.state.redis)

    def refusal(self, answer: Answer, reasoning: bool = False) -> GatewayError | None:
        """The retryable error that ends a cut call the gateway cannot carry on exactly.
        ``reasoning``: a stream's deltas held a reasoning parser's text (its accumulated
        answer keeps none)."""
        parser = self.state.settings.tool_call_parser
        why = continuation.refusal(self.body, parser)
        if why is None and not continuation.one_choice(answer):
            why = "several choices"
        if why is None and (reasoning or continuation.reasoned(answer)):
            why = "a reasoning parser's answer"
        # without tools the server parses no call out of the text: a cut anywhere carries on
        if why is None and self.body.get("tools") and continuation.cut_in_call(answer, parser):
            why = "a tool call cut in its markup"
        if why is None:
            return None
        log.info("rollout %s: a call cut by a weight update is not carried on (%s); the agent "
                 "retries it", self.rollout_id, why)
        return cancelled(self.state)

    def resend(self, body: Request, stream: bool
               ) -> tuple[UpstreamResponse, bytes | None, int, str]:
        """Send a cut call's continuation ``body`` once the pause has ended, to whichever
        server is usable then (the re-sent tokens are a prefill anywhere); -> (the response,
        its body unless streamed, the policy version it is sampled on, the server)."""
        s = self.state.settings
        try:
            continuation.wait_for_resume(self.state.redis, self.cancel, s.upstream_timeout_s)
        except UpstreamCancelled:
            raise cancelled(self.state) from None
        except TimeoutError as exc:
            raise retryable(f"a cut call could not be carried on: {exc}", s.retry_after_s,
                            code="cancelled_by_update") from None
        # the trainer sets the version before it resumes the engines, the pause after
        version = policy_version(self.state.redis, 0.0)
        body["model"] = s.served_model(version)  # LoRA: the new version's adapter
        upstream = self.state.upstreams.pick(self.rollout_id)
        if upstream is None:
            raise retryable("no inference server is reachable", s.retry_after_s,
                            code="upstream_unavailable")
        resp, data = send(self.state, self.rollout_id, self.lease_id, upstream, self.endpoint,
                          body, stream)
        return resp, data, version, upstream

    def misread(self) -> GatewayError:
        """A continuation whose server did not read the ids it was sent (it rendered the
        messages instead): the agent retries the call."""
        log.warning("rollout %s: the continuation of a cut call was not read from the ids it "
                    "was sent; the agent retries the call", self.rollout_id)
        return cancelled(self.state)

    def whole(self, data: Answer, version: int) -> tuple[Answer, Switches]:
        """A plain (not streamed) answer, sampled from ``version`` on, carried on past each
        weight update that cut it (``finish_reason: abort``) until it ends; -> the answer,
        and where its tokens changed version."""
        switches: Switches = {}
        current = version
        while continuation.aborted(data) and self.applies():
            refused = self.refusal(data)
            if refused is not None:
                raise refused
            prompt_ids, so_far = continuation.prompt_and_response(data)
            more_body = continuation.resend_body(self.body, self.endpoint, prompt_ids, so_far)
            if more_body is None:
                return continuation.ended_by_length(data), switches
            _, raw, now, _ = self.resend(more_body, False)
            assert raw is not None
            more = answer_of(raw)
            if continuation.sent_prompt(more) != [*prompt_ids, *so_far]:
                raise self.misread()
            if now != current:
                switches.setdefault(0, []).append([len(so_far), now])
                current = now
            data = continuation.merge(data, more, self.endpoint)
        return data, switches
