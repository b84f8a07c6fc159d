"""The pages say what is, for users: tables render as tables, the layout lists every package, the paper's
checkpoint averaging has its row, and the results and translation pages hold no history (that goes to
the tuning journal, which stays out of the site's main navigation)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((ROOT / "recipes").glob("*/README.md"))]


def _without_code(text: str) -> list[str]:
    """The lines of a Markdown page outside fenced code blocks (those inside become empty)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    return lines


def table_problems(text: str) -> list[str]:
    """Lines that start a table row but do not render as one: a run of ``|`` lines must follow a blank
    line, have a separator second, and be followed by a blank line."""
    lines, problems, i = _without_code(text), [], 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        if i and lines[i - 1].strip():
            problems.append(f"line {i + 1}: a table with no blank line before it")
        if j - i < 2 or not re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", lines[i + 1].strip()):
            problems.append(f"line {i + 1}: rows with no header and separator (rendered as text): {lines[i][:60]}")
        if j < len(lines) and lines[j].strip():
            problems.append(f"line {j + 1}: text right after a table: {lines[j][:60]}")
        i = j
    return problems


def test_table_problems_are_found():
    good = "a\n\n| x | y |\n| --- | --- |\n| 1 | 2 |\n\nb\n"
    assert table_problems(good) == []
    assert table_problems("a\n\n| x | y |\n| --- | --- |\n\n| 1 | 2 |\n## h\n")  # the results-page row that was text
    assert table_problems("a\n| x |\n| --- |\n\n")
    assert table_problems("```\n| not a table |\n```\n") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_row_renders_as_a_table_row(page):
    assert table_problems(page.read_text(encoding="utf-8")) == []


def test_the_layout_on_the_home_page_lists_every_package():
    layout = re.search(r"## Layout of the repository\n\n```\n(.*?)```", (DOCS / "index.md").read_text(), flags=re.S)
    listed = set(re.findall(r"^(src/qkv/\S+?)/?\s", layout.group(1), flags=re.M))
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "src" / "qkv").glob("*/__init__.py")}
    assert {"src/qkv/serve", "src/qkv/lab", "src/qkv/export"} <= packages
    assert packages <= listed, packages - listed


def test_concepts_has_checkpoint_averaging_of_section_6_1():
    rows = [line for line in (DOCS / "concepts.md").read_text().splitlines()
            if line.startswith("| Checkpoint averaging (6.1)")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert "last 5 checkpoints" in cells[1] and "last 20" in cells[1]
    path = re.search(r"`(src/qkv/\S+\.py)`", cells[2]).group(1)
    module = importlib.import_module(path[len("src/"):-len(".py")].replace("/", "."))
    for name in re.findall(r"`(\w+)`", cells[3]):
        assert hasattr(module, name), (path, name)


# sentences of history: what a page said of an earlier recipe, config or commit
HISTORY = re.compile(r"before this one|the former|former config|today's|now carries|before and after|"
                     r"previous commit|earlier commit|faster than before|\bbefore:", re.IGNORECASE)


@pytest.mark.parametrize("name", ["results.md", "translation.md"])
def test_results_and_translation_pages_hold_no_history(name):
    lines = _without_code((DOCS / name).read_text(encoding="utf-8"))
    found = [f"{name}:{i}: {line.strip()[:100]}" for i, line in enumerate(lines, 1) if HISTORY.search(line)]
    assert not found, "history belongs in docs/tuning-journal.md:\n" + "\n".join(found)


def test_the_tuning_journal_is_out_of_the_main_navigation():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    top = [line for line in nav.splitlines() if re.match(r"  - ", line)]
    assert not any("tuning-journal.md" in line for line in top), top
    journal = next(i for i, line in enumerate(nav.splitlines()) if "tuning-journal.md" in line)
    section = next(line for line in reversed(nav.splitlines()[:journal]) if re.match(r"  - ", line))
    assert section.strip() == "- Development:"
