"""qkv.viz and `qkv viz`: attention maps from the model's own forward pass, the positional
encoding, the schedule, a run's curves; the PNG and HTML files; clear errors.

One tiny model is trained for a few steps (with validation, so the run's metrics file has every
kind of record) once per module; its weights need not be good, only real.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

import qkv
from qkv import viz
from qkv.cli import main
from qkv.config import CLS, PAD, DecodeConfig, ModelConfig, TrainConfig
from qkv.data import toy
from qkv.data.batching import collate
from qkv.errors import QkvError
from qkv.masks import padding_mask
from qkv.models import build_model
from qkv.nn.positional import sinusoidal_table
from qkv.training.schedule import noam
from qkv.training.trainer import ParallelData, train

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SENTENCE = "three hundred twenty-one"
TARGET = "dreihunderteinundzwanzig"

MODEL = ModelConfig(d_model=32, n_heads=2, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                    dropout=0.1, attention_dropout=0.1, max_positions=64)
TRAIN = TrainConfig(tokenizer="char", vocab_size=100, max_len=64, max_tokens=512, warmup_steps=4,
                    max_steps=5, eval_every=5, eval_bleu_samples=2, seed=1)


def numbers(lo: int, hi: int, step: int) -> ParallelData:
    pairs = [(toy.english(n), toy.german(n)) for n in range(lo, hi, step)]
    return ParallelData([s for s, _ in pairs], [t for _, t in pairs], name="numbers")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("viz") / "run"
    torch.set_num_threads(1)
    train(MODEL, TRAIN, DecodeConfig(), numbers(1, 2000, 7), numbers(3, 2000, 400), out, log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def translator(run):
    return qkv.load(run / "best")


@pytest.fixture(scope="module")
def data(translator):
    return viz.attention_data(translator, SENTENCE, TARGET)


def as_tensor(layers) -> list[torch.Tensor]:
    return [torch.tensor(layer) for layer in layers]  # per layer (h, Tq, Tk)


# --- attention ---------------------------------------------------------------------------------------

def test_rows_sum_to_one_and_future_positions_get_zero(data):
    n_src, n_tgt = len(data["tokens"]["source"]), len(data["tokens"]["target"])
    assert data["tokens"]["source"][-1] == "</s>" and data["tokens"]["target"][0] == "<s>"
    shapes = {"encoder": (n_src, n_src), "decoder_self": (n_tgt, n_tgt), "cross": (n_tgt, n_src)}
    for kind, layers in data["weights"].items():
        assert len(layers) == 2
        for w in as_tensor(layers):
            assert w.shape == (MODEL.n_heads, *shapes[kind])
            assert torch.allclose(w.sum(-1), torch.ones(w.shape[:2]), atol=1e-5)
            assert (w >= 0).all()
    for w in as_tensor(data["weights"]["decoder_self"]):  # masked: query i sees keys j <= i only
        future = torch.ones(n_tgt, n_tgt, dtype=torch.bool).triu(1)
        assert (w[:, future] == 0).all() and (w[:, ~future] > 0).all()


def test_padding_keys_get_zero(translator):
    model, tok = translator.model.eval(), translator.tokenizers
    short, long = tok.src.encode(["five", "four hundred five thousand"])
    batch = collate([short, long], tok.tgt.encode(["fünf", "vierhundertfünftausend"]))
    maps = model.attention_maps(batch.src, batch.tgt_in)
    real_src = batch.src != 0  # (B, S)
    for w in [*maps.encoder, *maps.cross]:  # (B, h, Tq, S)
        assert (w.masked_select(~real_src[:, None, None, :].expand_as(w)) == 0).all()
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[:3]), atol=1e-5)
    for w in maps.decoder_self:  # target padding sits after every real position: hidden by the causal mask
        t = w.size(-1)
        assert (w[..., torch.ones(t, t, dtype=torch.bool).triu(1)] == 0).all()
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[:3]), atol=1e-5)


def test_weights_are_the_forward_pass_own_and_nothing_is_stored(translator, data):
    model, tok = translator.model, translator.tokenizers
    batch = collate(tok.src.encode([SENTENCE]), tok.tgt.encode([TARGET]))

    def attributes():
        return {(name, key, tuple(v.shape) if torch.is_tensor(v) else None)
                for name, m in model.named_modules() for key, v in vars(m).items() if not key.startswith("_")} | \
               {(name, tuple(b.shape)) for name, b in model.named_buffers()}

    before = attributes()
    model.train()
    viz.attention_data(translator, SENTENCE, TARGET)
    assert model.training  # put back as it was (dropout was off for the maps: they equal the eval ones below)
    model.eval()
    with torch.inference_mode():
        maps = model.attention_maps(batch.src, batch.tgt_in)
        # the pass that returns weights is the model's forward: the same logits as the fast path
        memory, mask, _ = model.encode(batch.src, need_weights=True)
        logits, _ = model.decode(batch.tgt_in, memory, mask, need_weights=True)
        torch.testing.assert_close(logits, model(batch.src, batch.tgt_in), atol=1e-5, rtol=1e-5)
    for kind, ours in data["weights"].items():
        for mine, theirs in zip(as_tensor(ours), getattr(maps, kind)):
            torch.testing.assert_close(mine, theirs[0], atol=0, rtol=0)
    assert attributes() == before
    for m in model.modules():  # no tensor on any module beyond its parameters and buffers
        assert not [k for k, v in vars(m).items() if torch.is_tensor(v) and not isinstance(v, torch.nn.Parameter)]


def test_greedy_target_when_none_is_given(translator):
    d = viz.attention_data(translator, SENTENCE)
    assert d["target_from"] == "greedy"
    assert d["target"] == translator.translate([SENTENCE], beam_size=1)[0]
    assert len(d["weights"]["cross"][0][0]) == len(d["tokens"]["target"])


def test_attention_png_and_html(data, tmp_path):
    png = viz.write_attention_png(data, tmp_path / "a.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    page = viz.write_attention_html(data, tmp_path / "a.html").read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    assert "http://" not in page and "https://" not in page
    embedded = json.loads(re.search(r'<script type="application/json" id="qkv-attention-data">(.*?)</script>',
                                    page, re.S).group(1))
    assert embedded["tokens"] == data["tokens"] and embedded["target"] == TARGET
    for kind in viz.KINDS:
        torch.testing.assert_close(torch.tensor(embedded["weights"][kind]), torch.tensor(data["weights"][kind]),
                                   atol=1e-5, rtol=0)


def test_html_cannot_be_broken_out_of(tmp_path):
    w = [[[[1.0]]]]
    evil = {"source": "</script><script>alert(1)</script>", "target": "x", "target_from": "given",
            "tokens": {"source": ["</script>"], "target": ["<s>"]},
            "kinds": {k: {"title": t, "queries": q, "keys": kk} for k, (t, q, kk) in viz.KINDS.items()},
            "weights": {"encoder": w, "decoder_self": w, "cross": w}}
    out = viz.write_attention_html(evil, tmp_path / "e.html").read_text(encoding="utf-8")
    assert out.count("</script>") == viz.HTML_TEMPLATE.count("</script>") == 2  # only the page's own
    assert "alert(1)" in out  # still there, as data


# --- positional encoding and schedule ------------------------------------------------------------------

def test_positional_data_is_the_table_and_low_dimensions_change_fastest(tmp_path):
    table = viz.positional_data(60, 32)
    assert torch.equal(table, sinusoidal_table(60, 32))
    change = (table[1:] - table[:-1]).abs().mean(0)  # mean step from one position to the next, per dimension
    pairs = change[0::2] + change[1::2]  # a sin/cos pair shares one wavelength
    assert all(a > b for a, b in zip(pairs[:-1], pairs[1:]))
    assert viz.positional_png(60, 32, tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(QkvError, match="even"):
        viz.positional_data(10, 7)


@pytest.mark.parametrize("steps", [20000, 500_000])
def test_schedule_peaks_at_warmup(steps):
    d = viz.schedule_data(512, 4000, steps)
    peak = max(range(len(d["lr"])), key=d["lr"].__getitem__)
    assert d["steps"][peak] == 4000 == d["peak_step"]
    assert d["lr"][peak] == d["peak_lr"] == pytest.approx(noam(4000, 512, 4000))
    assert d["steps"][0] == 1 and d["steps"][-1] == steps


def test_schedule_png(tmp_path):
    assert viz.schedule_png(512, 4000, 20000, 1.0, tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(QkvError, match=r"\.png"):
        viz.schedule_png(path=tmp_path / "s.jpg")


# --- training curves -----------------------------------------------------------------------------------

def test_training_curves(run, tmp_path):
    d = viz.training_data(run)
    assert {"train_loss", "lr", "valid_loss", "valid_ppl", "valid_exact"} <= set(d["series"])
    assert viz.training_png(run, tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    assert viz.training_data(run / "best")["file"] == d["file"]  # a checkpoint directory also finds it


def test_training_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1, "train_loss": 3.0}\n\n{"step": 2, "train_lo\n', encoding="utf-8")
    with pytest.raises(QkvError, match=re.escape(f"{bad / 'metrics.jsonl'}:3:")):
        viz.training_png(bad, tmp_path / "t.png")
    (bad / "metrics.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(QkvError, match="no metrics records"):
        viz.training_data(bad)
    with pytest.raises(QkvError, match="metrics file not found"):
        viz.training_data(tmp_path)
    assert not (tmp_path / "t.png").exists()


def test_missing_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(QkvError, match=re.escape("pip install 'qkv[viz]'")):
        viz.schedule_png(path=tmp_path / "s.png")


# --- the command ---------------------------------------------------------------------------------------

def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_round_trips(run, tmp_path, capsys):
    rc, out, err = cli(capsys, "viz", "attention", run / "best", "five", "--out", tmp_path / "att")
    assert rc == 0, err
    assert "greedy translation" in out
    assert (tmp_path / "att.png").read_bytes()[:8] == PNG_MAGIC and "qkv-attention-data" in (tmp_path / "att.html").read_text()
    rc, out, err = cli(capsys, "viz", "attention", run / "best", "five", "--target", "fünf",
                       "--out", tmp_path / "given.png")
    assert rc == 0 and "greedy" not in out and (tmp_path / "given.html").exists()
    for argv, name in [(["positional", "--positions", "20", "--dim", "16"], "p.png"),
                       (["schedule", "--d-model", "128", "--warmup", "300", "--steps", "1000"], "s.png"),
                       (["training", run], "t.png")]:
        rc, out, err = cli(capsys, "viz", *argv, "--out", tmp_path / name)
        assert rc == 0, err
        assert f"wrote {tmp_path / name}" in out and (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_cli_errors_and_help(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("not json\n", encoding="utf-8")
    rc, out, err = cli(capsys, "viz", "training", tmp_path, "--out", tmp_path / "t.png")
    assert rc == 2 and "qkv viz: error:" in err and "metrics.jsonl:1:" in err and "Traceback" not in err
    rc, out, err = cli(capsys, "viz", "positional", "--dim", "7", "--out", tmp_path / "p.png")
    assert rc == 2 and "even" in err
    for what in ("attention", "positional", "schedule", "training"):
        with pytest.raises(SystemExit) as e:
            main(["viz", what, "--help"])
        assert e.value.code == 0
        assert "usage: qkv viz " + what in capsys.readouterr().out


# --- encoder-only and decoder-only models; the attention-free ones ---------------------------------------

def tiny_model(task: str, arch: str = "transformer", norm_first: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(task=task, arch=arch, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=2,
                      dropout=0.3, attention_dropout=0.3, src_vocab_size=30, tgt_vocab_size=30, max_positions=32,
                      n_classes=2 if task == "classify" else 0, norm_first=norm_first,
                      pooling="mean" if arch != "transformer" else "cls")
    return build_model(cfg).eval()  # eval: no dropout, as attention_data runs the model


def softmax_qk(attn, x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax(Q Kᵀ / √d_k) by hand from a layer's own projections: ``x (B, T, d)`` the layer's input,
    ``visible (B, 1|h, T, T)`` bool -> ``(B, h, T, T)``."""
    d, h = attn.d_model, attn.n_heads
    w, b = attn.in_proj.weight, attn.in_proj.bias
    q = (x @ w[:d].T + b[:d]).unflatten(-1, (h, d // h)).transpose(1, 2)  # (B, h, T, d_k)
    k = (x @ w[d:2 * d].T + b[d:2 * d]).unflatten(-1, (h, d // h)).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / (d // h) ** 0.5  # (B, h, T, T)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


def module_tensors(model) -> set:
    """Every non-parameter, non-buffer tensor attribute of every module (none is expected)."""
    return {(name, key) for name, m in model.named_modules() for key, v in vars(m).items()
            if torch.is_tensor(v) and not isinstance(v, torch.nn.Parameter)}


@pytest.mark.parametrize("task,norm_first", [("classify", False), ("mlm", False), ("classify", True)])
def test_encoder_only_maps_are_softmax_qk_and_padding_keys_get_zero(task, norm_first):
    model = tiny_model(task, norm_first=norm_first)
    tokens = torch.tensor([[CLS, 7, 8, 9, 10, 11], [CLS, 12, 13, PAD, PAD, PAD]])  # (B, T), row 2 padded
    before = module_tensors(model)
    with torch.no_grad():
        maps = model.attention_maps(tokens)
        assert len(maps) == 2 and maps[0].shape == (2, 2, 6, 6)
        real = (tokens != PAD)[:, None, None, :]  # (B, 1, 1, T): keys that may be seen
        x = model.src_embed(tokens) + model.src_pos(6)  # the input of layer 1 (dropout is off)
        for layer, w in zip(model.encoder_layers, maps):
            torch.testing.assert_close(w, softmax_qk(layer.self_attn, layer.res_attn.before(x), real))
            x, _, _ = layer(x, padding_mask(tokens))  # the fast path (SDPA, no weights) to the next layer
        alone = model.attention_maps(tokens[1:, :3])  # the padded row on its own
    assert module_tensors(model) == before == set()
    for w, w_alone in zip(maps, alone):
        assert torch.allclose(w.sum(-1), torch.ones(2, 2, 6), atol=1e-6) and (w >= 0).all()
        assert (w[1, :, :, 3:] == 0).all() and (w[0] > 0).all()
        torch.testing.assert_close(w[1, :, :3, :3], w_alone[0])


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_only_maps_are_causal_softmax_qk_from_the_forward_pass(norm_first):
    model = tiny_model("lm", norm_first=norm_first)
    tokens = torch.tensor([[7, 8, 9, 10, 11, 12, 13]])  # (1, T)
    t = tokens.size(1)
    with torch.no_grad():
        maps = model.attention_maps(tokens)
        logits, _ = model(tokens, need_weights=True)
        torch.testing.assert_close(logits, model(tokens))  # asking for weights does not change the pass
        causal = torch.ones(t, t, dtype=torch.bool).tril()  # query i sees keys j <= i
        x = model.embed(tokens) + model.pos(t)  # the input of layer 1
        for layer, w in zip(model.layers, maps):
            torch.testing.assert_close(w, softmax_qk(layer.self_attn, layer.res_attn.before(x), causal))
            x, _, _ = layer(x, causal=True)
    assert module_tensors(model) == set()
    for w in maps:  # (1, h, T, T)
        assert torch.allclose(w.sum(-1), torch.ones(1, 2, t), atol=1e-6)
        assert (w[..., ~causal] == 0).all() and (w[..., causal] > 0).all()
        assert torch.allclose(w[..., 0, 0], torch.ones(1, 2))  # the first token sees only itself


def write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny checkpoints of each model type, trained for 2 steps through the CLI (with validation
    for classify, lm and prefix_lm, so that their metrics files hold the task's numbers)."""
    d = tmp_path_factory.mktemp("viz-types")
    words = ["the", "film", "was", "great", "bad", "and", "a", "plot"]
    lines = [" ".join(words[(i * k) % 8] for k in range(1, 5 + i % 3)) for i in range(40)]
    text = write(d / "text.txt", "\n".join(lines) + "\n")
    labelled = write(d / "cls.jsonl", "".join(json.dumps({"text": s, "label": "pos" if "great" in s else "neg"}) + "\n"
                                              for s in lines))
    src = write(d / "src.txt", "\n".join(lines) + "\n")
    tgt = write(d / "tgt.txt", "\n".join(" ".join(reversed(s.split())) for s in lines) + "\n")
    common = ["--preset", "tiny", "--d-model", "16", "--d-ff", "32", "--n-heads", "2", "--tokenizer", "char",
              "--max-len", "48", "--max-tokens", "256", "--max-steps", "2", "--eval-every", "2", "--threads", "1"]
    argv = {
        "classify": ["--task", "classify", "--train", labelled, "--valid", labelled, "--n-encoder-layers", "2"],
        "mlm": ["--task", "mlm", "--train", text, "--n-encoder-layers", "1"],
        "lm": ["--task", "lm", "--train", text, "--valid-fraction", "0.2", "--n-decoder-layers", "2"],
        "prefix_lm": ["--task", "prefix_lm", "--src-train", src, "--tgt-train", tgt, "--src-valid", src,
                      "--tgt-valid", tgt, "--n-decoder-layers", "2", "--eval-bleu-samples", "4"],
        "gru_lm": ["--task", "lm", "--arch", "gru", "--train", text],
        "lstm_classify": ["--task", "classify", "--arch", "lstm", "--pooling", "mean", "--train", labelled],
    }
    out = {}
    for name, flags in argv.items():
        assert main(["train", *flags, *common, "--out", str(d / name)]) == 0, name
        out[name] = d / name
    return out


def check_rows(data, causal: bool):
    for kind, layers in data["weights"].items():
        for w in as_tensor(layers):  # (h, T, T)
            t = w.size(-1)
            assert torch.allclose(w.sum(-1), torch.ones(w.shape[:2]), atol=1e-5) and (w >= 0).all()
            if causal:
                assert (w[:, torch.ones(t, t, dtype=torch.bool).triu(1)] == 0).all()


def test_attention_data_of_each_model_type(runs):
    enc = viz.attention_data(qkv.load(runs["classify"] / "best"), "the film was great")
    assert enc["tokens"]["text"][0] == "<cls>" and list(enc["weights"]) == ["encoder"] and enc["target"] is None
    assert len(enc["weights"]["encoder"]) == 2 and len(enc["weights"]["encoder"][0]) == 2
    check_rows(enc, causal=False)
    mlm = viz.attention_data(qkv.load(runs["mlm"] / "best"), "the film was [MASK]")
    assert mlm["tokens"]["text"][0] == "<cls>" and mlm["tokens"]["text"][-1] == "[MASK]"
    check_rows(mlm, causal=False)
    lm_front = qkv.load(runs["lm"] / "best")
    lm = viz.attention_data(lm_front, "the film\nwas great")
    assert lm["tokens"]["text"] == [lm_front.tokenizer.id_to_piece(i) for i in lm_front.prompt_ids("the film\nwas great")]
    assert "</s>" in lm["tokens"]["text"] and list(lm["weights"]) == ["decoder_self"]
    check_rows(lm, causal=True)
    translator = qkv.load(runs["prefix_lm"] / "best")
    given = viz.attention_data(translator, "the film", "film the")
    seq = given["tokens"]["sequence"]
    assert seq[seq.index("<sep>") - 1] == "</s>" and seq[seq.index("<sep>") + 1] == "<s>" and seq[-1] != "</s>"
    assert given["target_from"] == "given"
    check_rows(given, causal=True)
    greedy_data = viz.attention_data(translator, "the film")
    assert greedy_data["target_from"] == "greedy"
    assert greedy_data["target"] == translator.translate(["the film"], beam_size=1)[0]
    check_rows(greedy_data, causal=True)
    ps = viz.panels(given)
    assert len(ps) == 4 and {(p.layer, p.head) for p in ps} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(p.rows == p.cols == seq and len(p.weights) == len(seq) for p in ps)


def test_cli_draws_each_model_type_and_refuses_attention_free_ones(runs, tmp_path, capsys):
    for name, text in [("classify", "the film"), ("mlm", "a [MASK] plot"), ("lm", "the film"),
                       ("prefix_lm", "the film")]:
        rc, out, err = cli(capsys, "viz", "attention", runs[name] / "best", text, "--out", tmp_path / name)
        assert rc == 0, err
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
        assert "qkv-attention-data" in (tmp_path / f"{name}.html").read_text(encoding="utf-8")
    for name, what in [("gru_lm", "gru language model has no attention"),
                       ("lstm_classify", "lstm classifier has no attention")]:
        rc, out, err = cli(capsys, "viz", "attention", runs[name] / "best", "the film", "--out", tmp_path / name)
        assert rc == 2 and what in err and "Traceback" not in err, err
        assert not list(tmp_path.glob(f"{name}*"))
    rc, out, err = cli(capsys, "viz", "attention", runs["classify"] / "best", "the film", "--target", "x",
                       "--out", tmp_path / "t")
    assert rc == 2 and "--target is for translation models" in err and not list(tmp_path.glob("t.*"))


def test_training_curves_of_each_task(runs, run):
    def labels(record_dir):
        fig = viz.training_figure(viz.training_data(record_dir))
        loss_ax, lr_ax, quality_ax, ppl_ax = fig.axes
        return {line.get_label() for line in quality_ax.lines}, {line.get_label() for line in ppl_ax.lines}

    assert labels(runs["classify"]) == ({"accuracy %", "macro-F1 %"}, {"perplexity"})
    assert labels(runs["lm"]) == (set(), {"perplexity"})
    assert labels(runs["prefix_lm"])[0] >= {"BLEU", "chrF", "exact match %"}
    assert labels(run)[0] >= {"BLEU", "chrF", "exact match %"}


# --- long inputs: a bounded figure, legible labels ------------------------------------------------------

def long_data(n_src: int, n_tgt: int, layers: int = 2, heads: int = 2) -> dict:
    """attention_data's layout for a source of n_src and a target of n_tgt tokens (uniform weights)."""
    tokens = {"source": [f"▁s{i}" for i in range(n_src)], "target": [f"▁t{i}" for i in range(n_tgt)]}
    shape = {"encoder": (n_src, n_src), "decoder_self": (n_tgt, n_tgt), "cross": (n_tgt, n_src)}
    return {"model": "Transformer encoder-decoder", "source": " ".join(tokens["source"]),
            "target": " ".join(tokens["target"]), "target_from": "given", "tokens": tokens,
            "kinds": {k: {"title": t, "queries": q, "keys": kk} for k, (t, q, kk) in viz.KINDS.items()},
            "weights": {k: [[[[1 / nk] * nk] * nq] * heads] * layers for k, (nq, nk) in shape.items()}}


@pytest.mark.parametrize("n, side, step", [(3, 1.0, 1), (20, 4.0, 1), (30, 6.0, 1), (40, 6.0, 1),
                                           (47, 6.0, 2),   # 0.13 in a label / (6 in / 47 tokens) = 1.02
                                           (120, 6.0, 3),  # 0.13 / 0.05 = 2.6
                                           (1000, 6.0, 22)])
def test_axis_layout_rule(n, side, step):
    assert viz.axis_layout(n) == (pytest.approx(side), step)
    assert viz.TICK_FONT >= 7 and viz.PANEL_MAX == 6.0 and viz.LABEL_PITCH == 0.13


def test_a_long_input_keeps_a_bounded_figure_and_legible_labels(tmp_path):
    n_src, n_tgt = 120, 90  # labelled: one in 3 (0.13 / (6/120) = 2.6), one in 2 (0.13 / (6/90) = 1.95)
    data = long_data(n_src, n_tgt)
    png = viz.write_attention_png(data, tmp_path / "long.png")
    fig = viz.attention_figure(data)
    width, height = fig.get_size_inches()
    assert int.from_bytes(png.read_bytes()[16:20], "big") == round(width * 110)  # the PNG's pixel width
    label = 0.15 + 0.07 * len("▁s119")
    assert width == pytest.approx(label + 2 * (6.0 + 0.25) + 0.9)  # two heads of 6-inch panels, not 24
    panels = [ax for ax in fig.axes if ax.get_title().startswith("layer")]
    assert len(panels) == 3 * 2 * 2
    steps = {"source": 3, "target": 2}
    for ax in panels:
        box = ax.get_position()
        assert (box.width * width, box.height * height) == (pytest.approx(6.0), pytest.approx(6.0))
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            if not labels:
                continue
            texts = [t.get_text() for t in labels]
            which = "source" if texts[0].startswith("▁s") else "target"
            assert texts == data["tokens"][which][::steps[which]]
            assert all(t.get_fontsize() == 7 for t in labels)
            n = len(data["tokens"][which])
            assert 6.0 / n * steps[which] >= 0.13  # inches between two labels
    headings = [t.get_text() for t in fig.texts]
    assert any(h.startswith("encoder self-attention") and h.endswith("(labelled: one column in 3, one row in 3)")
               for h in headings)
    assert any(h.startswith("cross-attention") and h.endswith("(labelled: one column in 3, one row in 2)")
               for h in headings)
    caption = fig._suptitle.get_text().splitlines()
    assert len(caption) > 3 and all(len(line) <= width * 72 / (11 * 0.6) for line in caption)  # wrapped


def test_a_short_input_labels_every_token(tmp_path):
    data = long_data(12, 10)
    fig = viz.attention_figure(data)
    enc = [ax for ax in fig.axes if ax.get_title().startswith("layer")][:4]
    assert [t.get_text() for t in enc[2].get_xticklabels()] == data["tokens"]["source"]  # layer 2 (last), head 1
    assert enc[0].get_position().width * fig.get_size_inches()[0] == pytest.approx(12 * 0.2)
    assert not any("labelled" in t.get_text() for t in fig.texts)
