"""The page of qkv serve in a real browser: headless Chromium driven by Playwright.

Set-up (no browser download: Playwright drives the system's Chromium)::

    apt-get install -y chromium
    pip install -c constraints.txt -e ".[serve,test]"

Skipped where Playwright or Chromium is missing. ``QKV_SCREENSHOT=path.png`` also saves the
screenshot there (how docs/img/serve.png is made).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='qkv serve needs fastapi: pip install -c constraints.txt -e ".[serve]"')
pytest.importorskip("uvicorn", reason='qkv serve needs uvicorn: pip install -c constraints.txt -e ".[serve]"')
sync_api = pytest.importorskip("playwright.sync_api",
                               reason='the browser test needs playwright: pip install -c constraints.txt -e ".[test]"')

from qkv.serve import BackgroundServer, Limits  # noqa: E402
from qkv.serve.app import create_app  # noqa: E402
from qkv.serve.service import load_models  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
from conftest import needs_chromium  # noqa: E402

pytestmark = needs_chromium
# On a loaded machine a model's answer can take long: each test waits for the answer itself, up to
# REPLY_MS, and then gives the page up to PAGE_MS for every step (drawing what came).
REPLY_MS, PAGE_MS = 300_000, 60_000


@pytest.fixture(scope="module")
def server():
    model = os.environ.get("QKV_SERVE_MODEL", str(FIXTURES / "translate-transformer"))
    served = load_models([model, str(FIXTURES / "lm-transformer"), str(FIXTURES / "classify-transformer")], Limits())
    with BackgroundServer(create_app(served, Limits())) as s:
        yield s


def new_page(browser, **options):
    page = browser.new_page(**options)
    page.set_default_timeout(PAGE_MS)
    return page


def model_page(browser, server, label: str, panel: str):
    """The page with the model ``label`` chosen, once its ``panel`` shows."""
    page = new_page(browser)
    page.goto(server.url + "/")
    page.wait_for_selector("#model option", state="attached")
    page.select_option("#model", label=label)
    page.wait_for_selector(f"{panel}:not([hidden])")
    return page


def answered(page, path: str, click: str):
    """Click ``click`` and wait for the server's whole answer to the POST to ``path`` it sends."""
    with page.expect_response(lambda r: r.url.endswith(path) and r.request.method == "POST",
                              timeout=REPLY_MS) as reply:
        page.click(click)
    response = reply.value
    response.finished()  # a streamed answer: to its end
    assert response.ok, response.text()
    return response


def test_translate_click_a_word_see_its_attention(server, browser, tmp_path):
    page = new_page(browser, viewport={"width": 1000, "height": 760})
    outside = []
    page.on("request", lambda r: None if r.url.startswith(server.url) else outside.append(r.url))
    page.goto(server.url + "/")
    page.wait_for_selector("#translate-panel:not([hidden])")
    page.fill("#src", os.environ.get("QKV_SERVE_TEXT", "red cat"))
    page.fill("#nbest", "2")
    answered(page, "/translate", "#translate")
    page.wait_for_selector("#translate-out .hyp .text")
    assert page.locator("#translate-out .hyp").count() == 2
    words = page.locator("#translate-out .hyp").first.locator(".tok")
    words.nth(min(3, words.count() - 2)).click()
    page.wait_for_selector("#attention:not([hidden]) #heat-table")
    cells = page.locator("#heat-table tr.w td")
    weights = [float(cells.nth(i).inner_text()) for i in range(cells.count())]
    assert weights and abs(sum(weights) - 1) < 0.05  # the mean over heads of one row: sums to 1
    page.select_option("#layer", index=0)
    page.select_option("#head", index=1)  # head 1 (index 0: the mean)
    page.wait_for_selector("#heat-table")
    layers, heads = page.locator("#layer option").count(), page.locator("#head option").count()
    assert layers >= 1 and heads >= 2  # heads: mean, 1, ...
    page.select_option("#layer", index=layers - 1)  # by index: a value "1" would match the label "1" too
    page.select_option("#head", value="mean")
    assert page.locator("#heat-table tr.w td").count() == len(weights)
    assert page.locator("#layer").input_value() == str(layers - 1)
    shot = tmp_path / "serve.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("QKV_SCREENSHOT"):
        page.screenshot(path=os.environ["QKV_SCREENSHOT"], full_page=True)
    assert not outside, f"the page fetched from outside: {outside}"


def test_generate_streams_into_the_page(server, browser):
    page = model_page(browser, server, "lm-transformer (lm)", "#generate-panel")
    assert page.locator("#translate-panel").is_hidden()
    page.fill("#gen-prefix", "red cat")
    page.fill("#gen-n", "20")
    answered(page, "/generate", "#generate")
    page.wait_for_function("document.querySelector('#generate').disabled === false && "
                           "document.querySelector('#gen-out').textContent.length > 'red cat'.length")
    assert page.locator("#gen-out .prompt").inner_text() == "red cat"
    assert not page.locator("#gen-out .error").count()


def test_compare_texts_draws_the_cosine_similarities_of_their_embeddings(server, browser):
    import torch

    import qkv

    page = model_page(browser, server, "classify-transformer (classify)", "#embed-panel")
    texts = ["a wonderful film", "a great movie", "the plot was dull"]
    page.fill("#emb-text", "\n".join(texts))
    answered(page, "/embed", "#embed")
    page.wait_for_selector("#embed-out table.sims")
    shown = [[float(c) for c in row] for row in page.eval_on_selector_all(
        "#embed-out table.sims tr:not(:first-child)", "rows => rows.map(r => [...r.querySelectorAll('td')].map(td => td.textContent))")]
    v = qkv.load(FIXTURES / "classify-transformer").embed(texts)
    want = torch.nn.functional.cosine_similarity(v[:, None], v[None], dim=-1)
    assert torch.allclose(torch.tensor(shown), want, atol=2e-3), (shown, want)


def offline_page(browser, server):
    """A page that can reach only this server: every request elsewhere is aborted and recorded. The
    server's answers reach the page without their Content-Security-Policy, so that a fetch the
    policy would block is recorded too."""
    page = new_page(browser, viewport={"width": 1000, "height": 760})
    outside = []

    def only_here(route):
        if route.request.url.startswith(server.url + "/"):
            answer = route.fetch()
            return route.fulfill(response=answer, headers={k: v for k, v in answer.headers.items()
                                                           if k.lower() != "content-security-policy"})
        outside.append(route.request.url)
        return route.abort()

    page.route("**/*", only_here)
    return page, outside


@pytest.mark.parametrize("path,shown", [("/docs", ".opblock-summary-path"), ("/redoc", "[data-section-id]")])
def test_api_docs_render_with_nothing_from_outside(server, browser, path, shown):
    pytest.importorskip("fastapi_offline", reason="/docs and /redoc need fastapi-offline: "
                                                  'pip install -c constraints.txt -e ".[serve]"')
    page, outside = offline_page(browser, server)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + path)
    page.wait_for_selector(shown)
    for endpoint in ("/translate", "/generate", "/models"):
        page.get_by_text(endpoint, exact=True).first.wait_for()
    assert "Unable to render" not in page.inner_text("body")
    assert not errors, errors
    assert not outside, f"{path} tried to fetch from outside: {outside}"
