"""The documentation: the site builds in strict mode, links resolve, and it speaks of the project only.

The strict build needs MkDocs (``pip install -c constraints.txt -e ".[docs]"``) and is skipped
without it; the other checks read the Markdown files directly and always run.
"""

from __future__ import annotations

import html
import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT))
from mkdocs_hooks import inject, readme_section  # noqa: E402 (the site's hook, beside mkdocs.yml)

# What the documentation, README and recipes must not say: the project's working history
# ("session 12", "issue 3") means nothing to a user.
FORBIDDEN = re.compile(rb"session|issue\s*#?[0-9]", re.IGNORECASE)
SKIPPED_DIRS = {"__pycache__", ".pytest_cache"}


def _markdown_pages() -> list[Path]:
    """README.md, every docs/*.md and every recipe README: the pages whose links must resolve."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((ROOT / "recipes").glob("*/README.md"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `mkdocs build --strict` makes it (skipped without the docs extra)."""
    for module in ("mkdocs", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not installed: pip install -c constraints.txt -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert "WARNING" not in output, output
    return out


def test_mkdocs_build_strict(site):
    assert (site / "index.html").is_file()
    assert (site / "results" / "index.html").is_file()


def _readme_commands(heading: str) -> list[str]:
    """The command lines of the fenced blocks in the README section under ``heading`` (comments dropped)."""
    section = readme_section((ROOT / "README.md").read_text(), heading)
    blocks = re.findall(r"^```bash\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_home_page_carries_the_readme_set_up_and_tour(site):
    page = html.unescape(re.sub(r"<[^>]+>", "", (site / "index.html").read_text()))
    commands = _readme_commands("Set-up: two commands") + _readme_commands("A short tour")
    assert any("qkv train --out runs/default" in c for c in commands)
    missing = [c for c in commands if c not in page]
    assert not missing, f"README commands missing from the site's home page: {missing}"


def test_readme_block_is_replaced_by_its_section_and_a_missing_heading_is_named():
    readme = "# t\n\n## A\n\ntext [x](docs/x.md#y)\n\n```bash\n## not a heading\n```\n\n### A.1\n\nsub\n\n## B\n\nb\n"
    page = "before\n<!-- readme: A -->\nsee the README\n<!-- /readme -->\nafter\n"
    assert inject(page, readme) == ("before\n## A\n\ntext [x](x.md#y)\n\n```bash\n## not a heading\n```\n\n"
                                    "### A.1\n\nsub\nafter\n")
    with pytest.raises(ValueError, match="no section headed 'C'"):
        inject("<!-- readme: C -->\n<!-- /readme -->\n", readme)


def test_api_reference_is_generated_from_the_docstrings(site):
    page = (site / "api" / "index.html").read_text()
    for name in ("qkv.load", "qkv.frontends.Translator.translate", "qkv.frontends.Translator.translate_scored",
                 "qkv.frontends.Translator.cross_attention", "qkv.frontends.Encoder.classify",
                 "qkv.frontends.LanguageModel.generate", "qkv.config.ModelConfig", "qkv.config.DecodeConfig",
                 "qkv.nn.attention.MultiHeadAttention", "qkv.nn.positional.SinusoidalPositionalEncoding"):
        assert f'id="{name}"' in page, f"{name} missing from the API reference (docs/api.md)"
    # a docstring's own words, not only the names: the reference is read from the code
    from qkv.frontends import Translator

    first_line = Translator.translate_scored.__doc__.split(";")[0]
    assert first_line.replace("``", "")[:30] in re.sub(r"<[^>]+>", "", page).replace("&#39;", "'")


def test_no_session_or_issue_wording():
    offending = []
    for top in (DOCS, ROOT / "README.md", ROOT / "recipes"):
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            if SKIPPED_DIRS & set(path.relative_to(ROOT).parts):
                continue
            for number, line in enumerate(path.read_bytes().splitlines(), 1):
                if FORBIDDEN.search(line):
                    text = line.decode("utf-8", "replace").strip()
                    offending.append(f"{path.relative_to(ROOT)}:{number}: {text}")
    assert not offending, "say what was tried and measured, not when:\n" + "\n".join(offending)


def _strip_code(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """The anchor of a heading, as Python-Markdown's toc extension (MkDocs) and GitHub make it
    for the ASCII headings used here."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    heading = heading.replace("`", "").replace("*", "")
    heading = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    heading = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", heading)


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _strip_code(page.read_text()),
                                                    flags=re.MULTILINE)}


LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")


def test_relative_links_point_at_existing_files():
    broken = []
    for page in _markdown_pages():
        for target in LINK.findall(_strip_code(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif not dest.resolve().is_relative_to(ROOT):
                broken.append(f"{where} (outside the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in DOCS.glob("*.md") if not re.search(rf":\s*{re.escape(p.name)}\s*$", nav, re.MULTILINE)]
    assert not missing, f"docs pages missing from the nav of mkdocs.yml: {missing}"
