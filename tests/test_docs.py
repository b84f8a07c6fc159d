"""The documentation: the site builds in strict mode, links resolve, and it speaks of the project only.

The strict build needs MkDocs (``pip install -c constraints.txt -e ".[docs]"``) and is skipped
without it; the other checks read the Markdown files directly and always run.
"""

from __future__ import annotations

import html
import importlib.util
import json
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
    assert not re.search(r":(?:class|func|meth|mod|attr):", re.sub(r"<[^>]+>", "", page)), "a Sphinx role shown raw"


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


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading when it renders a Markdown file (github-slugger's rule): the
    rendered text lower-cased, every character but letters (any script, kept as they are), digits, marks,
    '_', '-' and spaces removed, and each space a '-' (no collapsing: "a (--b)" -> "a---b")."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    heading = heading.replace("`", "").replace("*", "").lower()
    kept = "".join(c for c in heading if c.isalnum() or c in " -_" or unicodedata.category(c).startswith("M"))
    return kept.replace(" ", "-")


def _headings(page: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _strip_code(page.read_text()),
                                            flags=re.MULTILINE)]


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in _headings(page)}


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


def test_the_two_slug_rules_as_their_renderers_make_them():
    """The site's rule is Python-Markdown's own toc slugify (what MkDocs runs); GitHub's, by hand."""
    toc = pytest.importorskip("markdown.extensions.toc")
    cases = {"Compiled decoding (`--compile`)": ("compiled-decoding-compile", "compiled-decoding---compile"),
             "Multi30k en→de": ("multi30k-ende", "multi30k-ende"),
             "Café — Ünïcode": ("cafe-unicode", "café--ünïcode"),
             "The [lab](lab.md): *runs*": ("the-lab-runs", "the-lab-runs")}
    for heading, (site, github) in cases.items():
        rendered = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
        assert _slug(heading) == toc.slugify(rendered, "-") == site, heading
        assert _github_slug(heading) == github, heading


def test_anchors_work_on_github_and_on_the_site():
    """A link's anchor names the same heading under both rules: the README and the docs pages are read on the
    code host (GitHub's anchors) and on the MkDocs site (Python-Markdown's), and the two differ on punctuation
    between spaces and on non-ASCII letters."""
    broken = []
    for page in _markdown_pages():
        for target in LINK.findall(_strip_code(page.read_text())):
            path_part, _, anchor = target.partition("#")
            if not anchor or re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue
            dest = (page.parent / path_part).resolve() if path_part else page
            if dest.suffix != ".md" or not dest.exists():
                continue
            both = [h for h in _headings(dest) if _slug(h) == anchor == _github_slug(h)]
            if not both:
                site = [h for h in _headings(dest) if _slug(h) == anchor]
                broken.append(f"{page.relative_to(ROOT)}: {target}" + (
                    f" (GitHub's anchor of '{site[0]}' is #{_github_slug(site[0])})" if site else ""))
    assert not broken, "anchors that one of the renderers does not make:\n" + "\n".join(broken)


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in DOCS.glob("*.md") if not re.search(rf":\s*{re.escape(p.name)}\s*$", nav, re.MULTILINE)]
    assert not missing, f"docs pages missing from the nav of mkdocs.yml: {missing}"


# --- the embedded default task's headline figures: one source, docs/headline.json -----------------

sys.path.insert(0, str(ROOT / "benchmarks"))
import headline  # noqa: E402 (benchmarks/headline.py)


def test_every_page_quotes_the_headline_figures_of_docs_headline_json():
    figures = headline.headline()
    assert isinstance(figures["exact_match_percent"], (int, float)) and isinstance(figures["wall_time_s"], (int, float))
    assert headline.disagreements(figures) == [], "run python benchmarks/headline.py --write"
    # the pages do quote it (a page that stopped quoting would pass the check above vacuously)
    readme = (ROOT / "README.md").read_text()
    assert f"about {round(figures['wall_time_s'] / 60)} minutes on an idle 2-core machine" in readme
    results = (DOCS / "results.md").read_text()
    assert f"{figures['exact_match_percent']:.1f}% exact match" in results
    assert f"{figures['wall_time_s']:.0f} s end to end" in results


def test_a_page_disagreeing_with_the_headline_is_named():
    figures = dict(headline.headline(), exact_match_percent=12.3, wall_time_s=600)
    found = headline.disagreements(figures)
    assert any(f.startswith("README.md:") and "exact match" in f and "gives 12.3" in f for f in found), found
    assert any(f.startswith("README.md:") and "minutes" in f and "gives 10" in f for f in found), found


def test_placeholders_stay_in_the_source():
    assert headline.PLACEHOLDER in headline.SOURCE.read_text()  # the per-magnitude figures, until measured
    quoting = [p.relative_to(ROOT) for p in _markdown_pages() if headline.PLACEHOLDER in p.read_text()]
    assert not quoting, f"pages quoting a placeholder of docs/headline.json: {quoting}"


# --- the README's tour: commands that parse, finish, and fit together ----------------------------

def _commands(text: str) -> list[list[str]]:
    """The `qkv ...` command lines of the fenced bash blocks in ``text`` (continuations joined,
    comments dropped), split as a shell would."""
    import shlex

    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["qkv"]:
                out.append(words[1:])
    return out


@pytest.mark.parametrize("page, heading", [("README.md", "A short tour"),
                                           ("docs/translation.md", "Train on your own parallel text")])
def test_tour_commands_parse_finish_and_average_what_training_keeps(page, heading, monkeypatch):
    from qkv.cli import COMMANDS, resolve_configs
    from qkv.cli_options import build_parser

    monkeypatch.chdir(ROOT)  # the commands name recipes/... relative to the repository
    parser = build_parser({name: (lambda args: 0) for name in COMMANDS})
    commands = [parser.parse_args(words) for words in _commands(readme_section((ROOT / page).read_text(), heading))]
    train = next(a for a in commands if a.command == "train" and a.src_train)
    _, train_cfg, _ = resolve_configs(train)
    assert train_cfg.max_steps <= 10_000 or 0 < train_cfg.max_time <= 3600, \
        f"{page}: the tour's training is not bounded: {train_cfg.max_steps} updates, max_time {train_cfg.max_time}"
    averages = [a for a in commands if a.command == "average"]
    assert averages, f"{page}: no qkv average in the tour"
    for average in averages:
        assert average.inputs == [train.out], "the tour averages the run it trained"
        kept = min(train_cfg.keep_last, train_cfg.max_steps // train_cfg.eval_every)
        assert average.last <= kept, (f"{page}: qkv average --last {average.last}, but the run keeps {kept} "
                                      f"step_N/ checkpoints (keep_last {train_cfg.keep_last}, one every "
                                      f"{train_cfg.eval_every} of {train_cfg.max_steps} updates)")


def test_home_page_table_lists_every_page():
    table = (DOCS / "index.md").read_text()
    pages = [p.name for p in DOCS.glob("*.md") if p.name != "index.md"]
    missing = [name for name in pages if f"]({name})" not in table]
    assert not missing, f"docs/index.md's page table lacks: {missing}"


def test_no_page_calls_an_existing_task_in_progress():
    from qkv.tasks import TASKS

    stale = []
    for page in _markdown_pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if re.search(r"in progress|not yet (?:implemented|available)|\bTODO\b", line):
                stale.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not stale, f"the tasks that exist: {sorted(TASKS)}; stale wording:\n" + "\n".join(stale)


# --- the docs' Python examples run, against the fixture translation checkpoint ------------------

def _python_examples() -> list[tuple[str, int, str]]:
    """(page, block number, code) of every ```python block that opens the README's default run."""
    found = []
    for page in _markdown_pages():
        blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        found += [(str(page.relative_to(ROOT)), i, code) for i, code in enumerate(blocks, 1)
                  if 'qkv.load("runs/default/best")' in code]
    return found


def test_the_python_examples_include_translate_scored_and_cross_attention():
    code = "\n".join(c for page, _, c in _python_examples() if page == "docs/inference.md")
    assert "translate_scored(" in code and "cross_attention(" in code and "hypotheses(" in code


# the optional packages a docs example may use (by name, e.g. engine="ctranslate2"), and the extra that installs each
EXAMPLE_EXTRAS = {"ctranslate2": "export", "transformers": "export", "fastapi": "serve", "matplotlib": "viz"}


def test_an_example_without_its_optional_package_skips_naming_the_install(monkeypatch):
    """A docs example that needs an optional package skips, with the command that installs it, where the
    package is absent (as on a machine with only the core dependencies)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ctranslate2" else real(name, *a))
    with pytest.raises(pytest.skip.Exception, match=r"pip install -c constraints.txt -e '\.\[export\]'"):
        test_python_example_runs("docs/x.md", 1, 'qkv.load("runs/default/best", engine="ctranslate2")', None, None, None)


@pytest.mark.parametrize("page, number, code", _python_examples(), ids=lambda v: str(v)[:20])
def test_python_example_runs(page, number, code, tmp_path, monkeypatch, capsys):
    for module, extra in EXAMPLE_EXTRAS.items():  # an example that decodes with an optional package
        if module in code and importlib.util.find_spec(module) is None:
            pytest.skip(f"{page}, python block {number} needs {module}: pip install -c constraints.txt -e '.[{extra}]'")
    (tmp_path / "runs" / "default").mkdir(parents=True)
    (tmp_path / "runs" / "default" / "best").symlink_to(ROOT / "tests" / "fixtures" / "checkpoints" / "translate-transformer")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page}, python block {number}", "exec"), {"__name__": "__docs__"})


# --- the results page: a glance, not a journal --------------------------------------------------

def test_results_page_is_short_tables_without_commits_or_times_of_day():
    text = (DOCS / "results.md").read_text()
    prose = _strip_code(re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL))
    commits = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", prose) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not commits, f"commit hashes in docs/results.md (they belong in the tuning journal): {commits}"
    times = re.findall(r"\b\d\d:\d\dZ?\b|\b\d{4}Z\b", prose)
    assert not times, f"times of day in docs/results.md: {times}"
    assert "How we got here" not in text, "the story of a result goes in the tuning journal"
    prose_cells = [c.strip() for line in text.splitlines() if line.startswith("|")
                   for c in line.strip("|").split("|") if not c.strip().startswith("`")]
    long_cells = [c for c in prose_cells if len(c) > 120]
    assert not long_cells, f"paragraph-long cells in docs/results.md: {long_cells}"
    # each task's section has its table
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[2:]:
        assert re.search(r"^\| --- ", section, flags=re.MULTILINE), f"no table under '{section.splitlines()[0]}'"


def test_results_page_has_the_default_task_per_magnitude_and_no_placeholder():
    """The per-class table of the embedded default quotes docs/headline.json, and no figure is left to
    come (no SPOT comment, no placeholder)."""
    text = (DOCS / "results.md").read_text()
    assert "<!-- SPOT" not in text and "TO BE MEASURED" not in text
    headline = json.loads((DOCS / "headline.json").read_text())
    for name, percent in headline["per_magnitude_exact_match_percent"].items():
        row = f"| {name.replace('-', '–')} | "
        line = next(line for line in text.splitlines() if line.startswith(row))
        assert f"{percent:.1f}% ({headline['per_magnitude_right'][name]})" in line, line
    for spot in ("Hugging Face `generate()` with the exported generation config", "model cards whose code runs"):
        assert spot in text, spot


def test_readme_lists_user_documentation_only():
    assert "tuning-journal" not in (ROOT / "README.md").read_text()
