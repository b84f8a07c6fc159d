"""The lecture panels' fragment (qkv.lab.panels) in a real browser: headless Chromium driven by
Playwright, on a bare page that inlines the fragment over ``register(app)``'s routes.

Skipped where Playwright or Chromium is missing (set-up: see tests/test_serve_browser.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason='the lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')
pytest.importorskip("uvicorn", reason='the lab needs uvicorn: pip install -c constraints.txt -e ".[serve]"')
sync_api = pytest.importorskip("playwright.sync_api",
                               reason='the browser test needs playwright: pip install -c constraints.txt -e ".[test]"')

from fastapi import FastAPI  # noqa: E402
from fastapi.responses import HTMLResponse, Response  # noqa: E402

from qkv.lab import panels  # noqa: E402
from qkv.serve import BackgroundServer, Limits  # noqa: E402

from conftest import needs_chromium  # noqa: E402

pytestmark = needs_chromium
PAGE_MS = 120_000  # a loaded machine


@pytest.fixture(scope="module")
def server():
    app = FastAPI()
    app.state.limits = Limits()  # the server's timeouts (BackgroundServer reads them)
    panels.register(app)

    @app.get("/")
    def page():
        return HTMLResponse(f"<!doctype html><html><head><meta charset='utf-8'></head><body>{panels.fragment()}"
                            "</body></html>")

    @app.get("/favicon.ico")
    def favicon():
        return Response(status_code=204)

    with BackgroundServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def page(browser, server):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.set_default_timeout(PAGE_MS)
    page.problems, page.asked = [], []
    page.on("request", lambda r: page.asked.append(r.url) if "/api/panels/" in r.url else None)
    page.on("request", lambda r: None if r.url.startswith(server.url) else page.problems.append(r.url))
    page.on("pageerror", lambda e: page.problems.append(str(e)))
    page.goto(server.url + "/")
    yield page
    page.close()


def test_nothing_is_fetched_before_a_panel_opens(page):
    page.wait_for_timeout(1000)
    assert page.asked == [] and page.locator(".panels details[open]").count() == 0
    assert page.locator(".panels .out svg, .panels .out canvas, .panels .out table").count() == 0


def test_opening_each_panel_fetches_and_draws(page):
    for name, drawn in (("attention", "svg"), ("positions", "canvas"), ("masks", "table.grid"), ("cost", "table.nums")):
        with page.expect_response(lambda r, n=name: r.url.split("?")[0].endswith(f"/api/panels/{n}")) as reply:
            page.click(f"#panel-{name} summary")
        assert reply.value.ok
        page.wait_for_selector(f"#panel-{name} .out {drawn}")
    assert page.locator("#panel-positions canvas").count() == 2
    for fig in page.locator("#panel-positions figure:has(canvas)").all():  # labels and a colour scale each
        assert fig.locator(".colour-scale").count() == 1 and fig.locator(".collabels span").count() >= 2
    for fig in page.locator("#panel-attention figure.qkv-bars").all():  # the weights' bars have an axis 0 … 1
        assert fig.locator("text.tick.y").all_text_contents()[0] == "0.0" and fig.locator("text.tick.y").all_text_contents()[-1] == "1.0"
    assert page.locator("#panel-masks table.grid").count() == 2 + 3  # padding, causal, one decoder mask per sentence
    assert page.problems == []


def test_the_d_k_slider_asks_for_that_d_k(page):
    with page.expect_response(lambda r: "/api/panels/attention?d_k=1024" in r.url):
        page.locator("#panel-attention input[type=range]").fill("10")
    page.wait_for_selector("#panel-attention th:has-text('d_k = 1024')")
    assert page.locator("#panel-attention output").inner_text() == "1024"


def test_a_refused_text_shows_the_message(page):
    page.fill("#panel-masks textarea", "a\nb\nc\nd")
    page.click("#panel-masks [data-go]")
    error = page.wait_for_selector("#panel-masks .error")
    assert error.inner_text().startswith("text: give 1 to 3 sentences")
