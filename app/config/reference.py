"""``docs/configuration.md`` rendered from ``config/default.yaml``: every key, its default
and its comment, one table per section. The YAML stays the one source; a test fails when the
page and the file disagree (``carryover config docs > docs/configuration.md`` rewrites it).
"""

from __future__ import annotations

import re
from pathlib import Path

from app.config.loader import DEFAULT_CONFIG_PATH

_LINE = re.compile(
    r"^(?P<indent> *)(?P<key>[A-Za-z_][\w]*):(?P<value>[^#]*?)\s*(?:#\s?(?P<doc>.*))?$")
_CONT = re.compile(r"^ +#\s?(?P<doc>.*)$")

HEADER = """# Configuration

Every key carryover reads, with its default and meaning, generated from
`config/default.yaml` (`carryover config docs` prints this page). A config file needs only the
sections it changes; the command line takes verl's `a.b.c=value` form. Unknown keys are
rejected with the nearest valid key suggested, and every value is checked at start: one line
per problem names the key, the value and the rule (`carryover config show` prints the
effective configuration or those lines).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").strip()


def render(path: Path = DEFAULT_CONFIG_PATH) -> str:
    rows: list[list[str]] = []        # [section, key, default, doc]
    stack: list[tuple[int, str]] = []
    last: list[str] | None = None
    for line in path.read_text().splitlines():
        cont = _CONT.match(line)
        if cont and last is not None and len(line) - len(line.lstrip()) > 0:
            last[3] = (last[3] + " " + cont["doc"]).strip()
            continue
        m = _LINE.match(line)
        if not m:
            last = None if not line.strip() else last
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([k for _, k in stack] + [m["key"]])
        value = m["value"].strip()
        if not value:  # a mapping: its children follow
            stack.append((indent, m["key"]))
            last = None
            continue
        last = [key.split(".")[0], key, value, (m["doc"] or "").strip()]
        rows.append(last)
    out = [HEADER]
    section = None
    for sec, key, value, doc in rows:
        if sec != section:
            section = sec
            out.append(f"\n## `{sec}`\n\n| key | default | meaning |\n|---|---|---|")
        out.append(f"| `{key}` | `{_cell(value)}` | {_cell(doc)} |")
    return "\n".join(out) + "\n"
