"""Dynamic int8 quantisation: ``qkv.load(path, quantize="int8")``, ``qkv.frontends.quantize_int8`` and
``--int8`` on ``qkv translate`` / ``qkv evaluate``.

A tiny Transformer is trained for a few hundred steps on sequence reversal (so that its
predictions are confident, as a trained translation model's are); its int8 copy must give nearly
the same logits and the same decoded tokens. Its speed and BLEU cost on Multi30k are measured by
benchmarks/means.py (docs/results.md).
"""

from __future__ import annotations

import copy
import random
import types

import pytest
import torch
from torch import nn

import qkv
from qkv.frontends import Int8TiedOutput, quantize_int8
from qkv.frontends.quantize import MIN_INT8_WEIGHTS
from qkv.cli import main
from qkv.config import BOS, EOS, ModelConfig
from qkv.data.batching import collate
from qkv.decoding import beam_search, greedy
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.losses import label_smoothed_nll_loss

V, FIRST = 24, 4  # vocabulary; ids 0-3 are PAD UNK BOS EOS


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reversal_batch(rng: random.Random, n: int):
    src = [[rng.randrange(FIRST, V) for _ in range(rng.randint(2, 8))] for _ in range(n)]
    return collate(src, [list(reversed(s)) for s in src])


@pytest.fixture(scope="module")
def trained():
    """A float model that reverses token sequences, and its int8 copy."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                      attention_dropout=0.0, max_positions=64, src_vocab_size=V, tgt_vocab_size=V)
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = random.Random(0)
    for _ in range(400):
        b = reversal_batch(rng, 32)
        loss, _ = label_smoothed_nll_loss(model(b.src, b.tgt_in), b.tgt_out, 0.0)
        opt.zero_grad()
        (loss / b.n_tgt_tokens).backward()
        opt.step()
    model.eval()
    test = reversal_batch(random.Random(1), 64)
    right = [list(reversed(s[s > EOS].tolist())) for s in test.src]
    assert sum(h == r for h, r in zip(greedy(model, test.src, 12), right)) >= 60  # it learned (63 of 64)
    return types.SimpleNamespace(float=model, int8=quantize_int8(copy.deepcopy(model), min_weights=0), test=test)


def test_which_layers_are_quantised(trained):
    q = trained.int8
    dynamic = [name for name, m in q.named_modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    # per encoder layer: in_proj, out_proj, 2 FFN; per decoder layer: self in/out, cross out, 2 FFN
    assert len(dynamic) == 2 * 4 + 2 * 5 + 1  # + the tied output projection
    assert all(isinstance(layer.cross_attn.in_proj, nn.Linear) for layer in q.decoder_layers)  # sliced: float
    assert isinstance(q.tgt_embed, Int8TiedOutput) and q.src_embed is q.tgt_embed
    assert torch.equal(q.tgt_embed.weight, trained.float.tgt_embed.weight)  # lookups stay float
    kept = quantize_int8(copy.deepcopy(trained.float), output_projection=False, min_weights=0)
    assert not isinstance(kept.tgt_embed, Int8TiedOutput)


@pytest.mark.parametrize("d_model,d_ff,vocab", [(128, 512, 4000), (512, 2048, 40), (64, 128, 24)])
def test_only_matrices_big_enough_to_gain_are_quantised(d_model, d_ff, vocab):
    """By default a linear layer gets int8 weights only from MIN_INT8_WEIGHTS entries: at d_model 128
    only the 4,000 x 128 output projection, at d_model 512 every layer but the 40 x 512 projection."""
    cfg = ModelConfig(d_model=d_model, n_heads=4, d_ff=d_ff, n_encoder_layers=1, n_decoder_layers=1,
                      src_vocab_size=vocab, tgt_vocab_size=vocab)
    model = build_model(cfg)
    sizes = {name: m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    q = quantize_int8(model)
    dynamic = {name for name, m in q.named_modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)}
    sliced = {"decoder_layers.0.cross_attn.in_proj"}
    layers = {name for name in dynamic if "embed" not in name}  # the tied projection: checked below
    assert layers == {name for name, n in sizes.items() if n >= MIN_INT8_WEIGHTS and name not in sliced}
    assert isinstance(q.tgt_embed, Int8TiedOutput) == (vocab * d_model >= MIN_INT8_WEIGHTS)
    assert (d_model == 512) == bool(layers)  # the threshold falls between the two model sizes


#: What dynamic int8 promises for one matrix product, as a fraction of its output's scale: weights
#: in 8 bits per row (off by at most half a step, max|w| / 254) and activations in 7 bits (torch's
#: x86 engines use ``reduce_range``: half a step is max|x| / 254 of a range twice as wide, so
#: max|x| / 127), together 1/254 + 1/127 = 1/85 (first order).
INT8_STEP = 1 / 85
N_INT8 = 2 * 4 + 2 * 5 + 1  # int8 matrices of the model (test_which_layers_are_quantised)


def int8_bound(logits: torch.Tensor) -> torch.Tensor:
    """A bound, per position (..., V) -> (...), on how far int8 logits may be from the float ones: the
    N_INT8 products in sequence each add INT8_STEP of the scale to first order, and the logits' scale
    is their largest magnitude. Derived from the quantisation step, not measured on one CPU."""
    return N_INT8 * INT8_STEP * logits.abs().amax(-1)


def float_margin(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...): how far the float model's choice is ahead of its runner-up."""
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


@torch.inference_mode()
def test_logits_agree(trained):
    """The int8 logits are within the bound int8 promises, and pick the float model's token
    wherever the float model is ahead by more than twice that bound (the two can swap only there)."""
    b = trained.test
    f, q = trained.float(b.src, b.tgt_in), trained.int8(b.src, b.tgt_in)  # (B, T, V)
    keep = b.tgt_out != 0
    f, q = f[keep], q[keep]  # (N, V) real positions
    bound = int8_bound(f)  # (N,)
    assert ((q - f).abs().amax(-1) <= bound).all()
    sure = float_margin(f) > 2 * bound  # (N,)
    assert sure.float().mean() > 0.5  # the float model is confident (it learned): the check below is not empty
    assert torch.equal(f.argmax(-1)[sure], q.argmax(-1)[sure])
    assert not torch.equal(f, q)  # it really is a different computation


@torch.inference_mode()
def test_same_decoded_tokens(trained):
    """Greedy decoding gives the float model's tokens for every sentence whose float decoding is
    ahead by more than twice the int8 bound at every step (forced along the float output)."""
    src = trained.test.src
    f_out, q_out = greedy(trained.float, src, 12), greedy(trained.int8, src, 12)
    batch = collate([s[s > EOS].tolist() for s in src], f_out)
    logits = trained.float(batch.src, batch.tgt_in)  # (B, T, V): the steps of the float decoding
    steps = batch.tgt_out != 0
    ahead = (float_margin(logits) > 2 * int8_bound(logits)) | ~steps  # (B, T)
    sure = ahead.all(dim=1).tolist()
    assert sum(sure) > len(sure) // 2  # a property of the float model: the check below is not empty
    assert [q for q, s in zip(q_out, sure) if s] == [f for f, s in zip(f_out, sure) if s]
    f = beam_search(trained.float, src, 4, 0.6, 12)
    q = beam_search(trained.int8, src, 4, 0.6, 12)
    assert [a[0].tokens for a, s in zip(q, sure) if s] == [b[0].tokens for b, s in zip(f, sure) if s]


def test_bad_values_fail_clearly(trained, tmp_path):
    with pytest.raises(QkvError, match="quantize must be None or 'int8', got 'int4'"):
        qkv.load(tmp_path, quantize="int4")
    with pytest.raises(QkvError, match="CPU only"):
        qkv.load(tmp_path, device="cuda", quantize="int8")
    with pytest.raises(QkvError, match="CPU only; the model is on meta"):
        quantize_int8(copy.deepcopy(trained.float).to("meta"))


# --- the checkpoint API and the CLI ---------------------------------------------------------------------

WORDS = ["red", "blue", "cat", "dog", "sun", "tree"]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("int8")
    rng = random.Random(0)
    pairs = [[rng.choice(WORDS) for _ in range(rng.randint(1, 3))] for _ in range(100)]
    src = write(d / "train.src", [" ".join(p) for p in pairs])
    tgt = write(d / "train.tgt", [" ".join(reversed(p)) for p in pairs])
    rc = main(["train", "--src-train", str(src), "--tgt-train", str(tgt), "--preset", "tiny", "--max-steps", "10",
               "--eval-every", "10", "--vocab-size", "40", "--tokenizer", "char", "--max-tokens", "512",
               "--out", str(d / "run")])
    assert rc == 0
    return types.SimpleNamespace(dir=d, best=d / "run" / "best", src=src, tgt=tgt)


def test_load_int8_translates(run):
    model = qkv.load(run.best, quantize="int8")
    hyps = model.translate(["red cat", "dog"], beam_size=2)
    assert len(hyps) == 2 and all(isinstance(h, str) for h in hyps)
    # the tiny preset has no matrix of MIN_INT8_WEIGHTS entries: every one stays float, the output too
    assert not any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in model.model.modules())
    assert hyps == qkv.load(run.best).translate(["red cat", "dog"], beam_size=2)


def test_cli_int8(run, capsys, tmp_path):
    capsys.readouterr()
    assert main(["translate", str(run.best), "red cat", "dog", "--int8"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["evaluate", str(run.best), "--src", str(run.src), "--ref", str(run.tgt), "--int8",
                 "--beam-size", "1"]) == 0
    assert "BLEU" in capsys.readouterr().out
    assert main(["evaluate", "--hyp", str(run.tgt), "--ref", str(run.tgt), "--int8"]) == 2
    err = capsys.readouterr().err
    assert "qkv evaluate: error: --int8 quantises a MODEL" in err and "Traceback" not in err


# --- encoders: per-token int8, smoothed --------------------------------------------------------------

def relative_row_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def test_row_int8_gives_each_token_its_own_scale():
    """A token of states 1000x larger than the others' (BERT's [CLS] and [SEP] carry such outliers) leaves the
    small tokens' products within 3% of float32 with one scale per token, where one scale per call rounds
    them to nothing."""
    from qkv.frontends.quantize import RowInt8Linear

    torch.manual_seed(0)
    linear = nn.Linear(256, 256)
    x = torch.randn(1, 6, 256)
    x[0, 0] *= 1000.0
    want = linear(x).detach()
    per_token = RowInt8Linear(linear)(x)
    per_call = quantize_int8(nn.Sequential(copy.deepcopy(linear)), min_weights=0)(x)
    small = slice(1, None)
    assert relative_row_error(per_token[0, small], want[0, small]).max() < 0.03
    assert relative_row_error(per_call[0, small], want[0, small]).min() > 0.2  # the reason for the scheme
    assert relative_row_error(per_token[0, :1], want[0, :1]).max() < 0.03


def test_smoothing_is_exact_in_float_and_helps_an_outlier_channel():
    """x Wᵀ = (x / s)(W diag s)ᵀ: the smoothed weights and inputs give the float product; with one input channel
    60x the others (a LayerNorm gain's outlier), smoothing makes the int8 product closer to float32."""
    from qkv.frontends.quantize import RowInt8Linear, smoothing

    torch.manual_seed(1)
    linear = nn.Linear(384, 384)
    x = torch.randn(8, 384)
    x[:, 7] *= 60.0
    want = linear(x).detach()
    s = smoothing(linear, x.abs().amax(0))
    torch.testing.assert_close((x / s) @ (linear.weight * s).T + linear.bias, want, atol=1e-4, rtol=1e-4)
    plain = relative_row_error(RowInt8Linear(linear)(x), want).mean()
    smoothed = relative_row_error(RowInt8Linear(linear, s)(x), want).mean()
    assert smoothed < 0.7 * plain, (float(smoothed), float(plain))


# sentences none of which is in CALIBRATION: short and long, questions, numbers, non-ASCII, markup, blank
VARIED = [
    "a dog runs on the beach", "The quick brown fox jumps over the lazy dog.", "", "   ", "hi", "OK", "Why?",
    "What is the capital of France?", "Transformers replaced recurrent networks in most NLP tasks after 2017.",
    "I loved this movie, it was fantastic!!!", "Terrible service; never again.", "3.14159 is pi",
    "Zürich liegt in der Schweiz.", "東京は日本の首都です", "emoji 😀 test", "x " * 100,
    "The stock market fell 3% on Tuesday amid concerns about inflation.", "line one<br />line two",
    "A man is playing a guitar.", "A woman is slicing an onion.", "Two children play in the snow.",
    "def f(x): return x ** 2", "https example com slash path", "yes", "no!", "¿Dónde está la biblioteca?",
    "The mitochondria is the powerhouse of the cell, as every biology student learns early on.",
    "He said: \"I'll be back.\"", "1 2 3 4 5 6 7 8 9 10", "UPPERCASE SHOUTING TEXT",
]


def test_int8_minilm_embeddings_keep_their_direction(minilm_dir):
    """all-MiniLM-L6-v2 in int8: cosine >= 0.99 against the float32 model on every sentence of a varied set
    (torch's dynamic int8 alone gave 0.88 on "OK")."""
    float32 = qkv.load(minilm_dir)
    int8 = qkv.load(minilm_dir, quantize="int8")
    assert type(int8.model.encoder_layers[0].self_attn.in_proj).__name__ == "RowInt8Linear"
    cos = torch.nn.functional.cosine_similarity(int8.embed(VARIED), float32.embed(VARIED))
    assert cos.min() >= 0.99, {VARIED[i]: round(float(cos[i]), 4) for i in range(len(VARIED)) if cos[i] < 0.99}


def test_int8_needs_an_encoder_for_calibration(trained):
    with pytest.raises(QkvError, match="encoder-only"):
        quantize_int8(copy.deepcopy(trained.float), calibration=torch.ones(1, 3, dtype=torch.long))
