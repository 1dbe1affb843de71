"""The messages as vLLM hands them to the chat template, for the gateway's own renderings (the
context-length count, token continuity's new messages).

vLLM does not pass a request's messages to the template as they came. For a template that
takes each message's content as a string (one that never loops over it: most text models'),
a content given as a list of text parts is joined with newlines, and a missing content is an
empty string; for one that loops over content parts it stays a list. A ``developer`` message
becomes a ``system`` one for a template that does not name that role, and an assistant's tool
call arguments are given as an object (a JSON string decoded; anything that is not an object
becomes ``{}``), as templates expect them. Rendered otherwise,
a later turn would carry tokens the server never renders (a Python list's repr, an empty
user turn) or fail in the template.
"""

from __future__ import annotations

import json
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]


def _unwrapped(node: Any) -> Any:
    """``node`` without the filters, tests and slices around it."""
    import jinja2.nodes as n

    while True:
        if isinstance(node, n.Filter | n.Test):
            node = node.node
        elif isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
            node = node.node
        else:
            return node


def _reads_content(node: Any) -> bool:
    """``node`` reads an item's content: ``x.content`` or ``x['content']``."""
    import jinja2.nodes as n

    node = _unwrapped(node)
    if isinstance(node, n.Getattr):
        return node.attr == "content"
    return isinstance(node, n.Getitem) and isinstance(node.arg, n.Const) \
        and node.arg.value == "content"


def _content_params(ast: Any) -> dict[int, set[str]]:
    """Per macro (by id), its parameters that some call of it passes a content in."""
    import jinja2.nodes as n

    calls = [c for c in ast.find_all(n.Call) if isinstance(c.node, n.Name)]
    out: dict[int, set[str]] = {}
    for macro in ast.find_all(n.Macro):
        names = [a.name for a in macro.args]
        params = set()
        for call in (c for c in calls if c.node.name == macro.name):
            params |= {names[i] for i, a in enumerate(call.args[:len(names)])
                       if _reads_content(a)}
            params |= {k.key for k in call.kwargs if k.key in names and _reads_content(k.value)}
        out[id(macro)] = params
    return out


def content_format(chat_template: Any) -> ContentFormat:
    """``openai`` when the template loops over a message's content (it takes lists of
    parts), else ``string``, as vLLM's ``--chat-template-content-format auto`` decides: a
    loop over ``x.content``, over a variable named ``content`` outside macros, or inside a
    macro over a parameter that a call passes a content in."""
    if not isinstance(chat_template, str):
        return "string"
    import jinja2
    import jinja2.nodes as n

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
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

    def __init__(self, tokenizer: Any) -> None:
        template = getattr(tokenizer, "chat_template", None)
        self.format = content_format(template)
        self.developer_role = isinstance(template, str) and (
            '"developer"' in template or "'developer'" in template)

    def __call__(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self._message(m) for m in messages]

    def _message(self, message: dict[str, Any]) -> dict[str, Any]:
        out = dict(message)
        if out.get("role") == "developer" and not self.developer_role:
            out["role"] = "system"
        content = out.get("content")
        if self.format == "string" or out.get("role") == "tool":
            # vLLM joins a tool message's text parts whatever the template
            if content is None:
                out["content"] = ""
            elif isinstance(content, list) and all(
                    isinstance(p, dict) and p.get("type") == "text" for p in content):
                out["content"] = "\n".join(str(p.get("text", "")) for p in content)
        calls = out.get("tool_calls")
        if out.get("role") == "assistant" and isinstance(calls, list):
            if calls:
                out["tool_calls"] = [_with_object_arguments(c) for c in calls]
            else:
                del out["tool_calls"]
        return out


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
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
