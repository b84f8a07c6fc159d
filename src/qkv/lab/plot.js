// qkv lab's charts: one small component for every figure of the page and the lecture panels (no build
// step, nothing downloaded). Scales with "nice" ticks (1, 2 or 5 × 10^k), labels formatted to the tick
// step (0.001 → "0.006"; past four decimals or 10^4, "2.5e-5" / "20k"), logarithmic axes with a tick at
// every power of ten (and at 2 and 5 within a decade or two), each label placed at its value; line charts,
// bar charts with an axis, and colour scales for heat maps. Inlined once per page as window.QkvPlot.
window.QkvPlot = window.QkvPlot || (() => {
  "use strict";
  const esc = s => String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
  const SUP = {"-": "⁻", "0": "⁰", "1": "¹", "2": "²", "3": "³", "4": "⁴", "5": "⁵", "6": "⁶", "7": "⁷", "8": "⁸", "9": "⁹"};
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#7f7f7f", "#e377c2"];

  // the tick step for about n intervals over span: 1, 2 or 5 × 10^e; {step, e}
  function niceStep(span, n) {
    const raw = span / Math.max(1, n), e = Math.floor(Math.log10(raw)), f = raw / 10 ** e;
    const m = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
    return m === 10 ? {step: 10 ** (e + 1), e: e + 1} : {step: m * 10 ** e, e};
  }

  // a linear scale over [lo, hi] widened to whole ticks (unless ``exact``): {lo, hi, ticks, format}
  function linear(lo, hi, n = 5, exact = false) {
    if (!(hi > lo)) { const d = lo === 0 ? 1 : Math.abs(lo) / 2; lo -= d; hi += d; }
    const {step, e} = niceStep(hi - lo, n);
    const a = exact ? lo : Math.floor(lo / step + 1e-9) * step, b = exact ? hi : Math.ceil(hi / step - 1e-9) * step;
    const ticks = [];
    for (let k = Math.ceil(a / step - 1e-9); k * step <= b + step * 1e-9; k++) ticks.push(+(k * step).toPrecision(12));
    return {lo: a, hi: b, ticks, format: formatter(step, e, Math.max(Math.abs(a), Math.abs(b))), log: false};
  }

  // the labels of ticks ``step`` = m × 10^e apart: as many decimals as the step has; "20k" / "1.5M" past 10^4;
  // "2.5e-5" where the step needs more than four decimals
  function formatter(step, e, top) {
    if (top >= 1e4) {
      const [unit, suffix] = top >= 1e9 ? [1e9, "G"] : top >= 1e6 ? [1e6, "M"] : [1e3, "k"];
      const d = Math.max(0, -Math.floor(Math.log10(step / unit) + 1e-9));
      return v => v === 0 ? "0" : (v / unit).toFixed(d) + suffix;
    }
    if (e < -4) {
      const digits = Math.max(0, Math.floor(Math.log10(top) + 1e-9) - e);
      return v => v === 0 ? "0" : v.toExponential(Math.min(digits, 3)).replace(/\.?0+e/, "e").replace("e+", "e");
    }
    const d = Math.max(0, -e);
    return v => v.toFixed(d).replace(/^-(0\.?0*)$/, "$1");
  }

  // a value with ``sig`` significant digits, without trailing zeros: 0.00625, 1.2e-5, 3.14
  function sig(v, digits = 3) {
    if (v === 0 || !Number.isFinite(v)) return String(v);
    const a = Math.abs(v);
    if (a >= 1e5 || a < 1e-4) return v.toExponential(digits - 1).replace(/\.?0+e/, "e").replace("e+", "e");
    return String(+v.toPrecision(digits));
  }

  const power = k => "10" + String(k).split("").map(c => SUP[c]).join("");
  // a logarithmic scale over [lo, hi] > 0: whole decades, a tick at each power of ten (and at 2 and 5 when
  // the range spans two decades or fewer); labels 10ⁿ, or the plain value where it is short
  function logarithmic(lo, hi) {
    let a = Math.floor(Math.log10(lo) + 1e-9), b = Math.ceil(Math.log10(hi) - 1e-9);
    if (b <= a) b = a + 1;
    const ticks = [], minor = b - a <= 2;
    for (let k = a; k <= b; k++) {
      ticks.push(10 ** k);
      if (minor && k < b) ticks.push(2 * 10 ** k, 5 * 10 ** k);
    }
    const format = v => {
      const k = Math.round(Math.log10(v));
      if (Math.abs(v - 10 ** k) < 1e-9 * v) return k >= -2 && k <= 3 ? String(+(10 ** k).toPrecision(3)) : power(k);
      return sig(v, 2);
    };
    return {lo: 10 ** a, hi: 10 ** b, ticks: ticks.map(t => +t.toPrecision(12)), format, log: true, decades: [a, b]};
  }

  // a scale's map from values to pixels [p0, p1]
  function mapper(scale, p0, p1) {
    const t = scale.log ? v => Math.log10(v) : v => v, t0 = t(scale.lo), t1 = t(scale.hi);
    return v => p0 + (t(v) - t0) / (t1 - t0) * (p1 - p0);
  }

  // the width a figure may take on this screen: its own, or what the window leaves (so its text stays its size)
  const fit = w => Math.max(240, Math.min(w, (window.innerWidth || w) - 56));

  // axes of a plot box: ticks and grid lines, labels at their values (class tick x / tick y, data-value)
  function axes(X, Y, xs, ys, box, opts) {
    const {l, r, t, b, w, h} = box;
    let out = "";
    for (const v of ys.ticks) {
      const y = Y(v);
      out += `<line x1="${l}" x2="${w - r}" y1="${y.toFixed(1)}" y2="${y.toFixed(1)}" stroke="#eef0f3"/>` +
        `<line x1="${l - 4}" x2="${l}" y1="${y.toFixed(1)}" y2="${y.toFixed(1)}" stroke="#98a2b3"/>` +
        `<text class="tick y" data-value="${v}" x="${l - 6}" y="${y.toFixed(1)}" dy="0.32em" text-anchor="end">${esc(ys.format(v))}</text>`;
    }
    const every = Math.max(1, Math.ceil(xs.ticks.length / Math.max(2, Math.floor((w - l - r) / 46))));
    xs.ticks.forEach((v, i) => {
      const x = X(v);
      out += `<line x1="${x.toFixed(1)}" x2="${x.toFixed(1)}" y1="${h - b}" y2="${h - b + 4}" stroke="#98a2b3"/>`;
      if (i % every === 0) out += `<text class="tick x" data-value="${v}" x="${x.toFixed(1)}" y="${h - b + 15}" text-anchor="middle">${esc(xs.format(v))}</text>`;
    });
    out += `<line x1="${l}" x2="${w - r}" y1="${h - b}" y2="${h - b}" stroke="#98a2b3"/><line x1="${l}" x2="${l}" y1="${t}" y2="${h - b}" stroke="#98a2b3"/>`;
    if (opts.xlabel) out += `<text class="axis-title x" x="${l + (w - l - r) / 2}" y="${h - 3}" text-anchor="middle">${esc(opts.xlabel)}</text>`;
    if (opts.ylabel) out += `<text class="axis-title y" transform="translate(11 ${t + (h - t - b) / 2}) rotate(-90)" text-anchor="middle">${esc(opts.ylabel)}</text>`;
    return out;
  }

  // a line chart of series [{name, pts: [[x, y], ...], color}] as an SVG figure. opts: w, h, xlabel, ylabel,
  // title, logx, logy, ylim [lo, hi], marks (x values, dashed), hline (y value, dashed), peaks (label each
  // curve's largest value), legend (false: none)
  function line(series, opts = {}) {
    const w = fit(opts.w || 300), h = opts.h || 190, box = {l: opts.ylabel ? 58 : 46, r: 12, t: 10, b: opts.xlabel ? 34 : 22, w, h};
    const okx = p => !opts.logx || p[0] > 0, oky = p => !opts.logy || p[1] > 0;
    const all = series.flatMap(s => s.pts).filter(p => okx(p) && oky(p) && Number.isFinite(p[0]) && Number.isFinite(p[1]));
    if (!all.length) return "";
    const xsr = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
    const ysr = opts.ylim || [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
    const xn = Math.max(2, Math.min(8, Math.floor((w - box.l - box.r) / 60)));
    const xs = opts.logx ? logarithmic(xsr[0], xsr[1]) : linear(xsr[0], xsr[1], xn);
    const ys = opts.logy ? logarithmic(ysr[0], ysr[1]) : linear(ysr[0], ysr[1], Math.max(3, Math.min(6, Math.floor((h - box.t - box.b) / 32))), !!opts.ylim);
    const X = mapper(xs, box.l, w - box.r), Y = mapper(ys, h - box.b, box.t);
    let out = axes(X, Y, xs, ys, box, opts);
    for (const m of opts.marks || []) if (okx([m])) out += `<line class="mark" x1="${X(m).toFixed(1)}" x2="${X(m).toFixed(1)}" y1="${box.t}" y2="${h - box.b}" stroke="#bbb" stroke-dasharray="3 3"/>`;
    if (opts.hline !== undefined) out += `<line class="hline" x1="${box.l}" x2="${w - box.r}" y1="${Y(opts.hline).toFixed(1)}" y2="${Y(opts.hline).toFixed(1)}" stroke="#bbb" stroke-dasharray="3 3"/>`;
    series.forEach((s, i) => {
      const c = s.color || COLORS[i % COLORS.length], ok = s.pts.filter(p => okx(p) && oky(p));
      if (!ok.length) return;
      out += `<polyline class="curve" fill="none" stroke="${c}" stroke-width="1.6" points="${ok.map(p => X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1)).join(" ")}"/>`;
      if (ok.length <= 80) out += ok.map(p => `<circle cx="${X(p[0]).toFixed(1)}" cy="${Y(p[1]).toFixed(1)}" r="2.3" fill="${c}"><title>${esc(s.name)}: ${sig(p[0], 4)}, ${sig(p[1], 4)}</title></circle>`).join("");
      if (opts.peaks) {
        const p = ok.reduce((a, q) => q[1] > a[1] ? q : a);
        out += `<circle cx="${X(p[0]).toFixed(1)}" cy="${Y(p[1]).toFixed(1)}" r="3.2" fill="${c}"/><text class="peak" data-value="${p[1]}" x="${(X(p[0]) + 5).toFixed(1)}" y="${(Y(p[1]) - 5).toFixed(1)}" fill="${c}">${esc(sig(p[1], 3))}</text>`;
      }
    });
    const legend = opts.legend === false ? "" : series.map((s, i) => `<span class="key"><span style="color:${s.color || COLORS[i % COLORS.length]}">■</span> ${esc(s.name)}</span>`).join(" ");
    return `<figure class="qkv-chart" style="margin:0;max-width:${w}px"><svg class="plot" width="${w}" height="${h}" viewBox="0 0 ${w} ${h}">${out}</svg>` +
      `<figcaption>${esc(opts.title || "")}${legend ? "<br>" + legend : ""}</figcaption></figure>`;
  }

  // a bar chart with an axis: values, their labels (one per bar, or every few), opts: w, h, ylim, ylabel, title, color
  function bars(values, labels, opts = {}) {
    const w = fit(opts.w || 260), h = opts.h || 150, box = {l: opts.ylabel ? 52 : 40, r: 8, t: 8, b: opts.xlabel ? 34 : 22, w, h};
    const top = Math.max(...values, 0), low = Math.min(...values, 0);
    const ys = linear(...(opts.ylim || [low, top > low ? top : low + 1]), 4, !!opts.ylim);
    const Y = mapper(ys, h - box.b, box.t), bw = (w - box.l - box.r) / Math.max(1, values.length);
    let out = "";
    for (const v of ys.ticks) {
      const y = Y(v);
      out += `<line x1="${box.l}" x2="${w - box.r}" y1="${y.toFixed(1)}" y2="${y.toFixed(1)}" stroke="#eef0f3"/><line x1="${box.l - 4}" x2="${box.l}" y1="${y.toFixed(1)}" y2="${y.toFixed(1)}" stroke="#98a2b3"/>` +
        `<text class="tick y" data-value="${v}" x="${box.l - 6}" y="${y.toFixed(1)}" dy="0.32em" text-anchor="end">${esc(ys.format(v))}</text>`;
    }
    const every = Math.max(1, Math.ceil(values.length / Math.max(1, Math.floor((w - box.l - box.r) / 28))));
    values.forEach((v, i) => {
      const y0 = Y(Math.max(0, ys.lo)), y = Y(v), x = box.l + i * bw;
      out += `<rect class="bar" x="${(x + 1).toFixed(1)}" y="${Math.min(y, y0).toFixed(1)}" width="${Math.max(1, bw - 2).toFixed(1)}" height="${Math.abs(y0 - y).toFixed(1)}" fill="${opts.color || COLORS[0]}"><title>${esc(labels ? labels[i] : i + 1)}: ${sig(v, 4)}</title></rect>`;
      if (i % every === 0) out += `<text class="tick x" x="${(x + bw / 2).toFixed(1)}" y="${h - box.b + 13}" text-anchor="middle">${esc(labels ? labels[i] : i + 1)}</text>`;
    });
    out += `<line x1="${box.l}" x2="${w - box.r}" y1="${h - box.b}" y2="${h - box.b}" stroke="#98a2b3"/><line x1="${box.l}" x2="${box.l}" y1="${box.t}" y2="${h - box.b}" stroke="#98a2b3"/>`;
    if (opts.xlabel) out += `<text class="axis-title x" x="${box.l + (w - box.l - box.r) / 2}" y="${h - 3}" text-anchor="middle">${esc(opts.xlabel)}</text>`;
    if (opts.ylabel) out += `<text class="axis-title y" transform="translate(11 ${box.t + (h - box.t - box.b) / 2}) rotate(-90)" text-anchor="middle">${esc(opts.ylabel)}</text>`;
    return `<figure class="qkv-bars" style="margin:0;max-width:${w}px"><svg class="plot" width="${w}" height="${h}" viewBox="0 0 ${w} ${h}">${out}</svg>` +
      (opts.title ? `<figcaption>${esc(opts.title)}</figcaption>` : "") + "</figure>";
  }

  // a heat map's colours: "unit" 0 … 1 white → blue; "signed" −top … top blue → white → red
  function colour(kind, v, top) {
    if (v === null || v === undefined) return "#f2f4f7";
    if (kind === "unit") return `rgba(47,91,234,${Math.min(Math.max(v, 0), 1).toFixed(3)})`;
    const a = Math.min(Math.abs(v) / (top || 1), 1);
    return v >= 0 ? `rgba(214,39,40,${a.toFixed(3)})` : `rgba(31,119,180,${a.toFixed(3)})`;
  }
  // the colour scale beside a heat map: a bar from its lowest to its highest value, labelled at both ends
  // (and 0 in the middle of a signed one)
  function colourScale(kind, top, label) {
    const stops = kind === "unit" ? [[0, 0], [1, 1]] : [[0, -top], [0.5, 0], [1, top]];
    const grad = stops.map(([at, v]) => `${colour(kind, v, top)} ${at * 100}%`).join(", ");
    const ends = kind === "unit" ? ["0", "1"] : [sig(-top, 2), sig(top, 2)];
    return `<div class="colour-scale" data-kind="${kind}" data-lo="${kind === "unit" ? 0 : -top}" data-hi="${kind === "unit" ? 1 : top}" style="display:flex;align-items:center;gap:.3rem;font-size:.72rem;color:#667085;margin:.2rem 0">` +
      `<span class="lo">${esc(ends[0])}</span><span class="bar" style="display:inline-block;width:7rem;height:.6rem;border:1px solid #d0d5dd;background:linear-gradient(to right, ${grad})"></span>` +
      `<span class="hi">${esc(ends[1])}</span>${kind === "unit" ? "" : `<span>(0: white)</span>`}${label ? ` <span>${esc(label)}</span>` : ""}</div>`;
  }

  return {niceStep, linear, logarithmic, mapper, formatter, sig, line, bars, colour, colourScale, fit, COLORS, esc};
})();
