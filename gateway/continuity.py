"""Token continuity: a later turn of a conversation is sent to vLLM as the tokens the model
actually saw and sampled, not as the chat template's re-rendering of them.

The chat template renders the model's earlier answers back into each next prompt. Where
those tokens differ from the ones sampled (a tool call whose markup a grammar made the
model write in other pieces, a word sampled in pieces that re-tokenizes as one), the next
call's prompt no longer begins with the previous call's tokens: the model is conditioned
on a context it did not produce, and the trainer cannot pack the turns into one row.

So after each call the gateway keeps, per rollout, a pointer to the captured call (its
prompt and response token ids) under a digest of its conversation: the request's messages
plus the answer, normalized the way agents echo an answer back (text stripped, tool calls
by name and parsed arguments, ids ignored). A call whose messages extend a kept
conversation (the longest one that matches, so parallel chains of one rollout each continue
their own) is sent with those ids plus the rendering of only its new messages, through
vLLM's ``kv_transfer_params.prompt_token_ids`` (which replaces the rendering; the messages
are still read for tool parsing). Anything that does not match (an edited history, other
tools, an answer that did not end with the end-of-turn token, a template that renders an
earlier turn differently) is rendered as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING

import orjson
import redis

from app.state import keys
from gateway.bodies import Answer, AnswerMessage, Message, Request, Tool
from gateway.rendering import TemplateInput, extra_template_inputs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

def _arguments(raw: object) -> object:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def normalized(message: Message) -> dict[str, object]:
    """What of a message an agent echoes back as it came: text stripped, tool calls by name
    and parsed arguments."""
    content = message.get("content")
    if isinstance(content, list):
        # joined as vLLM joins text parts: a list and its joined string are one message
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, object] = {"role": message.get("role"),
                           "content": (content or "").strip() if isinstance(content, str)
                           or content is None else content}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [[(c.get("function") or {}).get("name"),
                              _arguments((c.get("function") or {}).get("arguments"))]
                             for c in calls]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def digest(messages: list[Message], tools: list[Tool] | None) -> str:
    data = orjson.dumps([[normalized(m) for m in messages], tools or []],
                        option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(data).hexdigest()[:32]


# KEYS: rollout_turns, rollout_calls   ARGV: conversation digests, longest first
# -> {digest's position in ARGV, the kept tag, the call's JSON} for the first kept one, or nil
LOOKUP = """
for i, d in ipairs(ARGV) do
  local kept = redis.call('HGET', KEYS[1], d)
  if kept then
    local sep = string.find(kept, ':', 1, true)
    local call = redis.call('LINDEX', KEYS[2], tonumber(string.sub(kept, 1, sep - 1)) - 1)
    if call then return {i, string.sub(kept, sep + 1), call} end
  end
end
return nil
"""


def tag(response_ids: list[int]) -> str:
    """Names a kept call's response: a lookup that finds another call at the kept position
    (a Redis crash lost calls before it) sees a different tag and renders instead."""
    return hashlib.sha256(orjson.dumps(response_ids)).hexdigest()[:16]


class Continuity:
    """Keeps and reuses each rollout's conversation tokens. What is kept is a pointer into
    the rollout's captured calls, written with the call itself (``RECORD_RELEASE``): no
    token is stored twice and no Redis call is added to a first turn."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, client: redis.Redis) -> None:
        self.tokenizer = tokenizer
        self.template_input = TemplateInput(tokenizer)
        eos = tokenizer.eos_token_id
        self.eos_id: int | None = int(eos) if eos is not None else None
        self.eos_text: str = tokenizer.decode([eos]) if eos is not None else ""
        self._lookup = client.register_script(LOOKUP)

    def turn(self, body: Request, answer: AnswerMessage,
             response_ids: list[int]) -> tuple[str, str] | None:
        """(digest, tag) that keeps the conversation ``body`` + ``answer`` (an assistant
        message) as the call being recorded; None for an answer that did not end with the
        end-of-turn token (the template would add one the model did not sample)."""
        if not response_ids or response_ids[-1] != self.eos_id or body.get("n", 1) != 1 \
                or "messages" not in body or extra_template_inputs(body):
            # a turn rendered with template inputs (a reasoning effort) is not the prompt a
            # later call without them would get
            return None
        said: Message = {"role": "assistant", "content": answer.get("content"),
                         "tool_calls": answer.get("tool_calls")}
        conversation = [*body["messages"], said]
        return digest(conversation, body.get("tools")), tag(response_ids)

    def prompt_ids(self, rollout_id: str, body: Request) -> list[int] | None:
        """The prompt for ``body`` continuing a kept conversation of the rollout, or None
        (render as usual)."""
        msgs = body.get("messages") or []
        ends = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        if not ends or self.eos_id is None or body.get("n", 1) != 1 \
                or body.get("continue_final_message") or extra_template_inputs(body):
            return None
        tools = body.get("tools")
        ends = ends[::-1]  # the longest kept conversation first
        found = self._lookup(keys=[keys.rollout_turns(rollout_id), keys.rollout_calls(rollout_id)],
                             args=[digest(msgs[:i + 1], tools) for i in ends])
        if not found:
            return None
        position, kept_tag, raw = found
        call = orjson.loads(raw)
        if tag(call["response_ids"]) != (kept_tag.decode() if isinstance(kept_tag, bytes)
                                         else kept_tag):
            return None
        try:
            suffix = self._suffix(msgs, ends[int(position) - 1], tools)
        except Exception as exc:  # noqa: BLE001 - a template that fails here: render
            log.info("token continuity skipped for %s (%s: %s)", rollout_id,
                     exc.__class__.__name__, exc)
            return None
        return None if suffix is None else call["prompt_ids"] + call["response_ids"] + suffix

    def _suffix(self, msgs: list[Message], last: int,
                tools: list[Tool] | None) -> list[int] | None:
        """Token ids of what the template puts after the kept conversation's end-of-turn
        token (the messages after ``last`` and the generation prompt), or None when the
        template does not render the kept part as a prefix of the whole."""
        render = self.tokenizer.apply_chat_template
        served, merged = self.template_input.convert(msgs)  # what the server renders
        if merged:
            return None  # system messages merged into the first: the kept turn changed
        whole = str(render(served, tools=tools, add_generation_prompt=True, tokenize=False))
        head = str(render(served[:last + 1], tools=tools, add_generation_prompt=False,
                          tokenize=False))
        cut = head.rfind(self.eos_text)
        if not whole.startswith(head) or cut < 0:
            return None
        return list(self.tokenizer.encode(whole[cut + len(self.eos_text):],
                                          add_special_tokens=False))


def kept_turn(continuity: Continuity | None, body: Request,
              answer: Answer) -> tuple[str, str] | None:
    """What keeps a whole one-choice chat ``answer`` to ``body`` for its conversation's next
    turn, recorded with the call (``Continuity.turn``); None without token continuity."""
    choices = answer.get("choices") or []
    if continuity is None or len(choices) != 1:
        return None
    msg = choices[0].get("message") or {}
    return continuity.turn(body, {"content": msg.get("content"),
                                  "tool_calls": msg.get("tool_calls")},
                           choices[0].get("token_ids") or [])
