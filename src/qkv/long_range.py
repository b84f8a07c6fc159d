"""Long-range dependency, measured: how far back can each model learn to look? (section 4)

"Learning long-range dependencies is a key challenge in many sequence transduction tasks. One key
factor affecting the ability to learn such dependencies is the length of the paths forward and
backward signals have to traverse in the network." — section 4. The classic argument for it
(Hochreiter 1991; Bengio et al. 1994; Hochreiter et al. 2001): through a recurrence the gradient
that reaches position T - t is a product of t Jacobians,

    ∂loss/∂x_{T-t} = ∂loss/∂h_T · (Π_{s=T-t+1..T} ∂h_s/∂h_{s-1}) · ∂h_{T-t}/∂x_{T-t},

which shrinks (or explodes) geometrically in t for a vanilla RNN, h_s = tanh(W x_s + U h_{s-1});
the LSTM's additive cell c_s = f_s ⊙ c_{s-1} + i_s ⊙ g_s lets it pass through when the forget
gates f_s stay near 1; self-attention connects x_{T-t} to the output in one step, whatever t.

The task (:func:`make_batch`): a sequence of T = t + ``PREFIX`` + 1 random symbols out of K; the
label is the symbol at position T - t (1-based), i.e. t positions before the last one; every other
symbol is a distractor. Chance accuracy is 1/K. Each model reads the whole sequence and classifies
at the last position: the RNN and LSTM (:class:`qkv.nn.recurrent.Recurrent`) from their last
hidden state, the Transformer encoder (the library's stack, :mod:`qkv.nn.stack`: sinusoidal
positions, pre-norm layers) from its output at the last position, which reaches x_{T-t} through
attention.

Measured for each t (:func:`run_long_range`): held-out accuracy after a fixed budget of training
steps, and :func:`input_gradient_norms`, the norm ‖∂loss/∂x_{T-t}‖ of the gradient of the loss
with respect to the input embedding at the deciding position (averaged over sequences, computed
in float64 so that tiny values do not underflow), at initialisation and after training.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qkv.complexity import new_figure, run_metadata
from qkv.config import ModelConfig
from qkv.data.synthetic import PREFIX, make_batch, sequence_length  # noqa: F401 (the task, here since it began)
from qkv.nn.embedding import ScaledEmbedding
from qkv.nn.layers import EncoderLayer
from qkv.nn.recurrent import Recurrent
from qkv.nn.stack import TransformerStack, stack_modules

MODELS = ("rnn", "lstm", "transformer")
DEFAULT_DISTANCES = (2, 5, 10, 20, 50, 100, 200, 500, 1000)


class RecurrentClassifier(nn.Module):
    """Embedding -> one recurrent layer (:class:`qkv.nn.recurrent.Recurrent`: ``nn.RNN`` with tanh,
    or ``nn.LSTM``) -> linear read-out of the last hidden state."""

    def __init__(self, cell: str, symbols: int, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(symbols, hidden)
        self.rnn = Recurrent(cell, hidden, hidden)
        self.out = nn.Linear(hidden, symbols)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens)  # (B, T, H): the x_t of the gradient probe

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(x)  # (B, T, H)
        return self.out(h[:, -1])  # (B, K)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classify(self.embed(tokens))


class TransformerClassifier(nn.Module):
    """The library's Transformer encoder (:class:`~qkv.nn.stack.TransformerStack`: embedding·√d_model,
    sinusoidal positions, N pre-norm :class:`~qkv.nn.layers.EncoderLayer`, final LayerNorm; no
    dropout) -> linear read-out at the last position. Every id 0..K-1 is a symbol (no PAD).

    Only the last position's output is read, so the top layer is evaluated for that one query
    (:func:`last_position`): the same numbers as running the full layer and taking its last row, at
    O(T·d) instead of O(T²·d) cost. With the default single layer a whole step is O(T).
    """

    def __init__(self, symbols: int, d_model: int, n_heads: int = 4, n_layers: int = 1):
        super().__init__()
        cfg = ModelConfig(d_model=d_model, n_heads=n_heads, d_ff=2 * d_model, n_encoder_layers=n_layers,
                          positional="sinusoidal", dropout=0.0, attention_dropout=0.0, norm_first=True)
        self.embedding = ScaledEmbedding(symbols, d_model, pad_id=None)
        self.pos, self.layers, self.norm = stack_modules(cfg, n_layers, EncoderLayer)
        self.out = nn.Linear(d_model, symbols)

    @property
    def encoder(self) -> TransformerStack:
        return TransformerStack(self.embedding, self.pos, self.layers, self.norm, dropout=0.0)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The stack's input, embedding + PE ``(B, T, d)``: the x_t of the gradient probe (the PE
        is a constant, so the gradient is the embedding's)."""
        return self.encoder.inputs(tokens)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x, _, _ = layer(x)
        return self.out(self.norm(last_position(self.layers[-1], x)[:, 0]))  # (B, K)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classify(self.embed(tokens))


def last_position(layer: EncoderLayer, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)[:, -1:]`` computed for the last query alone, ``(B, T, d) -> (B, 1, d)``: one
    incremental step of the layer, the last position attending to the keys/values of the
    positions before it (:meth:`~qkv.nn.layers.EncoderLayer.keys_values`) and to its own."""
    out, _, _ = layer(x[:, -1:], cache=layer.keys_values(x[:, :-1]))
    return out


def build_model(name: str, symbols: int, hidden: int) -> nn.Module:
    if name in ("rnn", "lstm"):
        return RecurrentClassifier(name, symbols, hidden)
    if name == "transformer":
        return TransformerClassifier(symbols, hidden)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def input_gradient_norms(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """‖∂loss/∂x_j‖ for every position j, ``(T,)``: the gradient of each sequence's own
    cross-entropy with respect to its input embeddings x_j, its norm over the embedding dimension,
    averaged over the sequences. Computed on a float64 copy of the model (the RNN's gradient at
    t = 1000 is far below float32's range)."""
    probe = copy.deepcopy(model).double().eval()
    x = probe.embed(tokens).detach().requires_grad_()  # (B, T, d)
    loss = F.cross_entropy(probe.classify(x), labels, reduction="sum")  # sum: per-sequence gradients
    loss.backward()
    return x.grad.norm(dim=-1).mean(dim=0)  # (T,)


def accuracy(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, batch: int = 250) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(tokens), batch):
            correct += (model(tokens[i : i + batch]).argmax(-1) == labels[i : i + batch]).sum().item()
    model.train()
    return correct / len(tokens)


@dataclass
class Run:
    """One model trained at one distance t."""

    model: str
    t: int
    steps: int
    accuracy: float
    final_loss: float
    grad_norm_init: float  # ‖∂loss/∂x_{T-t}‖ at initialisation
    grad_norm_trained: float  # ... after training
    grad_norm_last_init: float  # ‖∂loss/∂x_T‖ (the last position), for scale
    grad_norm_last_trained: float
    seconds: float


def train_one(name: str, t: int, steps: int = 300, hidden: int = 64, symbols: int = 8, batch: int = 32,
              lr: float = 3e-3, seed: int = 0, n_eval: int = 1000, n_probe: int = 200) -> Run:
    """Train model ``name`` on distance t for ``steps`` Adam steps (gradient norm clipped at 1);
    held-out accuracy on ``n_eval`` fresh sequences; the gradient probe on ``n_probe`` of them."""
    torch.manual_seed(seed)
    model = build_model(name, symbols, hidden)
    train_gen = torch.Generator().manual_seed(seed)
    test_gen = torch.Generator().manual_seed(10_000 + seed)
    eval_tokens, eval_labels = make_batch(n_eval, t, symbols, test_gen)
    probe_tokens, probe_labels = eval_tokens[:n_probe], eval_labels[:n_probe]
    where = sequence_length(t) - 1 - t  # index of the deciding symbol
    g0 = input_gradient_norms(model, probe_tokens, probe_labels)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    t0 = time.perf_counter()
    losses = []
    for _ in range(steps):
        tokens, labels = make_batch(batch, t, symbols, train_gen)
        loss = F.cross_entropy(model(tokens), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    g1 = input_gradient_norms(model, probe_tokens, probe_labels)
    final = sum(losses[-20:]) / len(losses[-20:]) if losses else float("nan")
    return Run(name, t, steps, accuracy(model, eval_tokens, eval_labels), final, g0[where].item(), g1[where].item(),
               g0[-1].item(), g1[-1].item(), seconds)


def run_long_range(distances=DEFAULT_DISTANCES, models=MODELS, steps: int = 300, hidden: int = 64,
                   symbols: int = 8, batch: int = 32, lr: float = 3e-3, seed: int = 0,
                   log: Callable[[str], None] = lambda s: None) -> dict:
    """Every model at every distance; a JSON-able dict."""
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    if steps < 1 or hidden < 4 or hidden % 4:
        raise ValueError(f"need steps >= 1 and a hidden size that is a multiple of 4 (got {steps}, {hidden})")
    runs = []
    meta = run_metadata()
    t_start = time.perf_counter()
    for t in distances:
        for m in models:
            run = train_one(m, t, steps, hidden, symbols, batch, lr, seed)
            runs.append(asdict(run))
            log(f"[{time.perf_counter() - t_start:7.1f}s] t={t:<5} {m:<12} accuracy {run.accuracy:.3f}  "
                f"loss {run.final_loss:.3f}  ‖∂loss/∂x_(T-t)‖ init {run.grad_norm_init:.2e} "
                f"trained {run.grad_norm_trained:.2e}  ({run.seconds:.1f}s)")
    return {"settings": {"distances": list(distances), "models": list(models), "steps": steps, "hidden": hidden,
                         "symbols": symbols, "batch": batch, "lr": lr, "seed": seed, "prefix": PREFIX,
                         "threads": torch.get_num_threads(), "torch": torch.__version__},
            "machine": meta, "runs": runs, "seconds": time.perf_counter() - t_start}


def _norm(v: float) -> str:
    return "0 (< 1e-308: underflow)" if v == 0 else f"{v:.1e}"


def format_report(result: dict) -> str:
    s = result["settings"]
    models = s["models"]
    lines = [f"Accuracy on 1,000 held-out sequences after {s['steps']} steps (batch {s['batch']}, Adam {s['lr']}, "
             f"hidden {s['hidden']}, K = {s['symbols']} symbols: chance {1 / s['symbols']:.3f})", "",
             "| t | T | " + " | ".join(f"{m} accuracy" for m in models) + " |",
             "| ---: | ---: | " + " | ".join("---:" for _ in models) + " |"]
    by = {(r["model"], r["t"]): r for r in result["runs"]}
    for t in s["distances"]:
        lines.append(f"| {t} | {t + s['prefix'] + 1} | " + " | ".join(f"{by[(m, t)]['accuracy']:.3f}" for m in models) + " |")
    lines += ["", "‖∂loss/∂x_(T-t)‖, the gradient at the deciding position (float64, mean over 200 held-out "
              "sequences), at initialisation → after training; in brackets its ratio to ‖∂loss/∂x_T‖ at the last "
              "position (scale-free: a trained model's loss, and so every gradient, is small)", "",
              "| t | " + " | ".join(f"{m}: init → trained" for m in models) + " |",
              "| ---: | " + " | ".join("---" for _ in models) + " |"]
    for t in s["distances"]:
        cells = []
        for m in models:
            r = by[(m, t)]
            ratio0 = r["grad_norm_init"] / r["grad_norm_last_init"] if r["grad_norm_last_init"] else float("nan")
            ratio1 = r["grad_norm_trained"] / r["grad_norm_last_trained"] if r["grad_norm_last_trained"] else float("nan")
            cells.append(f"{_norm(r['grad_norm_init'])} ({ratio0:.0e}) → {_norm(r['grad_norm_trained'])} ({ratio1:.0e})")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, accuracy_png: str, gradnorm_png: str) -> list[str]:
    s = result["settings"]
    ts = s["distances"]
    runs = {(r["model"], r["t"]): r for r in result["runs"]}
    fig = new_figure(figsize=(6, 4))
    ax = fig.subplots()
    for m in s["models"]:
        ax.plot(ts, [runs[(m, t)]["accuracy"] for t in ts], marker="o", label=m)
    ax.axhline(1 / s["symbols"], color="grey", ls="--", lw=0.8, label=f"chance (1/{s['symbols']})")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("distance t to the deciding symbol")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"Long-range task, {s['steps']} training steps each")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(accuracy_png, dpi=110)

    fig = new_figure(figsize=(10, 4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, key, title in [(axes[0], "grad_norm_init", "at initialisation"),
                           (axes[1], "grad_norm_trained", f"after {s['steps']} steps")]:
        for m in s["models"]:
            ax.plot(ts, [max(runs[(m, t)][key], 1e-300) for t in ts], marker="o", label=m)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("distance t")
        ax.set_title(f"‖∂loss/∂x_(T−t)‖ {title}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("gradient norm at the deciding position\n(float64; 0 drawn at 1e-300)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(gradnorm_png, dpi=110)
    return [accuracy_png, gradnorm_png]


def bench_long_range(out_dir: str, distances=None, models=MODELS, steps: int = 300, hidden: int = 64,
                     symbols: int = 8, batch: int = 32, lr: float = 3e-3, seed: int = 0, quick: bool = False,
                     log: Callable[[str], None] = lambda s: None) -> tuple[str, list[str]]:
    """The whole of ``qkv bench long-range``: run, write ``long-range.json``, ``long-range.md`` and
    the two plots into ``out_dir``; returns the report text and the files written."""
    from pathlib import Path

    if quick:
        distances, steps = [3, 5], 60
    distances = list(distances or DEFAULT_DISTANCES)
    if any(t < 1 for t in distances):
        raise ValueError(f"distances must be >= 1, got {distances}")
    new_figure()  # matplotlib is there, before minutes of training
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = run_long_range(distances, models, steps, hidden, symbols, batch, lr, seed, log)
    text = format_report(result)
    with open(out / "long-range.json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    (out / "long-range.md").write_text(text + "\n", encoding="utf-8")
    written = [str(out / "long-range.json"), str(out / "long-range.md")]
    written += plot(result, str(out / "long-range-accuracy.png"), str(out / "long-range-gradnorm.png"))
    return text, written
