"""Build-time helpers for the API reference (``make docs``); they change what is rendered, never the sources.

- No filter on mkdocs-autorefs: it reads ``[text][id]`` as a cross-reference on every page, and a broken one
  fails the strict build (guides and API pages alike). Bracketed tags that are text, not references, are written
  so that they are not ``[a][b]`` (in code spans, or with an escaped bracket ``\\[a]\\[b]``).
- A Griffe extension (mkdocstrings ``extensions:``). The docstrings are Google-style sections around free text
  written for ``help()`` and doctest: a doctest at the left margin (``>>>`` lines up to the next blank line) would
  read as nested Markdown block quotes, so it is fenced as a ``pycon`` block; reST roles (``:func:`x```) become
  plain inline code; a reST literal-block marker (``text::`` before an indented block, already a Markdown code
  block) becomes ``text:``.
"""
from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|obj|exc|const):`(~?)([^`]+)`")


def _role(m: re.Match) -> str:
    target = m[2]
    return f"`{target.rsplit('.', 1)[-1] if m[1] else target}`"


def docstring_markdown(text: str) -> str:
    """The Markdown that MkDocs should see for a docstring written in the reST / doctest idiom."""
    lines = _ROLE.sub(_role, text).split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(">>>"):
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            if out and out[-1].strip():
                out.append("")
            out += ["```pycon", *lines[i:j], "```"]
            i = j
            continue
        if line.rstrip().endswith("::"):
            indent = len(line) - len(line.lstrip())
            nxt = next((k for k in lines[i + 1:] if k.strip()), "")
            if len(nxt) - len(nxt.lstrip()) > indent:
                head = line.rstrip()[:-2].rstrip()
                line = "" if not head.strip() else (head if head.endswith(" ") else head + ":")
        out.append(line)
        i += 1
    return "\n".join(out)


class DocstringMarkdown(griffe.Extension):
    """Rewrite every docstring of a loaded package with `docstring_markdown` (aliases share their target's)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:  # noqa: ARG002
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.docstring is not None:
                obj.docstring.value = docstring_markdown(obj.docstring.value)
            stack.extend(m for m in obj.members.values() if not m.is_alias)
