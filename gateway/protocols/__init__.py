"""The wire protocols the gateway speaks to agents, each translated to and from the one it
speaks to vLLM (OpenAI chat completions with token ids and log-probs, which capture needs).

A protocol turns an agent's request into a chat-completions body (``to_chat``), a complete
chat answer into its own (``answer``), and a chat stream into its own events
(``StreamTranslator``). Capture, leases, sampling enforcement and the context check run on
the chat body, so they are the same on every route. Pure functions: no IO here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import cast

import orjson

from gateway.bodies import Answer, Function, NamedToolChoice, Request, Tool
from gateway.capture import auto_tool_grammar
from gateway.errors import GatewayError, bad_request, overflow_error


class StreamTranslator:
    """Chat-completions chunks in, the protocol's server-sent events out."""

    def chunk(self, chunk: Answer) -> Iterator[bytes]:
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"

    def done(self) -> Iterator[bytes]:
        yield b"data: [DONE]\n\n"

    def error(self, err: GatewayError) -> bytes:
        return b"data: " + orjson.dumps(err.body()) + b"\n\n"


@dataclass(frozen=True)
class ToolGrammar:
    """What the servers do with a call's tools: their ``--tool-call-parser`` (None: tool
    calls are not parsed) and ``--tool-strict-level``."""

    parser: str | None = None
    strict_level: str = "auto"


class Protocol:
    """OpenAI chat completions and completions: served as they are."""

    name = "openai"

    def to_chat(self, body: dict[str, object], tools: ToolGrammar = ToolGrammar()) -> Request:
        """The agent's request (a JSON object) as a chat-completions body; the route checks
        that body next (``gateway.forward.validate_body``)."""
        return cast(Request, body)  # already one: checked next, as every protocol's is

    def answer(self, chat: Answer, request: dict[str, object]) -> Mapping[str, object]:
        """The chat answer as the protocol's answer to ``request``."""
        return chat

    def stream(self, request: dict[str, object]) -> StreamTranslator:
        return StreamTranslator()

    def overflow(self, prompt_tokens: int, max_tokens: int, max_model_len: int,
                 endpoint: str = "chat.completions") -> GatewayError:
        """The refusal of a call whose prompt and ``max_tokens`` exceed the context, in the
        protocol's words (``context_length_exceeded``)."""
        return overflow_error(prompt_tokens, max_tokens, max_model_len,
                              "messages" if endpoint == "chat.completions" else "prompt")


OPENAI = Protocol()


def required_string(obj: Mapping[str, object], name: str, where: str) -> str:
    """``obj[name]``, a non-empty string, else a 400 naming ``where.name`` (taken as it came
    it would enter the prompt as the word None, or as a Python repr)."""
    value = obj.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{name} must be a non-empty string", param=f"{where}.{name}")
    return value


def template_kwargs(body: Mapping[str, object], chat: Request) -> None:
    """vLLM's ``chat_template_kwargs`` (an SDK's ``extra_body``: Qwen3's ``enable_thinking``,
    say) go on to the chat body as the chat route takes them."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", param="chat_template_kwargs")
    chat["chat_template_kwargs"] = kwargs


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM's chat field


def reasoning_effort(effort: object, param: str, chat: Request) -> None:
    """A reasoning effort goes on as the chat route's ``reasoning_effort``, which vLLM hands
    the chat template (gpt-oss and Qwen3 templates read it; others ignore it) rather than
    drop it: the prompt the model sees then is the one the provider's API would give it."""
    if effort is None:
        return
    if effort not in EFFORTS:
        raise bad_request(f"{param} must be one of {', '.join(EFFORTS)}", param=param)
    chat["reasoning_effort"] = effort


def format_shuts_out_tools(chat: Request, tools: ToolGrammar) -> bool:
    """Whether a structured-output format sent with ``chat`` would keep the model from
    calling its tools. OpenAI and Anthropic hold only the final text answer to the format.
    vLLM holds every token to it (a forced call overrides it), unless under tool_choice auto
    its tool parser's grammar applies (a tool is ``strict``, or the servers' strict level is
    above auto): then it offers a call or an answer in the format, which is what the
    providers do. Otherwise the format is not sent, or no call could be made."""
    if not chat.get("tools") or chat.get("tool_choice") == "none":
        return False
    if chat.get("tool_choice") not in (None, "auto"):
        return True  # a forced call: the answer is the call, which the format is not for
    return not (tools.parser and auto_tool_grammar(chat["tools"], tools.strict_level))


def function_tool(name: str, tool: Mapping[str, object], schema_key: str) -> Tool:
    """A chat-completions function tool ``name`` from another protocol's (its JSON schema
    under ``schema_key``); ``strict`` asks vLLM to hold the arguments to the schema."""
    fn: Function = {"name": name, "parameters": tool.get(schema_key) or {"type": "object"}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    if tool.get("strict") is not None:
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def named_function(name: str) -> NamedToolChoice:
    """The chat-completions ``tool_choice`` that forces the function ``name``."""
    return {"type": "function", "function": {"name": name}}


def text_of(content: object, where: str) -> str:
    """A string, or a list of text parts ({"type": "text" | "input_text" | "output_text",
    "text": ...}), as one string: the parts joined with newlines, as vLLM joins a chat
    message's text parts (Claude Code, for one, sends its system prompt in several)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text blocks", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text") or not isinstance(
                part.get("text"), str):
            raise bad_request(f"{where}[{j}]: content of type {kind!r} is not supported by "
                              f"this gateway (text only)", param=f"{where}[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)
