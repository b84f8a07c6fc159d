"""The guided tour of docs/lab.md, one function per step, driving the lab page in headless Chromium.

tests/test_lab_tour_browser.py walks it end to end (runs started by the tour wait instead of training,
the look-inside steps read the test fixtures' checkpoints). Run as a script it trains the tour's runs
for real and writes each step's screenshot (how docs/img/tour/*.png are made)::

    python tests/lab_tour.py --out docs/img/tour            # about 6 minutes: four small runs train first

Each step does what the tour says to try and returns the part of the page the tour describes; the
step's name is the screenshot's (``NN-name.png``) and the anchor of its heading in docs/lab.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

TASK = "reverse"
TEXT = "abcdefgh"
LONG_TEXT = "abcdefghijabcdefghija"


@dataclass
class Tour:
    """What the steps share: the page, the run names they start (``started``) and the ones to look inside."""

    page: object
    transformer: str = "transformer-reverse"  # a Transformer run with a checkpoint
    rnn: str = "lstm-attention-reverse"  # an LSTM run with a checkpoint
    rnn_plain: str = "lstm-reverse"  # an LSTM run without attention with a checkpoint (the gradient's)
    started: list[str] = field(default_factory=list)
    seen: dict = field(default_factory=dict)  # what the steps read off the page (the form's lists)


def choose(select, value) -> None:
    """Choose the option whose value is ``value`` (Playwright's select_option also matches labels, and
    the panels label layer and head indices from 1) and tell the page, as a user's choice does."""
    select.evaluate("(e, v) => { if (![...e.options].some(o => o.value === v)) throw new Error('no option ' + v); "
                    "e.value = v; e.dispatchEvent(new Event('input', {bubbles: true})); "
                    "e.dispatchEvent(new Event('change', {bubbles: true})); }", str(value))


def start(t: Tour, name: str, preset: str, model: dict | None = None) -> None:
    """Start a run from the page's form, as a student does: task, architecture, fields set by hand."""
    page = t.page
    page.select_option("#task", TASK)
    page.select_option("#preset", preset)
    page.fill("#run-name", name)
    fields = dict(model or {})
    if fields:
        page.click("#by-hand summary")
        for key, value in fields.items():
            el = page.locator(f'#fields [data-field="{key}"]')
            if el.evaluate("e => e.tagName") == "SELECT":
                choose(el, value)
            else:
                el.fill(str(value))
    with page.expect_response(lambda r: r.url.endswith("/api/runs") and r.request.method == "POST") as reply:
        page.click("#start")
    assert reply.value.status == 201, reply.value.text()
    if fields:
        page.click("#by-hand summary")
    page.wait_for_selector(f"#runs tr:has-text('{name}')")
    t.started.append(name)


def panel(t: Tour, name: str, **controls) -> object:
    """Open a lecture panel (if closed), set its controls, and wait for the answer to the last of them."""
    page = t.page
    sec = f"#panel-{name}"
    seq = f"Number(document.querySelector('{sec} .out').dataset.seq || 0)"
    for attempt in range(3):  # a click that a moving layout sent elsewhere is made again
        if page.locator(f"{sec} details[open]").count():
            break
        page.click(f"{sec} summary")
        page.wait_for_timeout(500)
    page.wait_for_function(f"{seq} > 0")
    before = page.evaluate(seq)
    idle = f"document.querySelector('{sec} .out').dataset.state !== 'loading'"
    for key, value in controls.items():  # one at a time, as a student does: each on the answer to the last
        page.wait_for_function(idle)
        el = page.locator(f"{sec} .controls [name={key}]")
        tag = el.evaluate("e => e.tagName + (e.type ? ':' + e.type : '')")
        if tag.startswith("SELECT"):
            page.wait_for_function(f"[...document.querySelector('{sec} .controls [name={key}]').options]"
                                   f".some(o => o.value === {json.dumps(str(value))})")
            choose(el, value)
        else:
            el.fill(str(value))
            if not tag.endswith("range"):
                el.dispatch_event("change")
    page.wait_for_timeout(200)
    if page.evaluate(seq) == before and page.evaluate(f"document.querySelector('{sec} .out').dataset.state") != "loading":
        go = page.locator(f"{sec} [data-go]")
        if go.count():
            go.click()
    drawn = f"{seq} > {before} && document.querySelector('{sec} .out').dataset.state !== 'loading'"
    for attempt in range(3):  # a lost event on a loaded machine: ask again with the panel's button
        try:
            page.wait_for_function(drawn, timeout=30_000)
            break
        except Exception:
            if attempt == 2 or not page.locator(f"{sec} [data-go]").count():
                raise
            page.click(f"{sec} [data-go]")
    out = page.locator(f"{sec} .out")
    assert out.get_attribute("data-state") == "done", out.inner_text()
    return page.locator(sec)


# --- the steps, in the lecture's order ---------------------------------------------------------------------

def rnn(t: Tour):
    """An LSTM encoder-decoder without attention: the whole input through one vector."""
    start(t, "lstm-reverse", "lstm")
    return t.page.locator("#runs-panel")


def rnn_attention(t: Tour):
    """The same LSTM with attention (Bahdanau's additive score)."""
    start(t, "lstm-attention-reverse", "lstm+attention")
    t.page.select_option("#metric", "valid_exact")
    return t.page.locator("#curves-panel")


def transformer(t: Tour):
    """A Transformer on the same task; look inside at its cross-attention."""
    start(t, "transformer-reverse", "transformer")
    return look_inside(t)


def look_inside(t: Tour):
    """The Transformer run's cross-attention for TEXT, in the main page's look-inside panel."""
    page = t.page
    page.select_option("#inside-run", t.transformer)
    page.fill("#inside-text", TEXT)
    with page.expect_response(lambda r: r.url.endswith("/inside")):
        page.click("#look")
    page.wait_for_selector("#heads table, #heads figure")
    page.select_option("#kind", "cross")
    return page.locator("#inside-panel")


def choices(t: Tour, preset: str, field: str) -> list[str]:
    """The values the form offers for ``field`` of ``preset`` (set by hand)."""
    page = t.page
    page.select_option("#preset", preset)
    page.click("#by-hand summary")
    values = page.locator(f'#fields select[data-field="{field}"] option').evaluate_all("os => os.map(o => o.value)")
    page.click("#by-hand summary")
    return values


def scores(t: Tour):
    """The attention scores the form offers an RNN, and why dot products are scaled: d_k = 1024."""
    t.seen["scores"] = choices(t, "lstm+attention", "attention")
    return panel(t, "attention", d_k_log2=10)


def positions(t: Tour):
    """A Transformer without positions beside one with them, and the positional encoding."""
    t.seen["positional"] = choices(t, "transformer", "positional")
    start(t, "transformer-no-positions", "transformer", {"positional": "none"})
    return panel(t, "positions", length=48, d_model=32)


def masks(t: Tour):
    return panel(t, "masks", text="the cat sat\na dog")


def steps(t: Tour):
    """Cross-attention of the last layer step by step; the screenshot: scores to next token."""
    sec = panel(t, "steps", run=t.transformer, text=TEXT, kind="cross", layer=1, head=0, temperature=0.5, position=2)
    return sec.locator(".stage").nth(3), sec.locator(".stage").nth(5)


def model_view(t: Tour):
    sec = panel(t, "model", run=t.transformer, text=TEXT)
    t.page.hover("#panel-model .tokens[data-side=source] span[data-i='3']")
    return sec


def gates(t: Tour):
    return panel(t, "gates", run=t.rnn, text=TEXT)


def gradients(t: Tour):
    return panel(t, "gradients", run=t.rnn_plain, run2=t.transformer, text=LONG_TEXT, scope="all")


def schedule(t: Tour):
    return panel(t, "schedule", d_model="512,64", warmup="4000,400", steps=20000)


def smoothing(t: Tour):
    return panel(t, "smoothing", epsilon=0.1, vocab=10, gold=3)


STEPS: list[tuple[str, Callable[[Tour], object]]] = [
    ("rnn", rnn), ("rnn-attention", rnn_attention), ("transformer", transformer), ("scores", scores),
    ("positions", positions), ("masks", masks), ("step-by-step", steps), ("model-view", model_view),
    ("gates", gates), ("vanishing-gradient", gradients), ("schedule", schedule), ("label-smoothing", smoothing),
]


def shoot(page, element, path: Path, max_height: int = 1000) -> Path:
    """A screenshot of ``element`` (or of a pair: from the first's top to the second's bottom), its top
    ``max_height`` pixels, as a small palette PNG."""
    first, last = element if isinstance(element, tuple) else (element, element)
    where = ("e => { const r = e.getBoundingClientRect(); "
             "return {x: r.left + scrollX, y: r.top + scrollY, width: r.width, bottom: r.bottom + scrollY}; }")
    top, bottom = first.evaluate(where), last.evaluate(where)
    height = min(bottom["bottom"] - top["y"], max_height)
    page.screenshot(path=str(path), clip={"x": top["x"], "y": top["y"], "width": top["width"], "height": height},
                    full_page=True)
    from PIL import Image

    with Image.open(path) as img:
        img.convert("RGB").quantize(colors=64).save(path, optimize=True)
    return path


# --- the script: train the tour's runs, then walk it taking the screenshots ---------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="train the tour's runs in a lab and screenshot each step of the tour")
    ap.add_argument("--out", default="docs/img/tour", help="where the NN-step.png files go")
    ap.add_argument("--train-seconds", type=int, default=240,
                    help="each run's time limit (the Transformer solves reverse in about 160 s on an idle 2-core machine)")
    ap.add_argument("--chromium", default=None, help="Chromium's executable (default: the tests' search)")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import CHROMIUM
    from playwright.sync_api import sync_playwright

    from qkv.lab.app import create_app
    from qkv.lab.runs import Lab, LabLimits
    from qkv.serve import BackgroundServer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="qkv-tour-")) / "runs"
    lab = Lab(root, LabLimits(max_runs=4, max_time=args.train_seconds))
    lab.warm()  # as qkv lab starts its runs
    try:
        with BackgroundServer(create_app(lab)) as server, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium or CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.set_default_timeout(120_000)
            page.goto(server.url + "/")
            page.wait_for_selector("#task option", state="attached")
            t = Tour(page)  # each run trains for at most --train-seconds: the lab's --max-time
            for name, preset, model in (("lstm-reverse", "lstm", None),
                                        ("lstm-attention-reverse", "lstm+attention", None),
                                        ("transformer-reverse", "transformer", None),
                                        ("transformer-no-positions", "transformer", {"positional": "none"})):
                start(t, name, preset, model)
            print(f"training {', '.join(t.started)} for up to {args.train_seconds} s", flush=True)
            end = time.time() + args.train_seconds + 120
            while lab.running() and time.time() < end:
                time.sleep(5)
            for name in t.started:  # what the tour's text quotes of the screenshots' runs
                d, valid = lab.describe(name), [r for r in lab.metrics(name)["records"] if "valid_exact" in r]
                last = valid[-1] if valid else {}
                solved = next((r for r in valid if r["valid_exact"] >= 0.99), None)
                print(name, json.dumps({"status": d["status"], "reason": d.get("reason", ""), "update": last.get("step"),
                                        "last_exact": last.get("valid_exact"),
                                        "best_exact": max((r["valid_exact"] for r in valid), default=None),
                                        "seconds_to_99": round(solved["time"] - d["started"], 1) if solved else None}),
                      flush=True)
            page.reload()
            page.wait_for_selector("#task option", state="attached")
            t.started.clear()
            for i, (name, step) in enumerate(STEPS, 1):
                if step in (rnn, rnn_attention, transformer):  # the runs exist: show them instead of starting
                    element = shown_run_step(t, step)
                elif step is positions:
                    element = panel(t, "positions", length=48, d_model=32)
                else:
                    try:
                        element = step(t)
                    except Exception:
                        print(f"step {name} failed; the page's panels:", page.evaluate(
                            "[...document.querySelectorAll('.panels .out')].map(o => [o.closest('section').id, "
                            "o.dataset.state, o.dataset.seq])"), file=sys.stderr)
                        raise
                path = shoot(page, element, out / f"{i:02d}-{name}.png")
                print(f"{path} {path.stat().st_size // 1024} KB", flush=True)
            browser.close()
    finally:
        lab.stop_all()
        shutil.rmtree(root.parent, ignore_errors=True)
    return 0


def shown_run_step(t: Tour, step):
    """The screenshots of the first three steps: the trained runs, as the tour describes them."""
    page = t.page
    if step is rnn:
        page.wait_for_selector("#runs tr:has-text('lstm-reverse')")
        return page.locator("#runs-panel")
    if step is rnn_attention:
        page.select_option("#metric", "valid_exact")
        page.wait_for_timeout(1500)
        return page.locator("#curves-panel")
    return look_inside(t)


if __name__ == "__main__":
    sys.exit(main())
