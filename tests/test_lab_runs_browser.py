"""qkv lab's page in headless Chromium, on runs written by hand (``lab.json`` and ``metrics.jsonl`` as a run
leaves them: the lab lists runs an earlier lab left), so nothing trains: the chart's legend, hover values,
colours, axes and x-axis switch; the runs table updated in place; answers that arrive out of order; the
form's refusals; the set-up in the address. Skipped where Playwright or Chromium is missing."""

from __future__ import annotations

import colorsys
import json
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='qkv lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')
pytest.importorskip("uvicorn", reason='qkv lab needs uvicorn: pip install -c constraints.txt -e ".[serve]"')
sync_api = pytest.importorskip("playwright.sync_api",
                               reason='the browser test needs playwright: pip install -c constraints.txt -e ".[test]"')

from qkv.lab.app import create_app  # noqa: E402
from qkv.lab.runs import ENDED, Lab, LabLimits, pick_hue, settings  # noqa: E402
from qkv.serve import BackgroundServer  # noqa: E402

from conftest import CHROMIUM, needs_chromium  # noqa: E402
from lab_axes import check_axes  # noqa: E402

pytestmark = needs_chromium
T0 = 1_700_000_000.0


def write_run(root: Path, name: str, records: list[dict], checkpoint: bool = False, preset: str = "transformer",
              task: str = "copy", ended: dict | None = None) -> None:
    """A run as the lab leaves it: its hue chosen as Lab.start chooses it (farthest from the others')."""
    taken = [Lab(root).hue(n) for n in Lab(root).names()]
    run = root / name
    run.mkdir(parents=True)
    m, t = settings(preset)
    (run / "lab.json").write_text(json.dumps({"name": name, "task": task, "preset": preset, "model": m, "train": t,
                                              "parameters": 123456, "hue": pick_hue(name, taken), "started": T0}))
    if ended:
        (run / ENDED).write_text(json.dumps(ended))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if checkpoint:
        (run / "last").mkdir()


def curve(k: int, n: int = 10) -> list[dict]:
    """Run k's records: every 50 updates a training loss, every 100 a validation; update s at T0 + s/10 + k."""
    out = []
    for i in range(1, n + 1):
        s = 50 * i
        out.append({"step": s, "train_loss": 3.0 / i + 0.01 * k, "grad_norm": 20.0 / i ** 2, "lr": 1e-3,
                    "time": T0 + s / 10 + k})
        if i % 2 == 0:
            out.append({"step": s, "valid_loss": 2.0 / i, "valid_exact": min(1.0, 0.1 * i + 0.01 * k),
                        "time": T0 + s / 10 + k + 0.5})
    return out


@pytest.fixture
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def lab_page(tmp_path, browser):
    """``open(hash="")``: the page of a lab over ``tmp_path/runs`` (write runs there first)."""
    root = tmp_path / "runs"
    root.mkdir()
    lab = Lab(root, LabLimits(max_runs=2))
    with BackgroundServer(create_app(lab, panels=None)) as server:
        errors = []

        def open_page(hash: str = ""):
            page = browser.new_page(viewport={"width": 1150, "height": 900})
            page.set_default_timeout(30_000)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/" + hash)
            page.wait_for_function("document.getElementById('lab-info').textContent.includes('of at most')")
            return page

        yield root, open_page, server
        assert not errors, errors


def test_legend_hover_colours_and_axes(lab_page):
    root, open_page, _ = lab_page
    for k in range(12):
        write_run(root, f"run{k:02d}", curve(k))
    page = open_page()
    page.wait_for_function("document.querySelectorAll('#chart polyline.curve').length === 12")
    legend = page.locator("#legend .item")
    assert legend.count() == 12 and legend.nth(0).inner_text().strip() == "run00"

    # twelve colours, no two alike: hues at least 15 degrees apart, or lightness apart
    colours = page.evaluate("[...document.querySelectorAll('#chart polyline.curve')].map((p) => getComputedStyle(p).stroke)")
    hls = []
    for c in colours:
        r, g, b = (int(x) / 255 for x in re.findall(r"\d+", c)[:3])
        hls.append(colorsys.rgb_to_hls(r, g, b))
    for i in range(12):
        for j in range(i):
            hue = abs(hls[i][0] - hls[j][0]) * 360
            assert min(hue, 360 - hue) > 15 or abs(hls[i][1] - hls[j][1]) > 0.05, (colours[i], colours[j])

    # every tick label at its value (its centre on the scale's line, in screen pixels) and reading as it;
    # run00's last point (update 500, loss 0.3) where those scales put it
    got = check_axes(page, "#chart")
    xs = [float(t["text"]) for t in got["x"]]
    assert xs in ([float(v) for v in range(0, 501, 50)], [float(v) for v in range(0, 501, 100)]), xs
    last = page.evaluate("""() => {
        const svg = document.getElementById('chart'), line = svg.querySelector('polyline[data-run=run00]');
        const p = line.points[line.points.numberOfItems - 1], m = line.getScreenCTM();
        return [p.x * m.a + p.y * m.c + m.e, p.x * m.b + p.y * m.d + m.f];
    }""")
    (ax, bx), (ay, by) = got["x_scale"], got["y_scale"]
    assert abs(ax + bx * 500 - last[0]) < 1 and abs(ay + by * 0.3 - last[1]) < 1

    # axis titles with units
    assert page.text_content("#x-title") == "updates (optimizer steps)"
    assert page.text_content("#y-title") == "training loss (nats per token)"

    # hover at update 250: each curve's value there, as the records have it
    page.locator("#chart").scroll_into_view_if_needed()
    box = page.locator("#chart").bounding_box()
    L, R, W = 80, 15, 1000
    x = box["x"] + (L + (W - L - R) * 250 / 500) * box["width"] / W
    page.mouse.move(x, box["y"] + box["height"] / 2)
    page.wait_for_selector("#tip:not([hidden])")
    tip = page.inner_text("#tip")
    assert f"run00: {3.0 / 5:.4f}" in tip and f"run11: {3.0 / 5 + 0.11:.4f}" in tip and "at update 250" in tip

    # exact match in %, as the table shows it; best and last value; time to 99%
    page.select_option("#metric", "valid_exact")
    assert page.text_content("#y-title") == "validation exact match (%)"
    page.mouse.move(x + 1, box["y"] + box["height"] / 2)
    page.wait_for_function("document.getElementById('tip').textContent.includes('%')")
    row = page.locator('#runs tr[data-run="run03"]')
    assert row.locator("td.exact").inner_text() == "100.0%" and row.locator("td.best").inner_text() == "100.0%"
    # run03 first reaches >= 99% at update 500 (0.1 * 10 + 0.03), written at T0 + 50 + 3 + 0.5
    assert row.locator("td.solved").inner_text() == "54 s (update 500)"
    assert page.locator('#runs tr[data-run="run00"] td.model').inner_text().startswith("transformer 2+2 × d64, 4 heads")
    # no BLEU for these tasks
    assert "valid_bleu" not in page.eval_on_selector_all("#metric option", "(os) => os.map((o) => o.value)")

    # wall time as the x axis: the same curves, x in seconds from the start
    page.select_option("#x-axis", "time")
    assert page.text_content("#x-title") == "wall time since the start (s)"
    ticks = [float(t) for t in page.eval_on_selector_all("#chart text.xtick", "(ts) => ts.map((t) => t.textContent)")]
    assert max(ticks) <= 62 and max(ticks) >= 40  # the last record of run11: 50 + 11 + 0.5 s


def test_log_axis_labels_are_powers_of_ten(lab_page):
    root, open_page, _ = lab_page
    write_run(root, "g", curve(0))  # gradient norms 20 / i², from 20 down to 0.2
    page = open_page()
    page.select_option("#metric", "grad_norm")
    page.check("#log-y")
    page.wait_for_selector("#chart polyline.curve")
    labels = page.eval_on_selector_all("#chart text.ytick", "(ts) => ts.map((t) => t.textContent)")
    assert labels == ["0.1", "1", "10", "100"]  # a tick at each power of ten around 0.2 ... 20
    check_axes(page, "#chart", log_y=True)  # each label centred at its value on a logarithmic axis
    ys = page.eval_on_selector_all("#chart text.ytick", "(ts) => ts.map((t) => +t.getAttribute('y'))")
    steps = [a - b for a, b in zip(ys, ys[1:])]
    assert max(steps) - min(steps) < 0.5  # evenly spaced: a logarithmic axis
    assert "log scale" in page.text_content("#y-title")


def test_table_clicks_are_never_lost(lab_page):
    root, open_page, _ = lab_page
    for k in range(3):
        write_run(root, f"r{k}", curve(k))
    page = open_page()
    page.wait_for_selector('#runs tr[data-run="r2"]')
    page.evaluate("document.querySelector('#runs tr[data-run=\"r1\"]').dataset.mark = 'same'")
    box = page.locator('#runs tr[data-run="r1"] input.show')
    for i in range(20):  # across several of the page's refreshes (once a second)
        box.click()
        page.wait_for_timeout(150)
    assert box.is_checked()  # 20 clicks: back where it started
    page.wait_for_timeout(1200)
    assert page.evaluate("document.querySelector('#runs tr[data-run=\"r1\"]').dataset.mark") == "same"  # not rebuilt
    box.click()
    page.wait_for_function("document.querySelectorAll('#chart polyline.curve').length === 2")


def test_an_older_answer_is_dropped(lab_page):
    """Two looks; the first one's answer arrives last: the page shows the second's."""
    root, open_page, _ = lab_page
    write_run(root, "t", curve(0), checkpoint=True)
    page = open_page()
    page.wait_for_selector("#inside-run option", state="attached")
    held = []

    def answer(route):
        text = json.loads(route.request.post_data)["text"]
        if text == "first":
            held.append(route)
            return
        route.fulfill(status=200, content_type="application/json",
                      body=json.dumps({"run": "t", "step": 1318, "arch": "transformer", "output": "SECOND",
                                       "attention": None, "why": "stand-in"}))

    page.route("**/api/runs/t/inside", answer)
    page.fill("#inside-text", "first")
    page.click("#look")
    deadline = time.monotonic() + 20
    while not held:
        page.wait_for_timeout(50)
        assert time.monotonic() < deadline
    page.fill("#inside-text", "second")
    page.click("#look")
    page.wait_for_function("document.getElementById('inside-output') && "
                           "document.getElementById('inside-output').textContent.includes('SECOND')")
    held[0].fulfill(status=200, content_type="application/json",
                    body=json.dumps({"run": "t", "step": 1300, "arch": "transformer", "output": "FIRST",
                                     "attention": None, "why": "stand-in"}))
    page.wait_for_timeout(800)
    assert "SECOND" in page.inner_text("#inside-output") and "FIRST" not in page.inner_text("#inside-out")
    assert "the checkpoint of update 1318" in page.inner_text("#inside-step")


def test_numbers_refused_on_the_page(lab_page):
    root, open_page, _ = lab_page
    page = open_page()
    posts = []
    page.on("request", lambda r: posts.append(r.url) if r.method == "POST" else None)
    page.click("#by-hand summary")
    page.fill('#fields [data-field="d_model"]', "")
    page.click("#start")
    assert 'd_model: "" is not a number' in page.inner_text("#start-out")
    page.fill('#fields [data-field="d_model"]', "1000000000")
    page.click("#start")
    assert "d_model: this lab takes a whole number from 2 to 1024, got 1000000000" in page.inner_text("#start-out")
    assert not posts  # nothing sent: no silent fallback to the preset
    assert "at most 20,000,000 parameters" in page.inner_text("#bounds")
    options = page.eval_on_selector_all('#fields [data-field="positional"] option', "(os) => os.map((o) => o.value)")
    from qkv.config import POSITIONALS

    assert options == list(POSITIONALS) and {"sinusoidal", "learned", "none", "rotary", "relative"} <= set(options)


def test_the_set_up_round_trips_through_the_address(lab_page):
    root, open_page, _ = lab_page
    write_run(root, "r", curve(0))
    page = open_page("#task=reverse&preset=lstm%2Battention&attention=dot&d_model=32&metric=valid_exact&x=time&log=1")
    assert page.input_value("#task") == "reverse" and page.input_value("#preset") == "lstm+attention"
    assert page.input_value('#fields [data-field="attention"]') == "dot"
    assert page.input_value('#fields [data-field="d_model"]') == "32"
    assert page.input_value("#x-axis") == "time" and page.is_checked("#log-y")
    page.wait_for_function("document.getElementById('metric').value === 'valid_exact'")
    # a change goes into the address; a new page opened on it shows the same set-up
    page.select_option('#fields [data-field="attention"]', "cosine")
    page.fill('#fields [data-field="lr"]', "0.005")
    page.dispatch_event('#fields [data-field="lr"]', "change")
    page.uncheck("#stop-solved")
    url = page.url
    assert "attention=cosine" in url and "lr=0.005" in url and "stop_when_solved=false" in url
    again = open_page("#" + url.split("#", 1)[1])
    assert again.input_value('#fields [data-field="attention"]') == "cosine"
    assert again.input_value('#fields [data-field="lr"]') == "0.005"
    assert again.input_value('#fields [data-field="d_model"]') == "32"
    assert not again.is_checked("#stop-solved")
    assert again.input_value("#x-axis") == "time"


def test_a_classifier_and_a_language_model_in_the_table_and_chart(lab_page):
    root, open_page, _ = lab_page
    records = [{"step": 50, "train_loss": 2.0, "time": T0 + 5},
               {"step": 100, "valid_loss": 1.0, "valid_accuracy": 0.5, "valid_ppl": 2.7, "time": T0 + 10},
               {"step": 200, "valid_loss": 0.1, "valid_accuracy": 0.995, "valid_ppl": 1.1, "time": T0 + 20}]
    write_run(root, "cls", records, task="long_range_label")
    write_run(root, "lm", [{k: v for k, v in r.items() if k != "valid_accuracy"} for r in records], task="mirror_lm")
    page = open_page()
    page.wait_for_selector('#runs tr[data-run="lm"]')
    cls, lm = page.locator('#runs tr[data-run="cls"]'), page.locator('#runs tr[data-run="lm"]')
    assert cls.locator("td.exact").inner_text() == "99.5%" and cls.locator("td.best").inner_text() == "99.5%"
    assert cls.locator("td.solved").inner_text() == "20 s (update 200)"
    assert lm.locator("td.exact").inner_text() == "1.10 ppl" and lm.locator("td.solved").inner_text() == ""
    options = page.eval_on_selector_all("#metric option", "(os) => os.map((o) => o.value)")
    assert "valid_accuracy" in options and "valid_ppl" in options
    assert "valid_exact" not in options and "valid_bleu" not in options
    page.select_option("#metric", "valid_accuracy")
    assert page.text_content("#y-title") == "validation accuracy (%)"


def stroke_of(page) -> dict:
    return page.evaluate("Object.fromEntries([...document.querySelectorAll('#chart polyline.curve')]"
                         ".map((p) => [p.dataset.run, getComputedStyle(p).stroke]))")


def test_colours_survive_a_deletion_and_a_reload_and_a_run_gone_from_disk_leaves_the_page(lab_page):
    import shutil

    root, open_page, _ = lab_page
    for k, name in enumerate(("alpha", "beta", "gamma", "delta")):
        write_run(root, name, curve(k), ended={"status": "stopped", "reason": "stopped at update 500"})
    page = open_page()
    page.wait_for_function("document.querySelectorAll('#chart polyline.curve').length === 4")
    before = stroke_of(page)
    assert len(set(before.values())) == 4
    from qkv.lab.runs import name_hue  # a run without a recorded hue: the page's hash of its name is the lab's
    names = ["alpha", "run00", "ümlaut-ß", "x.y_z-9"]
    assert page.evaluate(f"{json.dumps(names)}.map(nameHue)") == [name_hue(n) for n in names]
    # the page's Delete asks first; dismissed, nothing happens
    page.once("dialog", lambda d: d.dismiss())
    page.click('#runs tr[data-run="beta"] button.delete')
    time.sleep(1.5)
    assert (root / "beta").is_dir()
    dialogs = []
    page.once("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    page.click('#runs tr[data-run="beta"] button.delete')
    page.wait_for_function("!document.querySelector('#runs tr[data-run=\"beta\"]')")
    assert "beta" in dialogs[0] and not (root / "beta").exists()
    assert stroke_of(page) == {n: c for n, c in before.items() if n != "beta"}
    page.reload()
    page.wait_for_function("document.querySelectorAll('#chart polyline.curve').length === 3")
    assert stroke_of(page) == {n: c for n, c in before.items() if n != "beta"}
    # a run removed on disk leaves the open page at its next refresh
    shutil.rmtree(root / "gamma")
    page.wait_for_function("!document.querySelector('#runs tr[data-run=\"gamma\"]')")
    assert sorted(stroke_of(page)) == ["alpha", "delta"]


def test_the_status_says_why_a_run_ended(lab_page):
    root, open_page, _ = lab_page
    write_run(root, "cut", curve(0), checkpoint=True,
              ended={"status": "time limit", "reason": "reached its time limit (600s) at update 500"})
    write_run(root, "won", curve(9), checkpoint=True,
              ended={"status": "solved", "reason": "exact 100.0% at update 200 (the lab stops a run at 99%)"})
    write_run(root, "shot", curve(1), ended={"status": "failed", "reason": "killed by SIGKILL (signal 9)"})
    page = open_page()
    page.wait_for_selector('#runs tr[data-run="shot"] td.status .word')
    word = lambda n: page.inner_text(f'#runs tr[data-run="{n}"] td.status .word')  # noqa: E731
    reason = lambda n: page.inner_text(f'#runs tr[data-run="{n}"] td.status .reason')  # noqa: E731
    assert word("cut") == "time limit" and reason("cut") == "reached its time limit (600s) at update 500"
    assert word("won") == "solved" and word("shot") == "failed" and reason("shot") == "killed by SIGKILL (signal 9)"
    assert page.locator('#runs tr[data-run="cut"] button.delete').is_visible()


def test_a_hover_is_cleared_when_the_data_change(lab_page):
    root, open_page, _ = lab_page
    for k in range(2):
        write_run(root, f"h{k}", curve(k))
    page = open_page()
    page.wait_for_function("document.querySelectorAll('#chart polyline.curve').length === 2")
    box = page.locator("#chart").bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_selector("#tip:not([hidden])")
    assert "h1:" in page.inner_text("#tip")
    # h1's curve goes (ticked off without moving the pointer off the chart): its value must not stay
    page.evaluate("() => { const c = document.querySelector('#runs tr[data-run=h1] input.show');"
                  " c.checked = false; c.dispatchEvent(new Event('change')); }")
    page.wait_for_function("document.querySelectorAll('#chart polyline.curve').length === 1")
    assert page.locator("#tip").is_hidden()
