"""MkDocs hook (mkdocs.yml `hooks:`): the site's home page carries sections of README.md, so that
the set-up and the tour have one source.

In a page, a block

    <!-- readme: Set-up: two commands -->
    text shown where the page is read without the site (e.g. a pointer to README.md)
    <!-- /readme -->

is replaced at build time by the README's section of that heading (the heading line and all up
to the next heading of the same or a higher level), its links to `docs/PAGE.md` made relative to
the site. A heading the README lacks fails the build with its name.

The docstrings of src/qkv cross-reference in Sphinx's way (:class:`Translator`); the API reference
(docs/api.md, rendered by mkdocstrings) shows such a name as code, without the role.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"
BLOCK = re.compile(r"^<!-- readme: (.+?) -->\n.*?^<!-- /readme -->$", re.MULTILINE | re.DOTALL)
FENCE = re.compile(r"^(```|~~~)")
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):(?=<code>)")


def readme_section(text: str, heading: str) -> str:
    """The section of ``text`` under the Markdown heading ``heading``, heading line included."""
    lines = text.splitlines()
    start = level = None
    in_code = False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            in_code = not in_code
        if in_code:
            continue
        m = re.match(r"^(#{1,6})\s+(.+?)\s*$", line)
        if not m:
            continue
        if start is None and m.group(2) == heading:
            start, level = i, len(m.group(1))
        elif start is not None and len(m.group(1)) <= level:
            return "\n".join(lines[start:i]).rstrip() + "\n"
    if start is None:
        raise ValueError(f"README.md has no section headed '{heading}' (asked for by a '<!-- readme: ... -->' block)")
    return "\n".join(lines[start:]).rstrip() + "\n"


def site_links(section: str) -> str:
    """README links to ``docs/PAGE.md`` as the site's pages link them: ``PAGE.md`` (a link whose
    text is the path loses the ``docs/`` there too)."""
    section = re.sub(r"\[docs/([^\]]*)\]\(docs/", r"[\1](", section)
    return re.sub(r"\]\(docs/", "](", section)


def inject(markdown: str, readme: str) -> str:
    return BLOCK.sub(lambda m: site_links(readme_section(readme, m.group(1))).rstrip("\n"), markdown)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (the hook's signature)
    if "<!-- readme: " not in markdown:
        return markdown
    return inject(markdown, README.read_text(encoding="utf-8"))


def on_page_content(html, page, config, files):  # noqa: ARG001 (the hook's signature)
    return ROLE.sub("", html)
