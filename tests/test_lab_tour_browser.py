"""docs/lab.md's guided tour, walked end to end in headless Chromium: every step's controls exist and
produce the panel the tour describes, in the tour's order (tests/lab_tour.py, whose script made the
screenshots). Runs the tour starts wait instead of training (a stand-in process); the look-inside
steps read the test fixtures' checkpoints, copied in as runs an earlier lab left.

Skipped where Playwright or Chromium is missing (set-up: see tests/test_serve_browser.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='the lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')
pytest.importorskip("uvicorn", reason='the lab needs uvicorn: pip install -c constraints.txt -e ".[serve]"')
sync_api = pytest.importorskip("playwright.sync_api",
                               reason='the browser test needs playwright: pip install -c constraints.txt -e ".[test]"')

from qkv.lab import runs as lab_runs  # noqa: E402
from qkv.lab.app import create_app  # noqa: E402
from qkv.lab.runs import Lab, LabLimits  # noqa: E402
from qkv.serve import BackgroundServer  # noqa: E402

import lab_tour  # noqa: E402
from conftest import needs_chromium  # noqa: E402

pytestmark = needs_chromium
ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
PAGE_MS = 120_000  # a loaded machine


class Waiter(subprocess.Popen):
    """A stand-in for ``qkv train``: a process that waits until it is signalled, writing nothing."""

    def __init__(self, argv, **kwargs):
        super().__init__([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)


class Spawning:
    """``subprocess`` as qkv.lab.runs sees it, with the stand-in for Popen (Playwright's own driver keeps the real one)."""

    Popen = Waiter

    def __getattr__(self, name):
        return getattr(subprocess, name)


def tour_section() -> str:
    text = (ROOT / "docs" / "lab.md").read_text(encoding="utf-8")
    start = text.index("## A guided tour")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_docs_tour_has_a_screenshot_per_step_in_order():
    images = re.findall(r"!\[[^\]]*\]\((img/tour/[^)]+\.png)\)", tour_section())
    assert images == [f"img/tour/{i:02d}-{name}.png" for i, (name, _) in enumerate(lab_tour.STEPS, 1)]
    for image in images:
        size = (ROOT / "docs" / image).stat().st_size
        assert 2_000 < size < 120_000, (image, size)  # small: tens of KB


@pytest.fixture
def tour(browser, tmp_path, monkeypatch):
    monkeypatch.setattr(lab_runs, "subprocess", Spawning())
    root = tmp_path / "runs"
    for name, checkpoint, arch in (("tr", "translate-transformer", "transformer"),
                                   ("lstm", "translate-lstm-general", "lstm")):
        (root / name).mkdir(parents=True)
        shutil.copytree(FIXTURES / checkpoint, root / name / "last")
        (root / name / "lab.json").write_text(json.dumps({"name": name, "task": "reverse", "preset": arch,
                                                          "model": {"arch": arch}}))
    lab = Lab(root, LabLimits(max_runs=4))
    with BackgroundServer(create_app(lab)) as server:
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.set_default_timeout(PAGE_MS)
        problems = []
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(server.url + "/")
        page.wait_for_selector("#task option", state="attached")
        yield lab_tour.Tour(page, transformer="tr", rnn="lstm", rnn_plain="lstm"), lab
        page.close()
        assert problems == []
    assert not lab.running()


# what each step's panel shows, as the tour says (checked right after the step)
CHECKS = {
    "rnn": lambda page: page.locator("#runs tr:has-text('lstm-reverse')").count() == 1,
    "rnn-attention": lambda page: page.input_value("#metric") == "valid_exact",
    "transformer": lambda page: page.locator("#heads table, #heads figure").count() >= 2
    and page.input_value("#kind") == "cross",
    "scores": lambda page: page.locator("#panel-attention th:has-text('d_k = 1024')").count() == 1,
    "positions": lambda page: page.locator("#panel-positions canvas").count() == 2,
    "masks": lambda page: page.locator("#panel-masks table.grid").count() == 4,
    "step-by-step": lambda page: page.locator("#panel-steps .stage").count() == 6
    and "cross-attention, layer 2 of 2, head 1 of" in page.inner_text("#panel-steps .out")
    and "temperature 0.50" in page.inner_text("#panel-steps .out"),
    "model-view": lambda page: page.get_attribute("#panel-model .modelview", "data-focus") == "source:3",
    "gates": lambda page: "forget gate" in page.inner_text("#panel-gates .out"),
    "vanishing-gradient": lambda page: page.locator("#panel-gradients polyline").count() == 2,
    "schedule": lambda page: page.locator("#panel-schedule polyline").count() == 4
    and "def noam(" in page.inner_text("#panel-schedule pre.code"),
    "label-smoothing": lambda page: "0.9100 on gold" in page.inner_text("#panel-smoothing .out"),
}


def test_walk_the_tour(tour):
    t, lab = tour
    assert list(CHECKS) == [name for name, _ in lab_tour.STEPS]
    for name, step in lab_tour.STEPS:
        element = step(t)
        for part in element if isinstance(element, tuple) else (element,):
            assert part.is_visible(), name
        assert CHECKS[name](t.page), name
    assert t.started == ["lstm-reverse", "lstm-attention-reverse", "transformer-reverse", "transformer-no-positions"]
    assert [lab.describe(n)["preset"] for n in t.started] == ["lstm", "lstm+attention", "transformer", "transformer"]
    assert lab.describe("transformer-no-positions")["model"]["positional"] == "none"
    assert lab.describe("transformer-reverse")["model"]["positional"] == "sinusoidal"
    # the form offers the scores and positions the tour compares, from qkv's own lists
    assert {"dot", "scaled_dot", "general", "additive", "cosine", "location"} <= set(t.seen["scores"])
    from qkv.config import POSITIONALS

    assert set(POSITIONALS) == set(t.seen["positional"]) and {"sinusoidal", "learned", "none"} <= set(POSITIONALS)
