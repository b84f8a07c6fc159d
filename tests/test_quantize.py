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
    return types.SimpleNamespace(float=model, int8=quantize_int8(copy.deepcopy(model)), test=test)


def test_which_layers_are_quantised(trained):
    q = trained.int8
    dynamic = [name for name, m in q.named_modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    # per encoder layer: in_proj, out_proj, 2 FFN; per decoder layer: self in/out, cross out, 2 FFN
    assert len(dynamic) == 2 * 4 + 2 * 5 + 1  # + the tied output projection
    assert all(isinstance(layer.cross_attn.in_proj, nn.Linear) for layer in q.decoder_layers)  # sliced: float
    assert isinstance(q.tgt_embed, Int8TiedOutput) and q.src_embed is q.tgt_embed
    assert torch.equal(q.tgt_embed.weight, trained.float.tgt_embed.weight)  # lookups stay float
    kept = quantize_int8(copy.deepcopy(trained.float), output_projection=False)
    assert not isinstance(kept.tgt_embed, Int8TiedOutput)


@torch.inference_mode()
def test_logits_agree(trained):
    b = trained.test
    f, q = trained.float(b.src, b.tgt_in), trained.int8(b.src, b.tgt_in)  # (B, T, V)
    keep = b.tgt_out != 0
    f, q = f[keep], q[keep]  # (N, V) real positions
    corr = torch.corrcoef(torch.stack([f.flatten(), q.flatten()]))[0, 1]
    assert corr > 0.998
    assert (f.argmax(-1) == q.argmax(-1)).float().mean() > 0.98
    top = f.argmax(-1, keepdim=True)  # log-prob of the float model's choice, in both models
    assert (f.log_softmax(-1).gather(1, top) - q.log_softmax(-1).gather(1, top)).abs().mean() < 0.05
    assert not torch.equal(f, q)  # it really is a different computation


def test_same_decoded_tokens(trained):
    src = trained.test.src
    same = [a == b for a, b in zip(greedy(trained.int8, src, 12), greedy(trained.float, src, 12))]
    assert sum(same) >= 62  # of 64
    f = beam_search(trained.float, src, 4, 0.6, 12)
    q = beam_search(trained.int8, src, 4, 0.6, 12)
    assert sum(a[0].tokens == b[0].tokens for a, b in zip(q, f)) >= 62


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
    assert isinstance(model.model.tgt_embed, Int8TiedOutput)
    hyps = model.translate(["red cat", "dog"], beam_size=2)
    assert len(hyps) == 2 and all(isinstance(h, str) for h in hyps)


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
