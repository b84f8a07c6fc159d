"""Checks of the lab's charts in a real browser, shared by the browser tests: every tick label sits at
its value (its centre, in screen pixels, on the line the scale draws values on) and reads as its value,
and the curves' points lie where the axes say."""

from __future__ import annotations

import math
import re

SUPER = str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789")

TICKS_JS = """(svg) => {
  const centre = (el) => { const b = el.getBoundingClientRect(); return [b.left + b.width / 2, b.top + b.height / 2]; };
  const pick = (sel) => [...svg.querySelectorAll(sel)].map((t) => ({text: t.textContent, value: +t.dataset.value, at: centre(t)}));
  const own = (sel) => [...svg.querySelectorAll(sel)];
  const points = own("circle").filter((c) => c.querySelector("title")).map((c) => {
    const b = c.getBoundingClientRect();
    return {title: c.querySelector("title").textContent, at: [b.left + b.width / 2, b.top + b.height / 2]};
  });
  const box = svg.getBoundingClientRect();
  return {x: pick("text.tick.x, text.xtick"), y: pick("text.tick.y, text.ytick"), points, width: box.width,
          right: box.right};
}"""


def read(text: str) -> float:
    """A tick label as a number: 0.006, 20k, 1.5M, 2.5e-5, 10⁻³."""
    t = text.strip()
    if t.startswith("10") and any(c in t for c in "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"):
        return 10.0 ** int(t[2:].translate(SUPER))
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}.get(t[-1:], 1)
    return float(t[:-1] if scale != 1 else t) * scale


def fit(pairs: list[tuple[float, float]], log: bool) -> tuple[float, float]:
    """Least squares pixel = a + b·value (or b·log10 value)."""
    xs = [math.log10(v) if log else v for v, _ in pairs]
    ys = [p for _, p in pairs]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def check_axes(page, svg_selector: str, log_x: bool = False, log_y: bool = False, tolerance: float = 1.0) -> dict:
    """Every tick label of the chart ``svg_selector`` centred at its value on a linear (or logarithmic)
    scale within ``tolerance`` pixels, its text reading as its value, and (where the chart's points carry
    a title "name: x, y") each point where the fitted scales put it. Returns the ticks."""
    got = page.eval_on_selector(svg_selector, TICKS_JS)
    for axis, log, coord in (("x", log_x, 0), ("y", log_y, 1)):
        ticks = got[axis]
        assert len(ticks) >= 2, (axis, ticks)
        for t in ticks:  # the text says the value it stands for, to the precision the step needs
            assert math.isclose(read(t["text"]), t["value"], rel_tol=0.02, abs_tol=1e-12), t
        a, b = fit([(t["value"], t["at"][coord]) for t in ticks], log)
        for t in ticks:
            v = math.log10(t["value"]) if log else t["value"]
            assert abs(a + b * v - t["at"][coord]) <= tolerance, (axis, t, a + b * v)
        got[axis + "_scale"] = (a, b)
    for p in got["points"]:
        m = re.search(r": ([-0-9.e]+), ([-0-9.e]+)$", p["title"])
        if not m:
            continue
        for coord, value, log in ((0, float(m.group(1)), log_x), (1, float(m.group(2)), log_y)):
            a, b = got["xy"[coord] + "_scale"]
            v = math.log10(value) if log else value
            assert abs(a + b * v - p["at"][coord]) <= 1.5, (p, coord)
    return got
