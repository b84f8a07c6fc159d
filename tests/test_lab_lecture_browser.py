"""The look-inside panels of the lab page (step by step, model view, gates, gradients, schedule, label
smoothing) in headless Chromium: each draws what its API answers, a newer request's answer wins over
an older one that arrives late, and the settings travel in the page's address. The runs are the test
fixtures' checkpoints, copied in as runs an earlier lab left (no training here).

Skipped where Playwright or Chromium is missing (set-up: see tests/test_serve_browser.py).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='the lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')
pytest.importorskip("uvicorn", reason='the lab needs uvicorn: pip install -c constraints.txt -e ".[serve]"')
sync_api = pytest.importorskip("playwright.sync_api",
                               reason='the browser test needs playwright: pip install -c constraints.txt -e ".[test]"')

from qkv.lab.app import create_app  # noqa: E402
from qkv.lab.runs import Lab, LabLimits  # noqa: E402
from qkv.serve import BackgroundServer  # noqa: E402

from conftest import needs_chromium  # noqa: E402
from lab_axes import check_axes, read  # noqa: E402
from lab_tour import choose  # noqa: E402

pytestmark = needs_chromium
FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
PAGE_MS = 120_000  # a loaded machine


def fixture_runs(root: Path) -> None:
    for name, checkpoint, arch in (("tr", "translate-transformer", "transformer"),
                                   ("lstm", "translate-lstm-general", "lstm")):
        (root / name).mkdir(parents=True)
        shutil.copytree(FIXTURES / checkpoint, root / name / "last")
        (root / name / "lab.json").write_text(json.dumps({"name": name, "task": "copy", "preset": arch,
                                                          "model": {"arch": arch}}))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab") / "runs"
    fixture_runs(root)
    with BackgroundServer(create_app(Lab(root, LabLimits()))) as s:
        yield s


@pytest.fixture
def page(browser, server):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.set_default_timeout(PAGE_MS)
    page.problems = []
    page.on("pageerror", lambda e: page.problems.append(str(e)))
    page.goto(server.url + "/")
    yield page
    assert page.problems == []
    page.close()


def drawn(page, name: str) -> None:
    """Wait until the panel has drawn an answer (not an error)."""
    page.wait_for_selector(f"#panel-{name} .out[data-state=done], #panel-{name} .out[data-state=error]")
    assert page.get_attribute(f"#panel-{name} .out", "data-state") == "done", page.inner_text(f"#panel-{name} .out")


def test_step_by_step_shows_every_stage_and_the_temperature_reaches_the_model(page):
    with page.expect_response(lambda r: r.url.endswith("/api/runs/tr/steps")) as reply:
        page.click("#panel-steps summary")
    drawn(page, "steps")
    answer = reply.value.json()
    stages = page.locator("#panel-steps .stage h4").all_inner_texts()
    assert [s.split(".")[0] for s in stages] == ["1", "2", "3", "4", "5", "6"]
    assert page.locator("#panel-steps table.mat").count() >= 11
    # every heat map with its rows and columns labelled and a colour scale with its range
    for fig in page.locator("#panel-steps figure:has(table.mat)").all():
        assert fig.locator(".colour-scale").count() == 1
        assert fig.locator("table.mat tr").first.locator("th").count() > 1 and fig.locator("table.mat tr").nth(1).locator("th").count() == 1
    softmax = page.locator("#panel-steps figure:has-text('softmax: each row') .colour-scale")
    assert softmax.get_attribute("data-lo") == "0" and softmax.get_attribute("data-hi") == "1"
    # the softmax table shows the answer's weights, row by row
    shown = page.locator("#panel-steps figure:has-text('softmax: each row') tr").nth(1).locator("td").all()
    assert [float(td.get_attribute("title")) for td in shown] == pytest.approx(answer["weights"][0], abs=1e-4)
    # the layer and head lists are the model's (2 layers, 2 heads)
    assert page.locator("#panel-steps select[name=layer] option").count() == 2
    with page.expect_response(lambda r: r.url.endswith("/api/runs/tr/steps")) as reply:
        page.select_option("#panel-steps select[name=kind]", "cross")
    assert json.loads(reply.value.request.post_data)["kind"] == "cross"
    drawn(page, "steps")
    with page.expect_response(lambda r: r.url.endswith("/api/runs/tr/steps")) as reply:
        page.locator("#panel-steps input[name=temperature]").fill("2.5")
    assert json.loads(reply.value.request.post_data)["temperature"] == 2.5
    page.wait_for_selector("#panel-steps .stage h4:has-text('at temperature 2.50')")
    top = reply.value.json()["next"]
    p = top["position"]
    bars = page.locator("#panel-steps .bars div").all_inner_texts()
    assert len(bars) == len(top["top"][p]) and f"{top['top'][p][0]['p']:.4f}" in bars[0]


def test_a_late_answer_does_not_replace_a_newer_one(page):
    """The d_k slider's first answer is held back until after the second is drawn: the panel keeps
    the second (the older request is aborted; were it not, its answer would be dropped)."""
    held = []

    def hold(route):
        if "d_k=4&" in route.request.url and not held:
            held.append(route)
        else:
            route.continue_()

    page.route("**/api/panels/attention?*", hold)
    page.click("#panel-attention summary")
    drawn(page, "attention")
    page.locator("#panel-attention input[type=range]").fill("2")  # d_k = 4: held
    page.wait_for_timeout(300)
    page.locator("#panel-attention input[type=range]").fill("9")  # d_k = 512
    page.wait_for_selector("#panel-attention th:has-text('d_k = 512')")
    assert held
    held[0].continue_()
    page.wait_for_timeout(1500)
    assert page.locator("#panel-attention th:has-text('d_k = 512')").count() == 1
    assert page.locator("#panel-attention th:has-text('d_k = 4,')").count() == 0
    assert page.locator("#panel-attention output").inner_text() == "512"


def test_model_view_has_every_layer_and_head_and_hover_follows_a_token(page):
    with page.expect_response(lambda r: r.url.endswith("/api/runs/tr/inside")) as reply:
        page.click("#panel-model summary")
    drawn(page, "model")
    weights = reply.value.json()["attention"]["weights"]
    for kind, layers in weights.items():
        assert page.locator(f"#panel-model .thumbs[data-kind={kind}] canvas").count() == len(layers) * len(layers[0])
    page.hover("#panel-model .tokens[data-side=source] span[data-i='2']")
    assert page.get_attribute("#panel-model .modelview", "data-focus") == "source:2"
    assert page.locator("#panel-model canvas[data-focus='source:2']").count() == sum(
        len(layers) * len(layers[0]) for layers in weights.values())  # encoder rows and cross-attention columns
    assert page.locator("#panel-model .tokens span.focus").inner_text() == "b"
    # the highlighted row of encoder layer 0, head 0, is drawn at its weights; the others faded
    alpha = page.evaluate("""() => {
        const c = document.querySelector('#panel-model canvas[data-kind=encoder][data-layer="0"][data-head="0"]');
        const n = 84, rows = %d, ctx = c.getContext('2d');
        const at = (r, j, cols) => ctx.getImageData(Math.floor((j + 0.5) * n / cols), Math.floor((r + 0.5) * n / rows), 1, 1).data[3] / 255;
        return [at(2, 0, rows), at(3, 0, rows)];
    }""" % len(weights["encoder"][0][0]))
    w = weights["encoder"][0][0]
    assert alpha[0] == pytest.approx(w[2][0], abs=0.01) and alpha[1] == pytest.approx(0.15 * w[3][0], abs=0.01)


def test_gates_and_gradients_draw_the_rnn_and_the_transformer(page):
    page.click("#panel-gates summary")
    drawn(page, "gates")
    assert [c.split(":")[0] for c in page.locator("#panel-gates figure figcaption").all_inner_texts()][:4] == \
        ["input gate", "forget gate", "candidate gate (tanh", "output gate"]
    with page.expect_response(lambda r: r.url.endswith("/api/runs/lstm/gates")) as reply:
        choose(page.locator("#panel-gates select[name=direction]"), "1")
    assert reply.value.json()["direction"] == 1
    page.click("#panel-gradients summary")
    drawn(page, "gradients")
    legend = page.inner_text("#panel-gradients figcaption")
    assert "lstm (lstm, attention general)" in legend and "tr (transformer)" in legend
    assert page.locator("#panel-gradients polyline").count() == 2
    # the log axis: a tick at every power of ten from below the smallest norm to above the largest, each
    # label at its value; every point where the scales put it
    norms = [float(v) for v in page.locator("#panel-gradients table.nums td:nth-child(n+3)").all_text_contents()]
    got = check_axes(page, "#panel-gradients svg.plot", log_y=True)
    ys = sorted(read(t["text"]) for t in got["y"])
    decades = [v for v in ys if abs(math.log10(v) - round(math.log10(v))) < 1e-9]
    assert decades[0] <= min(norms) and decades[-1] >= max(norms) and len(decades) >= 2
    assert [round(math.log10(v)) for v in decades] == list(range(round(math.log10(decades[0])), round(math.log10(decades[-1])) + 1))
    assert len(got["points"]) == 2 * len(norms) // 2  # every norm drawn as a point with its value
    # every heat map of the gates: its units and source tokens labelled, and a colour scale with its range
    page.click("#panel-gates summary") if not page.locator("#panel-gates details[open]").count() else None
    maps = page.locator("#panel-gates figure:has(canvas)")
    assert maps.count() == 4
    tokens = reply.value.json()["tokens"]
    for i in range(4):
        fig = maps.nth(i)
        assert fig.locator(".colour-scale").count() == 1
        assert fig.locator(".collabels span").count() >= min(len(tokens), 4) and fig.locator(".rowlabels span").count() >= 2
    assert maps.nth(2).locator(".colour-scale").get_attribute("data-lo") == "-1"  # the candidate: tanh's range


def test_schedule_and_smoothing_show_their_code(page):
    page.click("#panel-schedule summary")
    drawn(page, "schedule")
    assert page.locator("#panel-schedule polyline").count() == 4
    assert "def noam(" in page.inner_text("#panel-schedule pre.code")
    page.fill("#panel-schedule input[name=d_model]", "64")
    with page.expect_response(lambda r: "/api/panels/schedule?d_model=64&" in r.url):
        page.click("#panel-schedule [data-go]")
    page.wait_for_function("document.querySelectorAll('#panel-schedule polyline').length === 2")
    # d_model 64, warmup 400: the peak (64 · 400)^-0.5 = 0.00625 reads as such, and the axis to the step's
    # decimals (0.001 apart: "0.006", never "0.01" for the top), every label at its value
    page.fill("#panel-schedule input[name=warmup]", "400")
    with page.expect_response(lambda r: "warmup=400" in r.url):
        page.click("#panel-schedule [data-go]")
    page.wait_for_function("document.querySelectorAll('#panel-schedule polyline').length === 1")
    assert page.locator("#panel-schedule text.peak").all_text_contents() == ["0.00625"]
    got = check_axes(page, "#panel-schedule svg.plot")
    labels = [t["text"] for t in got["y"]]
    assert labels[0] == "0.000" and float(labels[-1]) >= 0.00625 and all(len(t) == 5 for t in labels), labels
    page.click("#panel-smoothing summary")
    drawn(page, "smoothing")
    assert "def label_smoothed_nll_loss(" in page.inner_text("#panel-smoothing pre.code")
    with page.expect_response(lambda r: "/api/panels/smoothing?epsilon=0.3&" in r.url):
        page.locator("#panel-smoothing input[name=epsilon]").fill("0.3")
    page.wait_for_selector("#panel-smoothing figcaption:has-text('0.7300 on gold')")


def test_the_settings_travel_in_the_address(page, browser):
    page.click("#panel-smoothing summary")
    drawn(page, "smoothing")
    page.fill("#panel-smoothing input[name=vocab]", "5")
    page.locator("#panel-smoothing input[name=vocab]").dispatch_event("change")
    page.wait_for_selector("#panel-smoothing figcaption:has-text('over 5 tokens')")
    page.click("#panel-steps summary")
    drawn(page, "steps")
    choose(page.locator("#panel-steps select[name=head]"), "1")
    page.wait_for_selector("#panel-steps .out .note:has-text('head 2 of 2')")
    url = page.url
    assert "p.smoothing.vocab=5" in url and "p.steps.head=1" in url and "p.open=steps%2Csmoothing" in url
    other = browser.new_page(viewport={"width": 1300, "height": 900})
    try:
        other.goto(url)  # a student opens the shared address
        other.wait_for_selector("#panel-smoothing .out[data-state=done]")
        other.wait_for_selector("#panel-steps .out[data-state=done]")
        assert other.input_value("#panel-smoothing input[name=vocab]") == "5"
        assert "head 2 of 2" in other.inner_text("#panel-steps .out .note")
        assert other.locator("#panel-masks details[open]").count() == 0
    finally:
        other.close()


OVERFLOW_JS = """() => {
  const w = document.documentElement.clientWidth;
  const wide = [...document.querySelectorAll('body *')].filter((el) => {
    const b = el.getBoundingClientRect();
    if (!(b.width > 0 && b.right > w + 0.01)) return false;
    for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {  // inside a box that scrolls
      if (["auto", "scroll", "hidden"].includes(getComputedStyle(a).overflowX)) return false;
    }
    return true;
  }).slice(0, 8).map((el) => el.tagName + '#' + el.id + ' in ' + el.parentElement.tagName + '#' + el.parentElement.id + '.' + el.parentElement.className + ' ' + el.getBoundingClientRect().left + '-' + el.getBoundingClientRect().right);
  return {scroll: document.documentElement.scrollWidth, width: w, wide};
}"""


def test_the_page_holds_at_420_px(browser, server):
    """A phone's width: nothing wider than the window (wide tables scroll inside their own box), the
    charts drawn at the width they get, their text at its size."""
    page = browser.new_page(viewport={"width": 420, "height": 900})
    page.set_default_timeout(PAGE_MS)
    try:
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('lab-info').textContent.includes('of at most')")
        page.fill("#inside-text", "abcdef")
        page.select_option("#inside-run", "lstm")
        page.click("#look")
        page.wait_for_selector("#hidden:not([hidden]) #hidden-chart rect")
        assert "word" in page.inner_text("#space-note")  # the ␣ the maps show, explained
        assert "alignment" in page.inner_text("#heads figcaption") and page.locator("#layer").is_hidden()
        for name in ("steps", "gates", "gradients", "schedule", "cost", "positions", "masks"):
            page.click(f"#panel-{name} summary")
            page.wait_for_selector(f"#panel-{name} .out[data-state=done], #panel-{name} .out[data-state=error]")
        page.wait_for_timeout(500)
        got = page.evaluate(OVERFLOW_JS)
        assert got["scroll"] <= 420 and not got["wide"], got
        # the charts fit and keep their text's size: drawn at their own width, not scaled down
        for svg in page.locator(".panels svg.plot").all():
            box = svg.bounding_box()
            assert box["width"] <= 420 and abs(box["width"] - float(svg.get_attribute("width"))) < 1
    finally:
        page.close()
