"""What the gateway records per model call, and what it strips from the agent's answer.

The gateway always asks the engine for token ids and log-probs (training needs them); the
agent only sees those fields if it asked for them itself. Pure functions: no IO here.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypedDict

from app.state.records import CapturedCall
from gateway.bodies import Answer, AnswerMessage, Choice, Logprobs, Request, ToolCall


def prepare_upstream_body(body: Request, endpoint: str, model: str,
                          default_max_tokens: int, default_temperature: float) -> Request:
    """The request sent upstream: the agent's body plus the fields capture needs."""
    out = body.copy()
    out["model"] = model
    out["return_token_ids"] = True
    # vLLM leaves every token id and log-prob out of an answer whose reasoning is hidden;
    # the agent's wish is applied to what it is shown instead (strip_for_agent)
    out.pop("include_reasoning", None)
    if endpoint == "chat.completions":
        out["logprobs"] = True
        out.setdefault("top_logprobs", 0)
        if out.get("top_logprobs") is None:
            out["top_logprobs"] = 0
    else:
        if not isinstance(out.get("logprobs"), int) or isinstance(out.get("logprobs"), bool):
            out["logprobs"] = 0
    if out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
        out["max_tokens"] = default_max_tokens
    if out.get("temperature") is None:
        out["temperature"] = default_temperature
    if out.get("stream"):
        opts = (out.get("stream_options") or {}).copy()
        out["stream_options"] = opts
    return out


def agent_wants(body: Request, endpoint: str) -> tuple[bool, bool]:
    """(wants log-probs, wants token ids) as the agent asked for them."""
    wants_ids = bool(body.get("return_token_ids"))
    if endpoint == "chat.completions":
        return bool(body.get("logprobs")), wants_ids
    lp = body.get("logprobs")
    return (lp is not None and lp is not False), wants_ids


def hides_reasoning(body: Request) -> bool:
    """The agent asked for the answer without its reasoning (``include_reasoning: false``)."""
    return body.get("include_reasoning") is False


# vLLM's request fields that constrain decoding to a grammar (the older guided_* names are
# turned into it before: forward.GUIDED_FIELDS)
GRAMMAR_FIELDS = ("structured_outputs",)


def auto_tool_grammar(tools: Iterable[object], strict_level: str) -> bool:
    """Whether, under tool_choice auto, vLLM's tool-call parser holds a call to its grammar
    (a structural tag): a tool is ``strict``, or the servers' ``--tool-strict-level``
    (``strict_level``) is above auto."""
    return strict_level != "auto" or any(
        isinstance(t, dict) and isinstance(t.get("function"), dict)
        and t["function"].get("strict") is True for t in tools)


def constrained_by(body: Request, tool_call_parser: str | None = None,
                   strict_level: str = "auto") -> str | None:
    """The parameter that makes vLLM sample under a grammar mask, or None.

    With tools, vLLM's tool-call parser (``tool_call_parser``, the servers') masks the
    call's markup under ``tool_choice`` required or a named function, and under auto too
    when a tool is ``strict``, when ``parallel_tool_calls`` is false (one call at most), or
    when the servers' ``--tool-strict-level`` (``strict_level``) is above auto. Under auto
    the text outside a call is free: such a call is constrained only if it made a tool call
    (``AUTO_TOOL_GRAMMAR``, applied per choice by :func:`calls_from_response`)."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    for name in GRAMMAR_FIELDS:
        if body.get(name):
            return name
    choice, tools = body.get("tool_choice"), body.get("tools")
    if not tools or choice == "none":
        return None
    if choice == "required" or isinstance(choice, dict):
        return "tool_choice"
    if tool_call_parser:
        if auto_tool_grammar(tools, strict_level):
            return "tools"
        if body.get("parallel_tool_calls") is False:
            return "parallel_tool_calls"
    return None


# what constrained_by names for a grammar that holds inside a tool call only (tool_choice auto)
AUTO_TOOL_GRAMMAR = ("tools", "parallel_tool_calls")


def _choice_logprobs(choice: Choice, endpoint: str) -> list[float | None]:
    lp = choice.get("logprobs") or {}
    if endpoint == "chat.completions":
        return [item.get("logprob") for item in (lp.get("content") or [])]
    return list(lp.get("token_logprobs") or [])


def calls_from_response(resp: Answer, endpoint: str, version: int, temperature: float,
                        upstream: str, started_at: float, stream: bool = False,
                        version_end: int | None = None,
                        switches: dict[int, list[list[int]]] | None = None,
                        constrained: str | None = None,
                        continued: bool = False) -> list[CapturedCall]:
    """One CapturedCall per choice of a complete (non-streamed or reassembled) response.
    ``version_end``: the policy version when the call ended; ``switches``: per choice index,
    where a streamed call's tokens changed version (``StreamAccumulator.switch``)."""
    top_prompt_ids = list(resp.get("prompt_token_ids") or [])
    calls = []
    for choice in resp.get("choices") or []:
        # chat puts the prompt's ids at the top level, completions inside each choice
        prompt_ids = list(choice.get("prompt_token_ids") or top_prompt_ids)
        ids = list(choice.get("token_ids") or [])
        raw = _choice_logprobs(choice, endpoint)
        logprobs, bad = CapturedCall.clean_logprobs(raw)
        if len(logprobs) != len(ids):  # a capture that does not line up is unusable
            bad += abs(len(ids) - len(logprobs)) or 1
        masked = constrained
        if constrained in AUTO_TOOL_GRAMMAR and not (choice.get("message") or {}).get(
                "tool_calls"):
            masked = None  # an answer in text only, outside any call: nothing was masked
        calls.append(CapturedCall(
            prompt_ids=prompt_ids, response_ids=ids, logprobs=logprobs,
            finish_reason=choice.get("finish_reason"), policy_version=version,
            temperature=temperature, upstream=upstream, started_at=started_at,
            ended_at=time.time(), endpoint=endpoint, stream=stream, nonfinite_logprobs=bad,
            policy_version_end=None if version_end in (None, version) else version_end,
            version_switches=((switches or {}).get(choice.get("index", 0)) or None
                              if version_end not in (None, version) else None),
            constrained=masked, continued=continued))
    return calls


@dataclass(frozen=True)
class CallMeta:
    """What each captured call of an answer records besides the answer, fixed when the call
    is first sent upstream: a call carried on past a weight update keeps its first server
    and version here, and where its tokens changed version comes with its answer."""

    endpoint: str            # chat.completions or completions, as sent upstream
    version: int             # the policy version the call was admitted on
    temperature: float       # the temperature it was sent with
    upstream: str            # the server it was first sent to
    started_at: float
    constrained: str | None  # what made vLLM sample under a grammar (constrained_by)
    continued: bool          # its prompt went as an earlier turn's ids (token continuity)

    def calls(self, resp: Answer, version_end: int,
              switches: dict[int, list[list[int]]], stream: bool = False) -> list[CapturedCall]:
        """The call's whole answer as captured calls (:func:`calls_from_response`)."""
        return calls_from_response(resp, self.endpoint, self.version, self.temperature,
                                   self.upstream, self.started_at, stream=stream,
                                   version_end=version_end, switches=switches,
                                   constrained=self.constrained, continued=self.continued)


def _without_reasoning(message: AnswerMessage) -> AnswerMessage:
    """The message without a reasoning parser's text (vLLM names it either way)."""
    out = message.copy()
    out.pop("reasoning", None)
    out.pop("reasoning_content", None)
    return out


def strip_for_agent(resp: Answer, endpoint: str, wants_logprobs: bool,
                    wants_ids: bool, hide_reasoning: bool = False) -> Answer:
    """The OpenAI-shaped answer (or stream chunk), without the fields the agent did not ask
    for."""
    if wants_logprobs and wants_ids and not hide_reasoning:
        return resp
    out = copy.copy(resp)
    if not wants_ids:
        out.pop("prompt_token_ids", None)
    choices = []
    for choice in resp.get("choices") or []:
        c = choice.copy()
        if not wants_ids:
            c.pop("token_ids", None)
            c.pop("prompt_token_ids", None)
        if not wants_logprobs:
            c["logprobs"] = None
        if hide_reasoning and isinstance(c.get("message"), dict):
            c["message"] = _without_reasoning(c["message"])
        if hide_reasoning and isinstance(c.get("delta"), dict):
            c["delta"] = _without_reasoning(c["delta"])
        choices.append(c)
    out["choices"] = choices
    return out


class _Partial(TypedDict):
    """One choice of a stream, as its chunks have added up so far."""

    token_ids: list[int]
    lp: list[float | None]
    finish_reason: str | None
    content: str
    tool_calls: dict[int, ToolCall]
    prompt_ids: list[int]


class StreamAccumulator:
    """Reassembles streamed chunks into one response so capture is the same as non-stream."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.prompt_ids: list[int] = []
        self.choices: dict[int, _Partial] = {}
        self.switches: dict[int, list[list[int]]] = {}
        self.pending_switch: int | None = None   # for choices that had no token yet

    def switch(self, version: int) -> None:
        """The policy version changed: the tokens from here on (per choice) are sampled on
        ``version``."""
        for idx, acc in self.choices.items():
            self.switches.setdefault(idx, []).append([len(acc["token_ids"]), version])
        self.pending_switch = version

    def add(self, chunk: Answer) -> None:
        # the first prompt is the call's: a continuation's (gateway.continuation) holds the
        # response so far too
        top_prompt = chunk.get("prompt_token_ids")
        if top_prompt and not self.prompt_ids:
            self.prompt_ids = list(top_prompt)
        for choice in chunk.get("choices") or []:
            idx = choice.get("index", 0)
            if idx not in self.choices and self.pending_switch is not None:
                self.switches[idx] = [[0, self.pending_switch]]
            acc = self.choices.setdefault(idx, {"token_ids": [], "lp": [], "finish_reason": None,
                                                "content": "", "tool_calls": {},
                                                "prompt_ids": []})
            # completions: each choice's first chunk holds its own prompt's ids (a call may
            # send several prompts)
            prompt = choice.get("prompt_token_ids")
            if prompt and not acc["prompt_ids"]:
                acc["prompt_ids"] = list(prompt)
            if prompt and not self.prompt_ids:
                self.prompt_ids = list(prompt)
            acc["token_ids"].extend(choice.get("token_ids") or [])
            delta = choice.get("delta") or {}
            # the text so far: chat's deltas, or completions' text pieces
            acc["content"] += delta.get("content") or choice.get("text") or ""
            for call in delta.get("tool_calls") or []:  # the answer the agent echoes back
                fn = call.get("function") or {}
                kept = acc["tool_calls"].setdefault(call.get("index", 0), {
                    "id": call.get("id"), "type": "function",
                    "function": {"name": fn.get("name"), "arguments": ""}})
                kept["function"]["arguments"] += fn.get("arguments") or ""
            acc["lp"].extend(_choice_logprobs(choice, self.endpoint))
            if choice.get("finish_reason"):
                acc["finish_reason"] = choice["finish_reason"]

    def text_length(self) -> int:
        """Characters of text so far of the (one) choice."""
        return sum(len(acc["content"]) for acc in self.choices.values())

    def end_by_length(self) -> None:
        """A call cut at its last allowed token ends there, by length."""
        for acc in self.choices.values():
            if acc["finish_reason"] == "abort":
                acc["finish_reason"] = "length"

    def response(self) -> Answer:
        choices: list[Choice] = []
        for idx in sorted(self.choices):
            acc = self.choices[idx]
            lp: Logprobs
            if self.endpoint == "chat.completions":
                lp = {"content": [{"logprob": v} for v in acc["lp"]]}
            else:
                lp = {"token_logprobs": acc["lp"]}
            calls = [acc["tool_calls"][k] for k in sorted(acc["tool_calls"])]
            choice: Choice = {"index": idx, "token_ids": acc["token_ids"], "logprobs": lp,
                      "finish_reason": acc["finish_reason"],
                      "message": {"content": acc["content"], "tool_calls": calls or None}}
            if acc["prompt_ids"]:
                choice["prompt_token_ids"] = acc["prompt_ids"]
            choices.append(choice)
        return {"prompt_token_ids": self.prompt_ids, "choices": choices}
