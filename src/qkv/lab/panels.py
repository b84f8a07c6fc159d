"""The lecture panels of ``qkv lab``: the paper's ideas computed by qkv's own modules, one JSON
answer per panel, drawn by ``panels.html`` (an HTML fragment the lab page inlines).

    GET /api/panels/attention?d_k=64&n_keys=10&seed=0   eq. 1 with and without 1/√d_k (section 3.2.1)
    GET /api/panels/positions?length=64&d_model=64     the sinusoidal encoding and its dot products (3.5)
    GET /api/panels/masks?text=...                     padding, causal and decoder self-attention masks
    GET /api/panels/cost                               Table 1, measured (qkv bench layers, long-range)
    GET /api/panels/cost/measure?d=64&n_max=128        a short ``qkv bench layers`` run, a few seconds
    GET /api/panels/schedule?d_model=512,256&warmup=4000,1000&steps=20000   the learning rate of section 5.3
    GET /api/panels/smoothing?epsilon=0.1&vocab=10&gold=3                   label smoothing's target (5.4)

Every number comes from qkv: the weights from :func:`qkv.nn.attention.attention_reference`, the
encoding from :class:`qkv.nn.positional.SinusoidalPositionalEncoding`, the masks from
:mod:`qkv.masks`, Table 1 from :mod:`qkv.complexity`, the schedule from
:func:`qkv.training.schedule.noam`, the smoothed target from :func:`qkv.losses.label_smoothed_nll_loss`
(each with its source); the page only draws them. A value out of its
range is refused with 422 and a one-line message that names the field.

``register(app)`` adds the routes to a FastAPI app (the ``serve`` extra); the functions behind
them (``attention_panel``, ...) need only torch.
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
from pathlib import Path

import torch

from qkv.config import PAD
from qkv.masks import causal_mask, combine, padding_mask
from qkv.nn.attention import attention_reference
from qkv.nn.positional import SinusoidalPositionalEncoding

FRAGMENT = Path(__file__).with_name("panels.html")
# the result files the repository ships; qkv bench writes OUT/complexity.json, OUT/long-range.json
RESULTS_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "results"

D_K = (1, 1024)
N_KEYS = (2, 32)
SEED = (0, 2**31 - 1)
LENGTH = (1, 200)
D_MODEL = (2, 512)
MAX_SENTENCES = 3
MAX_TOKENS = 32  # per sentence
MAX_TEXT = 600  # characters
SWEEP_D_K = (4, 16, 64, 256, 1024)
SWEEP_QUERIES = 64
MEASURE_D = (8, 128)
MEASURE_N_MAX = (16, 256)
MEASURE_LAYERS = ("attention-core", "self-attention", "lstm", "conv")


class PanelError(ValueError):
    """A parameter out of its range; the message starts with the field's name."""


def bounded(name: str, value: int, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise PanelError(f"{name}: must be a whole number from {lo} to {hi}, got {value!r}")
    return value


# --- 1. scaled dot-product attention -------------------------------------------------------------------

def attention_weights(q: torch.Tensor, k: torch.Tensor, scaled: bool = True) -> torch.Tensor:
    """The weights of eq. 1 for queries ``q (Q, d_k)`` over keys ``k (n, d_k)``, ``(Q, n)``, from
    :func:`attention_reference`; ``scaled=False`` leaves out the 1/√d_k (the query is multiplied by
    √d_k, which the function's own division undoes)."""
    d_k, n = q.size(-1), k.size(0)
    if not scaled:
        q = q * math.sqrt(d_k)
    values = torch.eye(n, dtype=k.dtype)  # (n, n): the output is the weights themselves
    _, weights = attention_reference(q[None, None], k[None, None], values[None, None])  # (1, 1, Q, n)
    return weights[0, 0]


def softmax_jacobian_norms(scores: torch.Tensor) -> torch.Tensor:
    """‖∂ softmax(s) / ∂ s‖ (Frobenius) for each row of logits ``scores (Q, n)``, by autograd through
    :func:`attention_reference`: a query whose keys are √n·I has the logits s itself."""
    n = scores.size(-1)
    keys = math.sqrt(n) * torch.eye(n, dtype=scores.dtype)  # q·kᵀ/√n = s
    values = torch.eye(n, dtype=scores.dtype)

    def weights(s: torch.Tensor) -> torch.Tensor:
        return attention_reference(s[None, None], keys[None, None], values[None, None])[1][0, 0]  # (Q, n)

    jac = torch.autograd.functional.jacobian(weights, scores, vectorize=True)  # (Q, n, Q, n)
    rows = torch.arange(scores.size(0))
    return jac[rows, :, rows, :].flatten(1).norm(dim=-1)  # (Q,): each row's own n×n block


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row of ``p``; 0·log 0 = 0."""
    return -(p * p.clamp_min(1e-300).log()).sum(-1)


def _sample(d_k: int, n_keys: int, seed: int, queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(queries, d_k, generator=g, dtype=torch.float64)  # (Q, d_k)
    k = torch.randn(n_keys, d_k, generator=g, dtype=torch.float64)  # (n, d_k)
    return q, k


def _stats(q: torch.Tensor, k: torch.Tensor, scaled: bool) -> dict:
    d_k = q.size(-1)
    scores = q @ k.T / (math.sqrt(d_k) if scaled else 1.0)  # (Q, n): the logits of the softmax
    w = attention_weights(q, k, scaled)
    return {"scores": scores, "weights": w, "entropy": entropy(w), "max_weight": w.max(-1).values,
            "grad_norm": softmax_jacobian_norms(scores)}


def attention_panel(d_k: int = 64, n_keys: int = 10, seed: int = 0) -> dict:
    """One query and ``n_keys`` keys, q, k ~ N(0, 1) of dimension d_k (seeded), attended with and
    without 1/√d_k: the weights, their entropy (nats; uniform = ln n), the largest weight, and the
    norm of the softmax's Jacobian ∂weights/∂logits. ``sweep``: the same, the median of 64 queries,
    at d_k = 4 ... 1024 (the chosen d_k is one of the curves' points only when it is one of those)."""
    bounded("d_k", d_k, *D_K)
    bounded("n_keys", n_keys, *N_KEYS)
    bounded("seed", seed, *SEED)
    q, k = _sample(d_k, n_keys, seed, 1)
    out = {"d_k": d_k, "n_keys": n_keys, "seed": seed, "uniform_entropy": math.log(n_keys)}
    for name, scaled in (("scaled", True), ("unscaled", False)):
        s = _stats(q, k, scaled)
        out[name] = {"scores": s["scores"][0].tolist(), "weights": s["weights"][0].tolist(),
                     "score_std": s["scores"][0].std().item(), "entropy": s["entropy"][0].item(),
                     "max_weight": s["max_weight"][0].item(), "grad_norm": s["grad_norm"][0].item()}
    out["sweep"] = attention_sweep(n_keys, seed)
    return out


@functools.lru_cache(maxsize=32)
def attention_sweep(n_keys: int = 10, seed: int = 0) -> tuple[dict, ...]:
    """The median entropy, largest weight and Jacobian norm over 64 random queries at each d_k of
    SWEEP_D_K (the median: a few queries whose two largest logits happen to be close keep a
    gradient at any d_k)."""
    rows = []
    for d_k in SWEEP_D_K:
        q, k = _sample(d_k, n_keys, seed, SWEEP_QUERIES)
        row = {"d_k": d_k}
        for name, scaled in (("scaled", True), ("unscaled", False)):
            s = _stats(q, k, scaled)
            row[name] = {key: s[key].median().item() for key in ("entropy", "max_weight", "grad_norm")}
        rows.append(row)
    return tuple(rows)


# --- 2. positional encoding ----------------------------------------------------------------------------

def positions_panel(length: int = 64, d_model: int = 64) -> dict:
    """PE of positions 0..length-1 (:class:`SinusoidalPositionalEncoding`), ``(length, d_model)``,
    and the dot products PE(i)·PE(j) ``(length, length)``. Each is Σ_i cos((i - j)·ω_i): it depends
    on the offset i - j only; ``by_offset[k]`` is PE(0)·PE(k) and ``offset_spread`` the largest
    difference between PE(i)·PE(i+k) over i at any offset k (float32 rounding)."""
    bounded("length", length, *LENGTH)
    bounded("d_model", d_model, *D_MODEL)
    if d_model % 2:
        raise PanelError(f"d_model: must be even (sin and cos pairs), got {d_model}")
    pe = SinusoidalPositionalEncoding(d_model, max_positions=length)(length)[0]  # (T, d_model)
    dots = pe @ pe.T  # (T, T)
    spread = max((dots.diagonal(k).max() - dots.diagonal(k).min()).item() for k in range(length))
    return {"length": length, "d_model": d_model, "encoding": _rounded(pe), "dots": _rounded(dots),
            "by_offset": dots[0].tolist(), "offset_spread": spread}


def _rounded(t: torch.Tensor, digits: int = 4) -> list:
    return [[round(x, digits) for x in row] for row in t.tolist()]


# --- 3. masks ------------------------------------------------------------------------------------------

def tokenize(text: str) -> list[list[str]]:
    """One sentence per non-empty line, split at whitespace (1 to 3 sentences of up to 32 words)."""
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise PanelError(f"text: must be at most {MAX_TEXT} characters, got {len(text)}")
    sentences = [line.split() for line in text.splitlines() if line.strip()]
    if not 1 <= len(sentences) <= MAX_SENTENCES:
        raise PanelError(f"text: give 1 to {MAX_SENTENCES} sentences, one per line, got {len(sentences)}")
    for i, words in enumerate(sentences, 1):
        if len(words) > MAX_TOKENS:
            raise PanelError(f"text: sentence {i} has {len(words)} words, more than {MAX_TOKENS}")
    return sentences


def masks_panel(text: str = "the cat sat\na dog\nthe bird sang all day") -> dict:
    """The typed sentences as a right-padded batch ``(B, T)`` of token ids (PAD = 0), and the masks
    qkv builds for it (True = may attend): the padding mask ``(B, T)`` (:func:`padding_mask`, the
    same for every query), the causal mask ``(T, T)`` (:func:`causal_mask`) and the decoder
    self-attention mask, both combined ``(B, T, T)`` (:func:`combine`). With padding on the right,
    the causal mask alone already hides the padding from every real token (qkv's decoder passes
    it alone); the two differ only in the rows of the padding's own queries, whose outputs the loss
    ignores (``differs_from_causal``: those rows of each sentence)."""
    sentences = tokenize(text)
    t = max(len(s) for s in sentences)
    vocab: dict[str, int] = {}
    ids = torch.full((len(sentences), t), PAD, dtype=torch.long)  # (B, T)
    for b, words in enumerate(sentences):
        for i, w in enumerate(words):
            ids[b, i] = vocab.setdefault(w, 4 + len(vocab))  # ids after pad, unk, bos, eos
    padding = padding_mask(ids)  # (B, 1, 1, T)
    causal = causal_mask(t)  # (1, 1, T, T)
    both = combine(causal, padding)  # (B, 1, T, T)
    return {"tokens": [words + ["<pad>"] * (t - len(words)) for words in sentences], "ids": ids.tolist(),
            "padding": padding[:, 0, 0].tolist(), "causal": causal[0, 0].tolist(), "decoder": both[:, 0].tolist(),
            "differs_from_causal": [(grid != causal[0, 0]).any(-1).nonzero()[:, 0].tolist() for grid in both[:, 0]]}


# --- 4. cost: Table 1 and the long-range task, measured ------------------------------------------------

def _stamp(path: Path, data: dict) -> str:
    """When a result was measured: its recorded start, else the date in its name, else the file's time."""
    started = (data.get("machine") or {}).get("started")
    if started:
        return started
    m = re.search(r"(\d{4}-\d{2}-\d{2})T(\d{2})(\d{2})Z", path.name)
    if m:
        return f"{m[1]}T{m[2]}:{m[3]}:00+00:00"
    import datetime

    return datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc).isoformat(timespec="seconds")


def result_files(pattern: str, results_dir: Path | None = None) -> list[dict]:
    """The result files ``results_dir/pattern``, oldest first: name, when, data (unreadable ones skipped)."""
    folder = Path(results_dir) if results_dir is not None else RESULTS_DIR
    found = []
    for path in folder.glob(pattern) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            found.append({"name": path.name, "when": _stamp(path, data), "data": data})
    return sorted(found, key=lambda f: f["when"])


def _choose(files: list[dict], file: str | None, covers) -> dict | None:
    """``file`` by name, else the most complete (``covers``: its number of measured points), the
    newest of those: a partial rerun (one model, a few distances) does not hide the full run."""
    if file is not None:
        for f in files:
            if f["name"] == file:
                return f
        raise PanelError(f"file: no result file {file!r}; there are: {', '.join(f['name'] for f in files) or 'none'}")
    if not files:
        return None
    most = max(covers(f["data"]) for f in files)
    return [f for f in files if covers(f["data"]) == most][-1]


def table1(n: int = 512, r: int = 64, k: int = 3) -> list[dict]:
    """Table 1's rows (:data:`qkv.complexity.LAYERS`) with the exact maximum path length at n
    (:func:`qkv.complexity.expected_path_length`)."""
    from qkv.complexity import LAYERS, expected_path_length

    return [{"layer": t.name, "description": t.description, "complexity": t.complexity, "sequential": t.sequential,
             "path": t.path, "exponents": dict(zip(("flops", "sequential_steps", "path_length"), t.exponents)),
             "path_at_n": expected_path_length(t.name, n, r, k)} for t in LAYERS.values()]


def _layers_part(result: dict) -> dict:
    from qkv.complexity import summarize

    summary = result.get("summary") or summarize(result)
    return {"settings": result["settings"], "layers": result["layers"], "exponents": summary["exponents"],
            "crossovers": summary["crossovers"], "fit_from": summary["fit_from"]}


def cost_panel(results_dir: Path | None = None, layers_file: str | None = None,
               long_range_file: str | None = None) -> dict:
    """Table 1 (the exact path lengths at the measured largest n), the most complete ``qkv bench
    layers`` and ``qkv bench long-range`` results (the newest of equals; or the files named), each
    None with a note where there are none."""
    layer_files = result_files("complexity*.json", results_dir)
    range_files = result_files("long-range*.json", results_dir)
    chosen = _choose(layer_files, layers_file, lambda d: sum(len(p) for p in d.get("layers", {}).values()))
    ranged = _choose(range_files, long_range_file, lambda d: len(d.get("runs", [])))
    s = chosen["data"]["settings"] if chosen else {"ns": [512], "r": 64, "k": 3}
    out = {"table1": table1(s["ns"][-1], s["r"], s["k"]), "table1_n": s["ns"][-1],
           "files": {"layers": [f["name"] for f in layer_files], "long_range": [f["name"] for f in range_files]},
           "layers": None, "long_range": None}
    if chosen:
        out["layers"] = {"file": chosen["name"], "when": chosen["when"], **_layers_part(chosen["data"])}
    else:
        out["layers_note"] = "no results yet: run `qkv bench layers`"
    if ranged:
        d = ranged["data"]
        out["long_range"] = {"file": ranged["name"], "when": ranged["when"], "settings": d["settings"],
                             "chance": 1 / d["settings"]["symbols"],
                             "accuracy": {m: [[r["t"], r["accuracy"]] for r in d["runs"] if r["model"] == m]
                                          for m in d["settings"]["models"]}}
    else:
        out["long_range_note"] = "no results yet: run `qkv bench long-range`"
    return out


_measuring = threading.Lock()


def measure_panel(d: int = 64, n_max: int = 128, layers: str = ",".join(MEASURE_LAYERS)) -> dict:
    """A short ``qkv bench layers`` sweep (:func:`qkv.complexity.measure_layers`) at n = 16 ... n_max,
    8 heads, r = 8, k = 3, one timed repeat: seconds, not minutes. One at a time."""
    from qkv.complexity import LAYERS, measure_layers, powers_of_two

    bounded("d", d, *MEASURE_D)
    bounded("n_max", n_max, *MEASURE_N_MAX)
    if d % 8:
        raise PanelError(f"d: must be a multiple of the 8 heads, got {d}")
    kinds = [x.strip() for x in layers.split(",") if x.strip()]
    unknown = [x for x in kinds if x not in LAYERS]
    if not kinds or unknown or len(kinds) > len(MEASURE_LAYERS):
        raise PanelError(f"layers: give 1 to {len(MEASURE_LAYERS)} of {', '.join(LAYERS)}"
                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    if not _measuring.acquire(blocking=False):
        raise Busy("a measurement is running already; try again when it is done")
    try:
        result = measure_layers(d, powers_of_two(16, n_max), r=8, k=3, n_heads=8, repeats=1, kinds=kinds)
    finally:
        _measuring.release()
    return {"table1": table1(n_max, 8, 3), "layers": _layers_part(result), "seconds": result["seconds"]}


class Busy(RuntimeError):
    """Another measurement holds the CPU."""


# --- 5. the learning-rate schedule (section 5.3) -------------------------------------------------------

SCHEDULE_D_MODEL = (8, 4096)
SCHEDULE_WARMUP = (1, 100_000)
SCHEDULE_STEPS = (10, 1_000_000)
SCHEDULE_CURVES = 4  # values per list
SCHEDULE_POINTS = 300


def _numbers(name: str, text: str, lo: int, hi: int) -> list[int]:
    """``"512, 256"`` -> [512, 256]: 1 to SCHEDULE_CURVES whole numbers in [lo, hi]."""
    parts = [x.strip() for x in str(text).split(",") if x.strip()]
    if not 1 <= len(parts) <= SCHEDULE_CURVES:
        raise PanelError(f"{name}: give 1 to {SCHEDULE_CURVES} whole numbers separated by commas, got {text!r}")
    out = []
    for x in parts:
        if not re.fullmatch(r"\d+", x):
            raise PanelError(f"{name}: {x!r} is not a whole number")
        out.append(bounded(name, int(x), lo, hi))
    return list(dict.fromkeys(out))


def source_of(fn) -> dict:
    """A function's source as qkv has it: its text, file (relative to the package) and first line."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    path = Path(inspect.getsourcefile(fn)).resolve()
    package = Path(__file__).resolve().parents[1]  # src/qkv
    return {"name": f"{fn.__module__}.{fn.__qualname__}", "file": str(Path("qkv") / path.relative_to(package)),
            "line": first, "code": "".join(lines)}


def schedule_panel(d_model: str = "512,256", warmup: str = "4000,1000", steps: int = 20000) -> dict:
    """The paper's learning rate, lrate = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), for every
    pair of the given d_model and warmup values (:func:`qkv.training.schedule.noam`, through
    :func:`qkv.viz.schedule_data`), at up to 300 steps from 1 to ``steps`` (each warmup among them),
    with each curve's peak (step = warmup, rate (d_model · warmup)^-0.5) and noam's source."""
    from qkv.training.schedule import noam
    from qkv.viz import schedule_data

    ds = _numbers("d_model", d_model, *SCHEDULE_D_MODEL)
    ws = _numbers("warmup", warmup, *SCHEDULE_WARMUP)
    bounded("steps", steps, *SCHEDULE_STEPS)
    curves = []
    for d in ds:
        for w in ws:
            c = schedule_data(d, w, steps, max_points=SCHEDULE_POINTS)
            curves.append({"d_model": d, "warmup": w, "steps": c["steps"], "lr": c["lr"],
                           "peak_step": c["peak_step"], "peak_lr": c["peak_lr"]})
    return {"d_model": ds, "warmup": ws, "steps": steps, "curves": curves, "source": source_of(noam)}


# --- 6. label smoothing (section 5.4) -------------------------------------------------------------------

SMOOTH_VOCAB = (2, 64)
SMOOTH_EPSILON = (0.0, 0.5)
SMOOTH_CURVE = 99  # points of the loss against p(gold)


def smoothed_target(epsilon: float, vocab: int, gold: int) -> torch.Tensor:
    """The target distribution qkv's loss trains towards, read off the loss itself: for logits z,
    ∂loss/∂z = softmax(z) − q (cross-entropy against q), so q = softmax(z) − ∂loss/∂z at any z
    (:func:`qkv.losses.label_smoothed_nll_loss`, autograd; here z = 0)."""
    from qkv.losses import label_smoothed_nll_loss

    z = torch.zeros(1, vocab, dtype=torch.float64, requires_grad=True)
    loss, _ = label_smoothed_nll_loss(z, torch.tensor([gold]), epsilon, ignore_index=-1)
    (grad,) = torch.autograd.grad(loss, [z])
    return (z.softmax(-1) - grad)[0].detach()


def smoothing_panel(epsilon: float = 0.1, vocab: int = 10, gold: int = 3) -> dict:
    """Label smoothing's target q over a vocabulary of ``vocab`` tokens with the gold one ``gold``
    (:func:`smoothed_target`: qkv puts 1 − ε + ε/V on gold and ε/V on each other token), and the
    loss of a prediction p that gives p(gold) = x and (1 − x)/(V − 1) to each other token, with and
    without smoothing, for x in (0, 1): without, it falls towards 0 as x → 1; with ε > 0 it is
    smallest at x = q(gold) and grows again — a model is pushed not to be certain."""
    from qkv.losses import label_smoothed_nll_loss

    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or \
            not SMOOTH_EPSILON[0] <= epsilon <= SMOOTH_EPSILON[1]:
        raise PanelError(f"epsilon: must be a number from {SMOOTH_EPSILON[0]} to {SMOOTH_EPSILON[1]}, got {epsilon!r}")
    bounded("vocab", vocab, *SMOOTH_VOCAB)
    bounded("gold", gold, 0, vocab - 1)
    q = smoothed_target(float(epsilon), vocab, gold)
    xs = [(i + 1) / (SMOOTH_CURVE + 1) for i in range(SMOOTH_CURVE)]
    p = torch.tensor([[(1 - x) / (vocab - 1)] * vocab for x in xs], dtype=torch.float64)
    p[:, gold] = torch.tensor(xs, dtype=torch.float64)
    target = torch.full((len(xs),), gold)
    curves = {}
    for name, eps in (("smoothed", float(epsilon)), ("plain", 0.0)):
        curves[name] = [label_smoothed_nll_loss(row.log()[None], t[None], eps, ignore_index=-1)[0].item()
                        for row, t in zip(p, target)]
    return {"epsilon": float(epsilon), "vocab": vocab, "gold": gold, "target": q.tolist(),
            "p_gold": xs, "loss": curves, "best_p_gold": xs[min(range(len(xs)), key=curves["smoothed"].__getitem__)],
            "source": source_of(label_smoothed_nll_loss)}


# --- the routes ----------------------------------------------------------------------------------------

def fragment() -> str:
    """The panels' HTML fragment, for the lab page to inline, with the charts' script (``plot.js``, which
    defines ``window.QkvPlot`` once however often it is inlined) before it."""
    plot = (FRAGMENT.parent / "plot.js").read_text(encoding="utf-8")
    return f"<script>\n{plot}</script>\n" + FRAGMENT.read_text(encoding="utf-8")


def register(app, results_dir: Path | None = None) -> None:
    """Add ``GET /api/panels/...`` to the FastAPI ``app``. A bad parameter gets 422 with
    ``{"detail": "FIELD: why"}``; a measurement while another runs, 409."""
    from fastapi import APIRouter, HTTPException
    from fastapi.exceptions import RequestValidationError
    from fastapi.routing import APIRoute

    class PanelRoute(APIRoute):
        """Turns FastAPI's own refusals (a value that is not a number) into one line naming the field."""

        def get_route_handler(self):
            handler = super().get_route_handler()

            async def handle(request):
                try:
                    return await handler(request)
                except RequestValidationError as e:
                    raise HTTPException(422, "; ".join(f"{x['loc'][-1]}: {x['msg']}" for x in e.errors())) from None
            return handle

    router = APIRouter(prefix="/api/panels", route_class=PanelRoute, tags=["panels"])

    def answer(fn, *args, **kwargs) -> dict:
        try:
            return fn(*args, **kwargs)
        except PanelError as e:
            raise HTTPException(422, str(e)) from None
        except Busy as e:
            raise HTTPException(409, str(e)) from None

    @router.get("/attention", summary="eq. 1 with and without 1/√d_k: weights, entropy, gradient")
    def attention(d_k: int = 64, n_keys: int = 10, seed: int = 0):
        return answer(attention_panel, d_k, n_keys, seed)

    @router.get("/positions", summary="the sinusoidal positional encoding and its dot products")
    def positions(length: int = 64, d_model: int = 64):
        return answer(positions_panel, length, d_model)

    @router.get("/masks", summary="padding, causal and decoder self-attention masks of typed sentences")
    def masks(text: str = "the cat sat\na dog\nthe bird sang all day"):
        return answer(masks_panel, text)

    @router.get("/cost", summary="Table 1 and the long-range task, from the benchmark results")
    def cost(layers_file: str | None = None, long_range_file: str | None = None):
        return answer(cost_panel, results_dir, layers_file, long_range_file)

    @router.get("/cost/measure", summary="a short qkv bench layers measurement (seconds)")
    def measure(d: int = 64, n_max: int = 128, layers: str = ",".join(MEASURE_LAYERS)):
        return answer(measure_panel, d, n_max, layers)

    @router.get("/schedule", summary="the paper's learning rate for several d_model and warmup values")
    def schedule(d_model: str = "512,256", warmup: str = "4000,1000", steps: int = 20000):
        return answer(schedule_panel, d_model, warmup, steps)

    @router.get("/smoothing", summary="label smoothing's target distribution and the loss it gives")
    def smoothing(epsilon: float = 0.1, vocab: int = 10, gold: int = 3):
        return answer(smoothing_panel, epsilon, vocab, gold)

    app.include_router(router)
