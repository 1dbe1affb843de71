"""The messages as vLLM hands them to the chat template, for the gateway's own renderings (the
context-length count, token continuity's new messages).

vLLM does not pass a request's messages to the template as they came. For a template that
takes each message's content as a string (one that never loops over it: most text models'),
a content given as a list of text parts is joined with newlines, and a missing content is an
empty string; for one that loops over content parts it is a list (a string one part, a
missing content none). A tool message's parts are always joined. A ``developer`` message
becomes a ``system`` one for a template that does not name that role, and then every system
message is merged into one, first. An assistant's tool call arguments are given as an object
(a JSON string decoded; anything that is not an object becomes ``{}``), and its reasoning
under both ``reasoning`` and ``reasoning_content``. Rendered otherwise,
a later turn would carry tokens the server never renders (a Python list's repr, an empty
user turn) or fail in the template.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

from gateway.bodies import Message, Request

if TYPE_CHECKING:
    import jinja2
    import jinja2.nodes
    from transformers import PreTrainedTokenizerBase

ContentFormat = Literal["string", "openai"]
# a message as the chat template gets it: the request's, reshaped as vLLM reshapes it
ServedMessage = dict[str, object]


def _unwrapped(node: jinja2.nodes.Node | None) -> jinja2.nodes.Node | None:
    """``node`` without the filters, tests and slices around it."""
    import jinja2.nodes as n

    while True:
        if isinstance(node, n.Filter | n.Test):
            node = node.node
        elif isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
            node = node.node
        else:
            return node


def _reads_content(node: jinja2.nodes.Node | None) -> bool:
    """``node`` reads an item's content: ``x.content`` or ``x['content']``."""
    import jinja2.nodes as n

    node = _unwrapped(node)
    if isinstance(node, n.Getattr):
        return node.attr == "content"
    return isinstance(node, n.Getitem) and isinstance(node.arg, n.Const) \
        and node.arg.value == "content"


def _content_params(ast: jinja2.nodes.Template) -> dict[int, set[str]]:
    """Per macro (by id), its parameters that some call of it passes a content in."""
    import jinja2.nodes as n

    calls = [(c.node.name, c) for c in ast.find_all(n.Call) if isinstance(c.node, n.Name)]
    out: dict[int, set[str]] = {}
    for macro in ast.find_all(n.Macro):
        names = [a.name for a in macro.args]
        params = set()
        for call in (c for name, c in calls if name == macro.name):
            params |= {names[i] for i, a in enumerate(call.args[:len(names)])
                       if _reads_content(a)}
            params |= {k.key for k in call.kwargs if k.key in names and _reads_content(k.value)}
        out[id(macro)] = params
    return out


def _environment() -> jinja2.Environment:
    """The Jinja environment transformers renders chat templates in (its extensions, such
    as ``{% generation %}``, parse), else a plain one with loop controls."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template("").environment
    except Exception:  # noqa: BLE001 - another transformers: the plain environment
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


def content_format(chat_template: str | dict[str, str] | None) -> ContentFormat:
    """``openai`` when the template loops over a message's content (it takes lists of
    parts), else ``string``, as vLLM's ``--chat-template-content-format auto`` decides: a
    loop over ``x.content``, over a variable named ``content`` outside macros, or inside a
    macro over a parameter that a call passes a content in."""
    if not isinstance(chat_template, str):
        return "string"
    import jinja2
    import jinja2.nodes as n

    try:
        ast = _environment().parse(chat_template)
    except jinja2.TemplateError:
        return "string"
    in_macros: dict[int, set[str]] = {}
    params = _content_params(ast)
    for macro in ast.find_all(n.Macro):
        for loop in macro.find_all(n.For):
            in_macros[id(loop)] = params[id(macro)]
    for loop in ast.find_all(n.For):
        it = _unwrapped(loop.iter)
        if _reads_content(it):
            return "openai"
        if isinstance(it, n.Name) and (it.name in in_macros[id(loop)] if id(loop) in in_macros
                                       else it.name == "content"):
            return "openai"
    return "string"


class TemplateInput:
    """Turns a request's messages into what vLLM renders with ``tokenizer``'s template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        template = getattr(tokenizer, "chat_template", None)
        self.format = content_format(template)
        self.developer_role = isinstance(template, str) and (
            '"developer"' in template or "'developer'" in template)

    def __call__(self, messages: list[Message]) -> list[ServedMessage]:
        return self.convert(messages)[0]

    def convert(self, messages: list[Message]) -> tuple[list[ServedMessage], bool]:
        """-> (the messages as served, whether system messages were merged into one: the
        served list is then not the request's message for message)."""
        out = [self._message(m) for m in messages]
        if not self.developer_role and any(m.get("role") == "developer" for m in messages):
            merged = _one_system_message(out)
            return merged, merged is not out
        return out, False

    def _message(self, message: Message) -> ServedMessage:
        out: ServedMessage = dict(message)
        if out.get("role") == "developer" and not self.developer_role:
            out["role"] = "system"
        content = out.get("content")
        texts = _texts(content)
        if self.format == "string" or out.get("role") == "tool":
            # vLLM joins a tool message's text parts whatever the template
            if texts is not None:
                out["content"] = "\n".join(texts)
        elif isinstance(content, str) or content is None:
            # the template loops over parts: it gets them even for a plain string
            out["content"] = [] if content is None else [{"type": "text", "text": content}]
        if out.get("role") == "assistant":
            reasoning = out.get("reasoning", out.get("reasoning_content"))
            if reasoning is not None:  # vLLM gives the template both names
                out["reasoning"] = out["reasoning_content"] = reasoning
            calls = out.get("tool_calls")
            if isinstance(calls, list):
                if calls:
                    out["tool_calls"] = [_with_object_arguments(c) for c in calls]
                else:
                    del out["tool_calls"]
        return out


def extra_template_inputs(body: Request) -> dict[str, object]:
    """The extra inputs vLLM gives the chat template for the chat body ``body``: its
    ``chat_template_kwargs``, and a ``reasoning_effort`` (with ``enable_thinking`` set from it
    unless given, for templates where thinking is opt-in)."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    effort = body.get("reasoning_effort")
    if effort is not None:
        kwargs.setdefault("enable_thinking", effort != "none")
        kwargs["reasoning_effort"] = effort
    return kwargs


def _texts(content: object) -> list[str] | None:
    """The texts of a content that is nothing but text (None: none), else None."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" for p in content):
        return [str(p.get("text") or "") for p in content]
    return None


def _one_system_message(messages: list[ServedMessage]) -> list[ServedMessage]:
    """After developer messages became system ones: every system message merged into one,
    first (some templates refuse a system message anywhere else), as vLLM does."""
    systems = [i for i, m in enumerate(messages) if m.get("role") == "system"]
    if not systems or systems == [0]:
        return messages
    texts = []
    for i in systems:
        joined = _texts(messages[i].get("content"))
        text = "\n".join(joined) if joined is not None else ""
        if text:
            texts.append(text)
    rest = [m for m in messages if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def _with_object_arguments(call: object) -> object:
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    raw = function.get("arguments")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw else {}
        except ValueError:
            raw = {}
    return {**call, "function": {**function,
                                 "arguments": raw if isinstance(raw, dict) else {}}}
