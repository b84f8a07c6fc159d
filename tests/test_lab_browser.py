"""qkv lab in a real browser: headless Chromium driven by Playwright, as tests/test_serve_browser.py.

Starts a Transformer and an LSTM with attention on the copy task (small ones, a few hundred updates,
real ``qkv train`` processes), watches both validation curves rise on one chart, types an input and
sees the attention of every head, stops a run, and opens every concept panel (``[id^=panel-]``).
Screenshots go to the test's tmp dir; ``QKV_LAB_SCREENSHOTS=docs/img`` also copies them there (how
docs/img/lab*.png are made)::

    QKV_LAB_SCREENSHOTS=docs/img python -m pytest tests/test_lab_browser.py

Skipped where Playwright or Chromium is missing.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='qkv lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')
pytest.importorskip("uvicorn", reason='qkv lab needs uvicorn: pip install -c constraints.txt -e ".[serve]"')
sync_api = pytest.importorskip("playwright.sync_api",
                               reason='the browser test needs playwright: pip install -c constraints.txt -e ".[test]"')

from qkv.lab.app import create_app, default_panels  # noqa: E402
from qkv.lab.runs import Lab, LabLimits  # noqa: E402
from qkv.serve import BackgroundServer  # noqa: E402

from conftest import CHROMIUM, needs_chromium  # noqa: E402

pytestmark = needs_chromium
PAGE_MS = 60_000
TRAIN_S = 300  # at most, for both curves to rise on a loaded machine (about a minute on an idle one)
PLACEHOLDER = """<section id="panel-placeholder"><details><summary>a concept panel</summary>
<p>placeholder: the package has no panels.html</p></details></section>"""


@pytest.fixture
def lab_server(tmp_path):
    panels = default_panels()
    if panels is None:  # the concept panels are not in the package: a stand-in, so the page's marker is tested
        panels = tmp_path / "panels.html"
        panels.write_text(PLACEHOLDER, encoding="utf-8")
    lab = Lab(tmp_path / "runs", LabLimits(max_runs=2, run_threads=1, max_time=TRAIN_S))
    with BackgroundServer(create_app(lab, panels=panels)) as s:
        yield s, lab
    assert not lab.running()  # the lab's end stopped its runs


@pytest.fixture
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def save(page, tmp_path: Path, name: str, element=None) -> Path:
    shot = tmp_path / name
    (element or page).screenshot(path=str(shot), **({} if element else {"full_page": True}))
    assert shot.stat().st_size > 2_000
    if os.environ.get("QKV_LAB_SCREENSHOTS"):
        shutil.copy(shot, Path(os.environ["QKV_LAB_SCREENSHOTS"]) / name)
    return shot


def start(page, name: str, preset: str, fields: dict) -> None:
    page.select_option("#task", "copy")
    page.select_option("#preset", preset)
    page.fill("#run-name", name)
    page.click("#by-hand summary")
    for field, value in fields.items():
        page.fill(f'#fields [data-field="{field}"]', str(value))
    with page.expect_response(lambda r: r.url.endswith("/api/runs") and r.request.method == "POST") as reply:
        page.click("#start")
    assert reply.value.status == 201, reply.value.text()
    page.click("#by-hand summary")  # closed again


def exact_points(page, name: str) -> list[float]:
    return page.evaluate(f"(runs['{name}'] ? runs['{name}'].records : []).filter((r) => 'valid_exact' in r)"
                         ".map((r) => r.valid_exact)")


def look(page, run: str, text: str) -> None:
    """Look inside ``run`` at ``text`` as a learner does, and wait for the server's answer."""
    page.select_option("#inside-run", run)
    page.fill("#inside-text", text)
    with page.expect_response(lambda r: r.url.endswith("/inside")) as reply:
        page.click("#look")
    assert reply.value.ok, reply.value.text()


def test_train_compare_look_inside_and_open_the_panels(lab_server, browser, tmp_path):
    server, lab = lab_server
    page = browser.new_page(viewport={"width": 1150, "height": 900})
    page.set_default_timeout(PAGE_MS)
    outside, errors = [], []
    page.on("request", lambda r: None if r.url.startswith(server.url) else outside.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.wait_for_selector("#preset option", state="attached")

    small = {"max_steps": 400, "eval_every": 50}
    start(page, "transformer", "transformer", {"d_model": 32, "d_ff": 64, **small})
    start(page, "lstm", "lstm+attention", {"d_model": 64, **small})
    page.wait_for_selector('#runs tr[data-run="lstm"]', timeout=3 * PAGE_MS)  # a start on a loaded 2-core machine

    # both validation curves rise: the newest exact match above the first
    page.select_option("#metric", "valid_exact")
    deadline = time.monotonic() + TRAIN_S
    while True:
        points = {n: exact_points(page, n) for n in ("transformer", "lstm")}
        if all(len(p) >= 2 and p[-1] > p[0] for p in points.values()):
            break
        failed = [n for n in points if lab.status(n) not in ("training", "finished")]
        assert not failed, {n: lab.log_tail(n) for n in failed}
        assert time.monotonic() < deadline, points
        time.sleep(1)
    page.wait_for_function("document.querySelectorAll('#chart polyline.curve').length === 2")
    for name in ("transformer", "lstm"):
        line = page.locator(f'#chart polyline.curve[data-run="{name}"]')
        assert len(line.get_attribute("points").split()) >= 2
    page.select_option("#metric", "train_loss")
    page.wait_for_selector("#chart polyline.curve")
    save(page, tmp_path, "lab-curves.png", page.locator("#curves-panel"))

    # look inside the Transformer: every kind, layer and head
    look(page, "transformer", "abcdef")
    page.wait_for_selector("#heads table.heat")
    assert page.locator("#kind option").count() == 3  # encoder self-, decoder self-, cross-attention
    assert page.locator("#heads figure").count() == 4  # the preset's heads
    page.select_option("#kind", "encoder")
    page.select_option("#layer", index=1)
    page.wait_for_selector("#heads table.heat")
    cells = page.locator("#heads figure").first.locator("tr").nth(1).locator("td")
    weights = [float(cells.nth(i).get_attribute("title")) for i in range(cells.count())]
    assert abs(sum(weights) - 1) < 0.01  # a query's row
    save(page, tmp_path, "lab-inside.png", page.locator("#inside-panel"))

    # the LSTM: its alignment over the source and its hidden state's norm
    look(page, "lstm", "abcdef")
    page.wait_for_selector("#hidden:not([hidden]) #hidden-chart rect")
    assert page.locator("#kind option").count() == 1
    assert page.locator("#hidden-chart rect").count() == len("abcdef") + 2  # '▁', the letters, </s>

    # stop one run from the page: the trainer commits last/ and exits
    stop = page.locator('#runs tr[data-run="lstm"] button.stop')
    if stop.is_visible():  # not yet solved (a run stops itself at 99% exact) nor ended
        stop.click()
        page.wait_for_function("document.querySelector('#runs tr[data-run=\"lstm\"] .status')"
                               ".textContent.startsWith('stopped')", timeout=120_000)
    save(page, tmp_path, "lab.png")

    # every concept panel, opened
    panels = page.locator("[id^=panel-]")
    if not panels.count():
        pytest.skip("the page has no concept panels")
    for i in range(panels.count()):
        panel = panels.nth(i)
        panel.scroll_into_view_if_needed()
        details = panel.locator("details")
        if details.count():
            for j in range(details.count()):
                if details.nth(j).get_attribute("open") is None:
                    details.nth(j).locator("summary").first.click()
        elif panel.locator("button").count():
            panel.locator("button").first.click()
        try:  # a panel that draws from the server: its picture, or its error, before the screenshot
            panel.locator("svg, canvas, table, .error").first.wait_for(timeout=20_000)
        except sync_api.TimeoutError:
            pass
        page.wait_for_timeout(500)
        save(page, tmp_path, f"lab-{panel.get_attribute('id')}.png", panel)
    assert not errors, errors
    assert not outside, f"the page fetched from outside: {outside}"


def test_a_request_that_hangs_does_not_stop_the_refreshes(lab_server, browser):
    """The page polls the lab once a second, one poll at a time. A poll whose request never gets an
    answer is given up after the page's timeout (shortened here to 1 s), the page says so, and the
    next polls go on: a run started afterwards appears in the table."""
    server, lab = lab_server
    page = browser.new_page()
    page.set_default_timeout(PAGE_MS)
    page.add_init_script("window.QKV_CALL_TIMEOUT_MS = 1000")
    page.goto(server.url + "/")
    page.wait_for_selector("#preset option", state="attached")
    page.wait_for_function("document.getElementById('lab-info').textContent.includes('of at most')")

    hung = []
    page.route("**/api/runs", lambda route: hung.append(route) if route.request.method == "GET" else route.continue_())
    page.wait_for_function("document.getElementById('lab-info').textContent.includes('does not answer')")
    assert "no answer from /api/runs within 1 s" in page.inner_text("#lab-info")
    page.unroute("**/api/runs")
    assert hung  # the page's polls were held without an answer

    start(page, "after", "transformer", {"max_steps": 20, "eval_every": 10})
    page.wait_for_selector('#runs tr[data-run="after"]')
    page.wait_for_function("document.getElementById('lab-info').textContent.includes('of at most')")
    lab.stop("after")


def test_an_early_curve_point_and_a_time_limit_said_as_such(lab_server, browser):
    """A real run started from the page with the lab's defaults: its first validation point is on the
    chart within 10 s of its first update (update 25, before the interval of 100), and when its
    --max-time ends it the page says "time limit", and why."""
    server, lab = lab_server
    page = browser.new_page(viewport={"width": 1150, "height": 900})
    page.set_default_timeout(PAGE_MS)
    page.goto(server.url + "/")
    page.wait_for_selector("#preset option", state="attached")
    start(page, "quick", "transformer", {"d_model": 32, "d_ff": 64, "max_time": 25})
    page.select_option("#metric", "valid_exact")
    page.wait_for_selector('#chart [data-run="quick"]', timeout=3 * PAGE_MS)  # the first point, drawn
    records = page.evaluate("runs.quick.records")
    first, valid = records[0], next(r for r in records if "valid_exact" in r)
    assert first["step"] == 1 and valid["step"] == 25
    assert valid["time"] - first["time"] < 10, (first, valid)
    page.wait_for_function("document.querySelector('#runs tr[data-run=quick] td.status .word')"
                           "?.textContent === 'time limit'", timeout=3 * PAGE_MS)
    reason = page.inner_text("#runs tr[data-run=quick] td.status .reason")
    assert reason.startswith("reached its time limit (25s) at update"), reason
    assert lab.log_tail("quick", 1).startswith("qkv lab: time limit: reached its time limit (25s)")
    page.close()
