"""Seeing inside: attention maps, the positional encoding, the learning-rate schedule, a run's curves.

Each picture has a pure function that returns its data and a function that draws it:

    attention_data(frontend, text, target=None)     -> panels -> attention_figure -> write_attention_png;
                                                                 write_attention_html
    positional_data(n_positions, d_model)           -> positional_png
    schedule_data(d_model, warmup, steps, scale)    -> schedule_png
    training_data(run_dir)                          -> training_png

The attention weights are those of the model's own forward pass: each model's
``attention_maps`` (``Transformer``, ``EncoderOnly``, ``DecoderOnlyTransformer``) asks every
attention layer for its weights (``need_weights=True``) and gets them back as return values;
nothing is stored on the modules. A recurrent encoder-decoder's alignment matrix a_t(s)
(``RNNSeq2Seq.attention_maps``) is drawn as the cross-attention of one layer and one head; a
recurrent language model or classifier has no attention (a clear error). Each row (one query)
sums to 1 over the keys it may see; padding keys and, in masked self-attention, future
positions get weight 0. A picture is a list of panels (kind, layer, head, query tokens, key
tokens, weights: :func:`panels`), whatever the model.

Drawing needs matplotlib (``pip install 'qkv[viz]'``), imported only when a PNG is written and
used through its Agg canvas (no pyplot, no window, no global backend switch). The HTML page
needs neither matplotlib nor a server: one file with the data and a little inline JavaScript.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError
from qkv.tasks import get_task

#: The three attention kinds of the encoder-decoder: (title, query side, key side).
KINDS: dict[str, tuple[str, str, str]] = {
    "encoder": ("encoder self-attention", "source", "source"),
    "decoder_self": ("decoder masked self-attention", "target", "target"),
    "cross": ("cross-attention (decoder queries, encoder keys)", "target", "source"),
}

INSTALL_HINT = "pip install 'qkv[viz]'"


# --- data ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Panel:
    """One heatmap: the weights of one attention kind, layer and head (0-based), queries as rows."""

    kind: str
    title: str
    layer: int
    head: int
    rows: list[str]  # query tokens
    cols: list[str]  # key tokens
    weights: list[list[float]]  # [query][key]


def panels(data: dict[str, Any]) -> list[Panel]:
    """Every panel of :func:`attention_data`'s result, kind by kind, layer by layer, head by head."""
    out = []
    for kind, layers in data["weights"].items():
        info = data["kinds"][kind]
        rows, cols = data["tokens"][info["queries"]], data["tokens"][info["keys"]]
        for li, heads in enumerate(layers):
            for hi, w in enumerate(heads):
                out.append(Panel(kind, info["title"], li, hi, rows, cols, w))
    return out


def attention_data(frontend, text: str, target: str | None = None) -> dict[str, Any]:
    """Every layer's and head's attention weights for one input, from one forward pass.

    ``frontend`` is what :func:`qkv.load` returns; which maps come back depends on the model:

    ===========================  ==================================================================
    model (task, arch)           maps
    ===========================  ==================================================================
    translate, transformer       encoder self-, decoder masked self- and cross-attention
    translate, rnn/lstm/gru      the alignment matrix a_t(s), drawn as cross-attention (1 layer, 1 head)
    classify/mlm, transformer    encoder self-attention over ``<cls>`` + the text's pieces
    lm, transformer              masked self-attention over the text's pieces
    prefix_lm, transformer       masked self-attention over ``source </s> <sep> <s> target``
    recurrent lm / classifier    none: :class:`QkvError`
    ===========================  ==================================================================

    ``text`` is the source sentence (translate, prefix_lm) or the one text (the others). A
    translation model reads ``target`` as its decoder input (BOS + pieces); with ``target=None``
    it reads its own greedy translation of ``text`` (``target_from == "greedy"``; else
    ``"given"``). The model runs in eval mode (no dropout) and is put back in the mode it was in.

    Returns a JSON-ready dict::

        model                              what was drawn, in words
        source, target, target_from        the texts (target and target_from are None for one-text models)
        tokens: {name: [...]}              pieces on the axes ("source", "target", "text" or "sequence")
        kinds: {kind: {title, queries, keys}}    queries/keys: names in tokens
        weights: {kind: [layer][head][query][key]}  floats; row i sums to 1 over the keys it may see
                                                   (padding and, in masked self-attention, the future get 0)
    """
    model = frontend.model
    cfg = model.cfg
    task = get_task(cfg.task)
    one_text = task.data_kind == "text"
    if not text.strip():
        raise QkvError("give a non-empty text" if one_text else "give a non-empty source sentence")
    if cfg.is_recurrent and one_text:
        why = "it carries the past in its hidden state" if task.stack == "decoder" else \
            f"it pools its hidden states ({cfg.pooling})"
        raise QkvError(f"this {cfg.arch} {task.kind.split(' ', 1)[1]} has no attention to draw: {why}, with no "
                       f"weights over positions (attention maps exist for the Transformer models and for a recurrent "
                       f"encoder-decoder with attention)")
    if getattr(model, "has_attention", True) is False:
        raise QkvError(f"this {cfg.arch} encoder-decoder has no attention to draw (attention = 'none': the "
                       f"decoder sees the source only through the last encoder state, the context vector)")
    if one_text and target is not None:
        raise QkvError(f"a {task.name!r} model reads one text; --target is for translation models (translate, "
                       "prefix_lm)")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if task.stack == "encoder":
                return _encoder_only_data(frontend, text)
            if one_text:
                return _decoder_only_data(frontend, text)
            return _translation_data(frontend, text, target)
    finally:
        model.train(was_training)


#: Tasks whose models read one text (no --target).


def _maps(weights: list[torch.Tensor]) -> list:
    """Per layer ``(1, h, Tq, Tk)`` -> ``[layer][head][query][key]`` floats."""
    return [w[0].float().cpu().tolist() for w in weights]


def _check_length(n: int, cfg) -> None:
    if n > cfg.max_positions:
        raise QkvError(f"the input is {n} tokens; this model reads at most max_positions={cfg.max_positions}")


def _encoder_only_data(encoder, text: str) -> dict[str, Any]:
    """classify / mlm: the encoder's self-attention over ``<cls>`` + the text (cleaned and
    truncated as :class:`qkv.frontends.Encoder` reads it)."""
    tokens = encoder.input_tokens(text)  # (1, T)
    pieces = [encoder.tokenizers.src.id_to_piece(i) for i in tokens[0].tolist()]
    return {
        "model": f"encoder-only Transformer ({encoder.task})",
        "source": text, "target": None, "target_from": None,
        "tokens": {"text": pieces},
        "kinds": {"encoder": {"title": "encoder self-attention", "queries": "text", "keys": "text"}},
        "weights": {"encoder": _maps(encoder.model.attention_maps(tokens))},
    }


def _decoder_only_data(lm, text: str) -> dict[str, Any]:
    """lm: the masked self-attention over the text's pieces (lines but the last end in EOS, as
    :meth:`qkv.tasks.lm.LanguageModel.generate` reads a prompt)."""
    ids = lm.prompt_ids(text)
    if not ids:
        raise QkvError("give a non-empty text")
    _check_length(len(ids), lm.model.cfg)
    tokens = torch.tensor([ids], device=next(lm.model.parameters()).device)  # (1, T)
    return {
        "model": "decoder-only Transformer (lm)",
        "source": text, "target": None, "target_from": None,
        "tokens": {"text": [lm.tokenizer.id_to_piece(i) for i in ids]},
        "kinds": {"decoder_self": {"title": "masked self-attention (query i sees keys j <= i)",
                                   "queries": "text", "keys": "text"}},
        "weights": {"decoder_self": _maps(lm.model.attention_maps(tokens))},
    }


def _translation_data(translator, source: str, target: str | None) -> dict[str, Any]:
    """translate (Transformer or recurrent with attention) and prefix_lm. The source is encoded as
    the model reads it (pieces + EOS), the target as the decoder reads it (BOS + pieces)."""
    from qkv.data.batching import collate
    from qkv.decoding import banned_ids, greedy, max_output_len

    model, tokenizers, device = translator.model, translator.tokenizers, translator.device
    src_ids = tokenizers.src.encode([source])[0]
    src = collate([src_ids], None).src.to(device)  # (1, S): pieces + EOS
    limit, steps = model.max_source_len(), model.max_steps(torch.tensor([src.size(1)]))
    if limit is not None and src.size(1) > limit:
        raise QkvError(f"the source is {src.size(1)} tokens (with EOS); this model reads at most {limit}")
    if target is None:
        cfg = translator.decode_cfg
        budget = max_output_len(torch.tensor([src.size(1)]), cfg.max_len_a, cfg.max_len_b,
                                None if steps is None else torch.as_tensor(steps) - 1)
        tgt_ids = greedy(model, src, budget.to(device), cfg.min_len, banned=banned_ids(tokenizers.tgt))[0]
        target_text, target_from = tokenizers.tgt.decode([tgt_ids])[0], "greedy"
    else:
        tgt_ids, target_text, target_from = tokenizers.tgt.encode([target])[0], target, "given"
        if steps is not None and len(tgt_ids) + 1 > int(steps):
            raise QkvError(f"the target is {len(tgt_ids) + 1} tokens (with BOS); this model's decoder reads at "
                           f"most {int(steps)}")
    texts = {"source": source, "target": target_text, "target_from": target_from}
    if get_task(model.cfg.task).stack == "decoder":  # prefix_lm: one sequence, source and target
        from qkv.tasks.prefix_lm import prefix_lm_example

        seq = prefix_lm_example(src_ids, tgt_ids)[0]  # src EOS <sep> BOS tgt: the training input
        _check_length(len(seq), model.cfg)
        maps = model.attention_maps(torch.tensor([seq], device=device))
        return {
            "model": "decoder-only Transformer (prefix_lm)", **texts,
            "tokens": {"sequence": [tokenizers.tgt.id_to_piece(i) for i in seq]},
            "kinds": {"decoder_self": {"title": "masked self-attention over source <sep> target (query i sees "
                                                "keys j <= i)", "queries": "sequence", "keys": "sequence"}},
            "weights": {"decoder_self": _maps(maps)},
        }
    tgt_in = collate([src_ids], [tgt_ids]).tgt_in.to(device)  # (1, T): BOS + pieces
    maps = model.attention_maps(src, tgt_in)
    if isinstance(maps, torch.Tensor):  # a recurrent model's one alignment matrix (1, T, S): one layer, one head
        per_kind, what = {"cross": [maps[:, None]]}, f"{model.cfg.arch} encoder-decoder with {model.cfg.attention} attention"
    else:
        per_kind, what = {"encoder": maps.encoder, "decoder_self": maps.decoder_self, "cross": maps.cross}, \
            "Transformer encoder-decoder"
    return {
        "model": what, **texts,
        "tokens": {
            "source": [tokenizers.src.id_to_piece(i) for i in src[0].tolist()],
            "target": [tokenizers.tgt.id_to_piece(i) for i in tgt_in[0].tolist()],
        },
        "kinds": {k: {"title": t, "queries": q, "keys": kk} for k, (t, q, kk) in KINDS.items() if k in per_kind},
        "weights": {kind: _maps(layers) for kind, layers in per_kind.items()},
    }


def positional_data(n_positions: int = 60, d_model: int = 32) -> torch.Tensor:
    """The sinusoidal table ``PE (n_positions, d_model)`` the model adds to its embeddings."""
    from qkv.nn.positional import sinusoidal_table

    if n_positions < 1:
        raise QkvError(f"positions must be at least 1, got {n_positions}")
    if d_model < 2 or d_model % 2:
        raise QkvError(f"the sinusoidal encoding needs an even dimension >= 2, got {d_model}")
    return sinusoidal_table(n_positions, d_model)


def schedule_data(d_model: int = 512, warmup: int = 4000, steps: int = 20000, scale: float = 1.0,
                  max_points: int = 4000) -> dict[str, Any]:
    """The noam learning rate at steps 1..``steps`` (at most ``max_points`` of them, always
    including step ``warmup`` when it is in range), and its peak: ``noam(warmup)``."""
    from qkv.training.schedule import noam, peak_lr

    if d_model < 1 or warmup < 1:
        raise QkvError(f"d_model and warmup must be positive, got {d_model} and {warmup}")
    if steps < 1:
        raise QkvError(f"steps must be at least 1, got {steps}")
    if not scale > 0:
        raise QkvError(f"scale must be positive, got {scale}")
    if steps <= max_points:
        xs = list(range(1, steps + 1))
    else:
        xs = sorted({1 + round(i * (steps - 1) / (max_points - 1)) for i in range(max_points)}
                    | ({warmup} if warmup <= steps else set()))
    return {
        "d_model": d_model, "warmup": warmup, "scale": scale,
        "steps": xs,
        "lr": [noam(s, d_model, warmup, scale) for s in xs],
        "peak_step": warmup,
        "peak_lr": peak_lr(d_model, warmup, scale),
    }


#: What :func:`training_data` reads from ``metrics.jsonl``: the trainer's losses, learning rate and
#: perplexity (every task), translation's and prefix_lm's BLEU / chrF / exact match, and a
#: classifier's accuracy and macro-F1 (see ``metrics`` in :mod:`qkv.tasks`).
METRIC_KEYS = ("train_loss", "lr", "valid_loss", "valid_bleu", "valid_chrf", "valid_exact", "valid_accuracy",
               "valid_macro_f1", "valid_ppl")


def metrics_file(run_dir: str | Path) -> Path:
    """``RUN/metrics.jsonl``; a checkpoint directory (``RUN/best``) or the file itself also do."""
    p = Path(run_dir)
    if p.is_file():
        return p
    for candidate in (p / "metrics.jsonl", p.parent / "metrics.jsonl"):
        if candidate.is_file():
            return candidate
    if not p.exists():
        raise QkvError(f"{p}: no such run directory")
    raise QkvError(f"{p / 'metrics.jsonl'}: metrics file not found (is {p} a run directory of 'qkv train'?)")


def training_data(run_dir: str | Path) -> dict[str, Any]:
    """The curves of a run from its ``metrics.jsonl``: ``{"file": path, "series": {key: (steps,
    values)}}`` for each of :data:`METRIC_KEYS` present. A step recorded twice (a resumed run
    repeats the steps after its last checkpoint) keeps its latest value."""
    path = metrics_file(run_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise QkvError(f"{path}: cannot read: {e}") from None
    series: dict[str, dict[int, float]] = {}
    n_records = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise QkvError(f"{path}:{n}: not a JSON record ({e.msg})") from None
        if not isinstance(record, dict):
            raise QkvError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue  # not a per-step record
        n_records += 1
        for key in METRIC_KEYS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, {})[step] = float(value)
    if n_records == 0:
        raise QkvError(f"{path}: no metrics records (empty file, or training has not logged a step yet)")
    return {"file": str(path),
            "series": {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in series.items()}}


# --- drawing -------------------------------------------------------------------------------------------

def _figure(**kwargs):
    """A matplotlib Figure on an Agg canvas (no pyplot state, no display needed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise QkvError(f"drawing needs matplotlib: {INSTALL_HINT}") from None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _png_path(path: str | Path) -> Path:
    p = Path(path)
    if p.suffix == "":
        p = p.with_name(p.name + ".png")
    elif p.suffix.lower() != ".png":
        raise QkvError(f"{p}: the picture is written as PNG; give a name ending in .png")
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def _save(fig, path: str | Path, dpi: int = 120) -> Path:
    p = _png_path(path)
    fig.savefig(p, format="png", dpi=dpi)
    return p


#: The attention PNG's layout rule (inches and points): a panel's side grows by CELL per token up to
#: PANEL_MAX (30 tokens), then stays there (the cells shrink); tick labels keep TICK_FONT points and
#: at least LABEL_PITCH between two of them: beyond that, only every k-th token is labelled.
CELL, PANEL_MAX, TICK_FONT, LABEL_PITCH = 0.2, 6.0, 7, 0.13


def axis_layout(n_tokens: int) -> tuple[float, int]:
    """(a panel side's length in inches, label every k-th token) for an axis of ``n_tokens``:
    side = min(CELL·n, PANEL_MAX), at least 1 inch; k = the least that puts LABEL_PITCH between labels."""
    side = max(1.0, min(CELL * n_tokens, PANEL_MAX))
    return side, max(1, math.ceil(LABEL_PITCH * n_tokens / side - 1e-9))


def write_attention_png(data: dict[str, Any], path: str | Path) -> Path:
    """One PNG of :func:`attention_figure`."""
    return _save(attention_figure(data), path, dpi=110)


def attention_figure(data: dict[str, Any]):
    """Every :func:`panels` entry: a block per attention kind, in it a grid (rows = layers, columns
    = heads); queries on the vertical axis, keys on the horizontal one, weights from 0 (white) to 1
    (dark blue). Each axis is laid out by :func:`axis_layout`: long inputs keep a bounded figure and
    legible labels (every k-th token, the ticks at their positions).

    The layout is computed in inches, not by matplotlib's layout engines, which are slow with
    hundreds of tick labels.
    """
    every = panels(data)
    if not every:
        raise QkvError("no attention weights to draw")
    kinds = list(dict.fromkeys(p.kind for p in every))  # in order
    n_layers = {k: 1 + max(p.layer for p in every if p.kind == k) for k in kinds}
    n_heads = 1 + max(p.head for p in every)
    cols = {p.kind: axis_layout(len(p.cols)) for p in every}  # (inches, label step)
    rows = {p.kind: axis_layout(len(p.rows)) for p in every}
    extent = {k: (cols[k][0], rows[k][0]) for k in kinds}  # (w, h)
    label = 0.15 + 0.07 * max(len(t) for p in every for t in (*p.rows, *p.cols))  # room for one axis' token labels
    gap, title, header, bar = 0.25, 0.28, 0.45, 0.9  # inches
    panel_w = max(w for w, _ in extent.values())
    width = label + n_heads * (panel_w + gap) + bar
    caption = _caption(data, width)
    top = 0.3 + 0.19 * len(caption.splitlines())  # the caption's lines of 11 points
    block = {k: header + n_layers[k] * (extent[k][1] + title) + label for k in kinds}  # height of a kind's block
    block_top = {k: top + sum(block[j] for j in kinds[:i]) for i, k in enumerate(kinds)}
    height = top + sum(block.values())
    fig = _figure(figsize=(width, height))
    fig.suptitle(caption, fontsize=11, y=1 - 0.12 / height, va="top")

    def box(x, y, w, h):  # inches from the top-left corner -> figure fractions
        return [x / width, 1 - (y + h) / height, w / width, h / height]

    for kind in kinds:
        info = data["kinds"][kind]
        fig.text(0.1 / width, 1 - (block_top[kind] + 0.3) / height,
                 f"{info['title']}: rows = {info['queries']} queries, columns = {info['keys']} keys"
                 + _thinned(cols[kind][1], rows[kind][1]), fontsize=10, weight="bold")
    images = {}
    for p in every:
        pw, ph = extent[p.kind]
        y = block_top[p.kind] + header + p.layer * (ph + title) + title
        ax = fig.add_axes(box(label + p.head * (panel_w + gap), y, pw, ph))
        images[p.kind] = ax.imshow(p.weights, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest",
                                   aspect="auto")
        ax.set_title(f"layer {p.layer + 1}, head {p.head + 1}", fontsize=8, pad=3)
        last_row, first_col = p.layer == n_layers[p.kind] - 1, p.head == 0
        x_step, y_step = cols[p.kind][1], rows[p.kind][1]
        ax.set_xticks(range(0, len(p.cols), x_step) if last_row else [])
        ax.set_yticks(range(0, len(p.rows), y_step) if first_col else [])
        if last_row:
            ax.set_xticklabels(p.cols[::x_step], rotation=90, fontsize=TICK_FONT)
        if first_col:
            ax.set_yticklabels(p.rows[::y_step], fontsize=TICK_FONT)
        ax.tick_params(length=2 if x_step > 1 or y_step > 1 else 0, pad=2)
    for kind in kinds:
        bar_h = min(n_layers[kind] * (extent[kind][1] + title) - title, 3.0)
        cax = fig.add_axes(box(label + n_heads * (panel_w + gap), block_top[kind] + header + title, 0.12, bar_h))
        fig.colorbar(images[kind], cax=cax, label="weight")
    return fig


def _thinned(col_step: int, row_step: int) -> str:
    """What a block's heading adds when not every token is labelled: "(labelled: one column in 3)"."""
    parts = [f"one {side} in {k}" for side, k in (("column", col_step), ("row", row_step)) if k > 1]
    return f" (labelled: {', '.join(parts)})" if parts else ""


def _caption(data: dict[str, Any], width: float | None = None) -> str:
    """The lines above the maps: the model and the text(s) it read; in the PNG wrapped to ``width``
    inches (the HTML page wraps its own)."""
    import textwrap

    lines = [data["model"]] if data.get("model") else []
    if data.get("target") is None:
        lines.append(f"text: {data['source']}")
    else:
        how = "the model's greedy translation" if data["target_from"] == "greedy" else "given"
        lines += [f"source: {data['source']}", f"target ({how}): {data['target']}"]
    if width is None:
        return "\n".join(lines)
    chars = max(20, int(width * 72 / (11 * 0.6)))  # an 11-point character is about 0.6 x 11 points wide
    return "\n".join(w for line in lines for w in (textwrap.wrap(line, chars) or [""]))


HTML_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>qkv attention: __TITLE__</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
  h1 { font-size: 1.3em; }
  .controls label { margin-right: 1.2em; }
  #info { font-family: ui-monospace, monospace; min-height: 1.4em; margin: .8em 0; }
  table { border-collapse: collapse; }
  td.w { width: 26px; height: 26px; border: 1px solid #e4e4e4; padding: 0; }
  td.w:hover { outline: 2px solid #d62728; }
  th { font-weight: normal; font-size: 13px; white-space: nowrap; padding: 1px 5px; font-family: ui-monospace, monospace; }
  th.key { writing-mode: vertical-rl; transform: rotate(180deg); text-align: left; vertical-align: bottom; }
  th.query { text-align: right; }
  th.on { background: #ffe08a; }
  .note { color: #666; font-size: .9em; }
</style>
</head>
<body>
<h1>Attention weights</h1>
<p id="sentences"></p>
<p class="controls">
  <label>attention <select id="kind"></select></label>
  <label>layer <select id="layer"></select></label>
  <label>head <select id="head"></select></label>
</p>
<p class="note">Rows are queries, columns keys; each row sums to 1 over the positions it may see
(hidden ones, such as future positions of the masked self-attention, are 0). Hover over a cell.</p>
<div id="info">&nbsp;</div>
<table id="map"></table>
<script type="application/json" id="qkv-attention-data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("qkv-attention-data").textContent);
const $ = (id) => document.getElementById(id);
$("sentences").textContent = data.caption.join("  |  ");

function fill(select, labels) {
  const keep = select.value;
  select.replaceChildren(...labels.map((text, i) => new Option(text, String(i))));
  if (keep !== "" && Number(keep) < labels.length) select.value = keep;
}
fill($("kind"), Object.keys(data.weights).map((k) => data.kinds[k].title));
const kindKeys = Object.keys(data.weights);

function update() {
  const kind = kindKeys[Number($("kind").value)];
  const layers = data.weights[kind];
  fill($("layer"), layers.map((_, i) => String(i + 1)));
  fill($("head"), layers[0].map((_, i) => String(i + 1)));
  draw(kind, Number($("layer").value), Number($("head").value));
}

function draw(kind, layer, head) {
  const info = data.kinds[kind];
  const queries = data.tokens[info.queries], keys = data.tokens[info.keys];
  const w = data.weights[kind][layer][head];
  const table = $("map");
  table.replaceChildren();
  const header = table.insertRow();
  const corner = document.createElement("th");
  corner.textContent = info.queries + " \\u2193 / " + info.keys + " \\u2192";
  header.appendChild(corner);
  const keyHeads = keys.map((k) => {
    const th = document.createElement("th");
    th.className = "key";
    th.textContent = k;
    header.appendChild(th);
    return th;
  });
  queries.forEach((q, i) => {
    const row = table.insertRow();
    const th = document.createElement("th");
    th.className = "query";
    th.textContent = q;
    row.appendChild(th);
    keys.forEach((k, j) => {
      const td = row.insertCell();
      const v = w[i][j];
      td.className = "w";
      td.style.background = "rgba(8, 69, 148, " + v.toFixed(3) + ")";
      td.title = q + " -> " + k + ": " + v.toFixed(4);
      td.onmouseenter = () => {
        $("info").textContent = info.title + ", layer " + (layer + 1) + ", head " + (head + 1) + ":  "
          + q + " -> " + k + ": " + v.toFixed(4);
        th.classList.add("on");
        keyHeads[j].classList.add("on");
      };
      td.onmouseleave = () => {
        th.classList.remove("on");
        keyHeads[j].classList.remove("on");
      };
    });
  });
}

$("kind").onchange = update;
$("layer").onchange = update;
$("head").onchange = update;
update();
</script>
</body>
</html>
"""


def _json_for_script(obj: Any) -> str:
    """JSON safe inside a <script> element (no '</script>' can appear)."""
    return json.dumps(obj, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_attention(data: dict, out: str) -> list[str]:
    """OUT.html and OUT.png of :func:`attention_data` (a .png or .html suffix of ``out`` is dropped)."""
    prefix = out[: -len(Path(out).suffix)] if Path(out).suffix in (".png", ".html") else out
    return [write_attention_html(data, prefix + ".html"), write_attention_png(data, prefix + ".png")]


def write_attention_html(data: dict[str, Any], path: str | Path) -> Path:
    """One self-contained HTML page (the data and the script inline, nothing fetched): choose the
    attention kind, layer and head (each choice one of :func:`panels`); hovering a cell shows
    ``query -> key: weight``."""
    rounded = {**data, "caption": _caption(data).split("\n"), "weights": {kind: [[[[round(x, 5) for x in row] for row in head] for head in layer]
                                          for layer in layers] for kind, layers in data["weights"].items()}}
    page = (HTML_TEMPLATE.replace("__TITLE__", html.escape(data["source"]))
            .replace("__DATA__", _json_for_script(rounded)))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(page, encoding="utf-8")
    return p


def positional_png(n_positions: int = 60, d_model: int = 32, path: str | Path = "positional.png") -> Path:
    """The sinusoidal encoding as a heatmap: positions down, dimensions across; the low
    dimensions (short wavelengths) change fastest from one position to the next."""
    table = positional_data(n_positions, d_model)
    w, h = min(max(8.0, 3 + 0.18 * d_model), 16), min(max(4.5, 2 + 0.09 * n_positions), 14)
    fig = _figure(figsize=(w, h))
    fig.subplots_adjust(left=0.7 / w, right=1 - 0.9 / w, bottom=0.6 / h, top=1 - 0.7 / h)
    ax = fig.add_subplot()
    image = ax.imshow(table.numpy(), cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xlabel("dimension i (even: sin, odd: cos); wavelength grows from 2π to 10000·2π")
    ax.set_ylabel("position")
    ax.set_title(f"Sinusoidal positional encoding PE(pos, i), {n_positions} positions × d_model={d_model}\n"
                 "PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d))", fontsize=10)
    fig.colorbar(image, ax=ax, label="value", pad=0.02, fraction=0.05)
    return _save(fig, path)


def schedule_png(d_model: int = 512, warmup: int = 4000, steps: int = 20000, scale: float = 1.0,
                 path: str | Path = "schedule.png") -> Path:
    """The warmup + inverse-square-root learning rate of section 5.3, its peak at step = warmup marked."""
    d = schedule_data(d_model, warmup, steps, scale)
    fig = _figure(figsize=(8, 4.5))
    fig.subplots_adjust(left=0.09, right=0.97, bottom=0.12, top=0.86)
    ax = fig.add_subplot()
    ax.plot(d["steps"], d["lr"], color="tab:blue", lw=2)
    factor = "" if scale == 1 else f"{scale:g} · "
    ax.set_title(f"lrate = {factor}d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)   "
                 f"(d_model={d_model}, warmup={warmup})", fontsize=10)
    if warmup <= steps:
        ax.axvline(warmup, color="gray", ls="--", lw=1)
        ax.plot([warmup], [d["peak_lr"]], "o", color="tab:red")
        ax.annotate(f"peak {d['peak_lr']:.3g} at step {warmup:,}", (warmup, d["peak_lr"]),
                    xytext=(12, -4), textcoords="offset points", va="top", color="tab:red")
    else:
        ax.text(0.98, 0.05, f"peak {d['peak_lr']:.3g} at step {warmup:,} (beyond the plot)",
                transform=ax.transAxes, ha="right", color="tab:red")
    ax.set_xlabel("training step")
    ax.set_ylabel("learning rate")
    ax.set_xlim(0, steps)
    ax.set_ylim(0, d["peak_lr"] * 1.12 if warmup <= steps else None)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.grid(alpha=0.3)
    return _save(fig, path)


def training_png(run_dir: str | Path, path: str | Path = "training.png") -> Path:
    """A run's curves from ``metrics.jsonl``: training and validation loss; validation BLEU, chrF
    and exact match (translate, prefix_lm) or accuracy and macro-F1 (classify); validation
    perplexity (every task: of the next token for lm, of the masked token for mlm); the learning
    rate (each where recorded)."""
    return _save(training_figure(training_data(run_dir)), path)


def training_figure(d: dict[str, Any]):
    """The figure of :func:`training_png` from :func:`training_data`'s result (four axes: loss,
    learning rate, validation quality, validation perplexity; each line labelled)."""
    s = d["series"]
    fig = _figure(figsize=(11, 7))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.9, hspace=0.25, wspace=0.2)
    fig.suptitle(f"training curves: {d['file']}", fontsize=11)
    (loss_ax, lr_ax), (quality_ax, ppl_ax) = fig.subplots(2, 2, sharex=True)

    def plot(ax, key, label, factor=1.0, **kw):
        if key in s:
            steps, values = s[key]
            marker = "o" if len(steps) < 40 else None
            ax.plot(steps, [v * factor for v in values], label=label, marker=marker, ms=3, **kw)
            return True
        return False

    def finish(ax, title, ylabel, drawn):
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if any(drawn):
            if sum(drawn) > 1 or ax is not lr_ax:
                ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "none recorded (yet)", transform=ax.transAxes, ha="center", color="gray")

    finish(loss_ax, "loss (label-smoothed cross-entropy)", "loss",
           [plot(loss_ax, "train_loss", "train", lw=1), plot(loss_ax, "valid_loss", "validation", lw=2)])
    finish(lr_ax, "learning rate", "lr", [plot(lr_ax, "lr", "lr", color="tab:green")])
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    finish(quality_ax, "validation quality", "score (0-100)",
           [plot(quality_ax, "valid_bleu", "BLEU"), plot(quality_ax, "valid_chrf", "chrF"),
            plot(quality_ax, "valid_exact", "exact match %", factor=100.0),
            plot(quality_ax, "valid_accuracy", "accuracy %", factor=100.0),
            plot(quality_ax, "valid_macro_f1", "macro-F1 %", factor=100.0)])
    drawn_ppl = plot(ppl_ax, "valid_ppl", "perplexity", color="tab:purple")
    finish(ppl_ax, "validation perplexity", "perplexity", [drawn_ppl])
    if drawn_ppl:
        values = [v for v in s["valid_ppl"][1] if math.isfinite(v) and v > 0]
        if values and max(values) / min(values) > 20:
            ppl_ax.set_yscale("log")
    quality_ax.set_xlabel("step")
    ppl_ax.set_xlabel("step")
    return fig


__all__ = [
    "KINDS", "Panel", "panels", "attention_data", "positional_data", "schedule_data", "training_data", "metrics_file",
    "write_attention_png", "write_attention_html", "positional_png", "schedule_png", "training_png",
    "training_figure",
]
