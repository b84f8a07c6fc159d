"""Masked language modelling: the 15% / 80-10-10 corruption measured on a large sample, loss
only on chosen positions, `qkv fill`, and a classifier that starts from the MLM encoder."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.config import CLS, MASK, PAD, TrainConfig
from qkv.data.batching import Batch
from qkv.models import build_model
from qkv.config import ModelConfig
from qkv.tasks.mlm import FIRST_ORDINARY, MlmTask, mask_tokens
from qkv.checkpoint import read_checkpoint

WORDS = ["the", "movie", "was", "great", "bad", "plot", "film", "good", "and", "actor", "story", "fun"]


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_masking_proportions_on_a_large_sample():
    g = torch.Generator().manual_seed(0)
    vocab = 1000
    tokens = torch.randint(FIRST_ORDINARY, vocab, (400, 500), generator=g)
    tokens[:, 0] = CLS
    tokens[:, 450:] = PAD  # padding and <cls> are never chosen
    inputs, targets = mask_tokens(tokens, 0.15, vocab, g)
    chosen = targets != PAD
    ordinary = (tokens >= FIRST_ORDINARY).sum().item()
    n = chosen.sum().item()
    # binomial: 3 standard deviations
    p = n / ordinary
    assert abs(p - 0.15) < 3 * math.sqrt(0.15 * 0.85 / ordinary)
    assert not chosen[:, 0].any() and not chosen[:, 450:].any()
    assert torch.equal(targets[chosen], tokens[chosen])
    masked = (inputs[chosen] == MASK).float().mean().item()
    kept = (inputs[chosen] == tokens[chosen]).float().mean().item()
    changed = ((inputs[chosen] != MASK) & (inputs[chosen] != tokens[chosen])).float().mean().item()
    sd = math.sqrt(0.1 * 0.9 / n)
    assert abs(masked - 0.8) < 3 * math.sqrt(0.8 * 0.2 / n)
    # a random replacement equals the original with probability 1/(V - 7): counted as kept
    assert abs(kept - (0.1 + 0.1 / (vocab - FIRST_ORDINARY))) < 3 * sd + 1e-3
    assert abs(changed - 0.1) < 3 * sd + 1e-3
    assert torch.equal(inputs[~chosen], tokens[~chosen])  # unchosen positions untouched
    assert (inputs[chosen & (inputs != MASK)] >= FIRST_ORDINARY).all()  # random ids are ordinary


def test_loss_only_on_chosen_positions():
    torch.manual_seed(0)
    cfg = ModelConfig(task="mlm", d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, dropout=0.0,
                      attention_dropout=0.0, src_vocab_size=40, tgt_vocab_size=40)
    model = build_model(cfg)
    src = torch.tensor([[CLS, 10, MASK, 12, 13, PAD]])
    targets = torch.tensor([[PAD, PAD, 11, PAD, 13, PAD]])
    task = MlmTask()
    loss, nll = task.loss(model, Batch(src, None, targets, [0]), TrainConfig(label_smoothing=0.0))
    logp = torch.log_softmax(model(src), dim=-1)[0]  # (T, V), the full output
    expected = -(logp[2, 11] + logp[4, 13])
    assert torch.allclose(nll, expected, atol=1e-5) and torch.allclose(loss, expected, atol=1e-5)
    # the gradient of the loss does not depend on what the unchosen outputs would predict
    assert Batch(src, None, targets, [0]).n_tgt_tokens == 2


def write_texts(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.sample(["great", "bad"], 1)[0], rng.choice(["movie", "film"])
        lines.append(f"the {b} was {a} and the story was {a}")  # the two adjectives agree: learnable
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


FLAGS = ["--preset", "tiny", "--tokenizer", "bpe", "--vocab-size", "60", "--max-tokens", "512", "--warmup-steps", "50",
         "--lr-scale", "0.5", "--label-smoothing", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mlm")
    train = write_texts(d / "train.txt", 300, 1)
    valid = write_texts(d / "valid.txt", 30, 2)
    code, _, err = cli("train", "--task", "mlm", *FLAGS, "--train", str(train), "--valid", str(valid),
                       "--max-steps", "400", "--eval-every", "200", "--out", str(d / "run"))
    assert code == 0, err
    return d


def test_mlm_trains_and_fills(mlm_run):
    records = [json.loads(x) for x in (mlm_run / "run" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["valid_loss"] for r in records if "valid_loss" in r]
    assert valid[-1] < 1.2, valid  # far below ln(V) ~ 4: the model uses the context
    model = qkv.load(mlm_run / "run" / "best")
    preds = model.fill("the movie was great and the story was [MASK]", k=3)
    assert len(preds) == 1 and preds[0][0][0].strip() == "great", preds
    code, out, _ = cli("fill", str(mlm_run / "run" / "best"), "the film was bad and the story was [MASK]", "--top-k", "2")
    assert code == 0 and "bad" in out.splitlines()[1]
    code, _, err = cli("fill", str(mlm_run / "run" / "best"), "no mask here")
    assert code == 2 and "[MASK]" in err


def test_classifier_starts_from_mlm_encoder(mlm_run, tmp_path):
    rng = random.Random(5)
    rows = []
    for _ in range(40):
        a = rng.choice(["great", "bad"])
        rows.append(json.dumps({"text": f"the movie was {a}", "label": "pos" if a == "great" else "neg"}))
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(rows) + "\n", encoding="utf-8")
    init = mlm_run / "run" / "best"
    code, _, err = cli("train", "--task", "classify", "--pooling", "mean", *FLAGS, "--d-model", "64",
                       "--init-from", str(init), "--train", str(train), "--max-steps", "1", "--lr-scale", "1e-9",
                       "--out", str(tmp_path / "clf"))
    assert code == 0, err
    assert "init_from" in err and "architecture wins" in err  # d_model 64 was replaced by the mlm's 32
    mlm = read_checkpoint(init).state_dict
    clf = read_checkpoint(tmp_path / "clf" / "last").state_dict
    copied = [k for k in clf if k in mlm]
    assert "src_embed.weight" in copied and any(k.startswith("encoder_layers.1.") for k in copied)
    for k in copied:  # one step at a learning rate of ~0: the encoder is the mlm's
        assert torch.allclose(clf[k], mlm[k], atol=1e-6), k
    assert "classifier.weight" in clf and "classifier.weight" not in mlm  # the head is new
    assert not any(k.startswith("mlm_head") for k in clf)


@pytest.mark.parametrize("task", ["mlm", "classify"])
def test_resume_repeats_the_run_exactly(tmp_path, task):
    """3 + 3 steps with --resume give the weights of 6 steps in one go (masks and dropout included)."""
    rng = random.Random(3)
    rows = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))),
                        "label": rng.choice(["a", "b"])}) for _ in range(80)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    flags = ["--task", task, *FLAGS, "--dropout", "0.1", "--max-tokens", "128", "--max-len", "32", "--train", str(data), "--valid", str(data),
             "--eval-every", "3"]
    assert cli("train", *flags, "--max-steps", "6", "--out", str(tmp_path / "full"))[0] == 0
    assert cli("train", *flags, "--max-steps", "3", "--out", str(tmp_path / "part"))[0] == 0
    code, _, err = cli("train", *flags, "--max-steps", "6", "--out", str(tmp_path / "part"), "--resume")
    assert code == 0, err
    a = read_checkpoint(tmp_path / "full" / "last").state_dict
    b = read_checkpoint(tmp_path / "part" / "last").state_dict
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tokenizer_specials_and_old_tokenizers(tmp_path):
    from qkv.data.tokenizer import Tokenizer
    from qkv.errors import QkvError

    texts = ["the movie was great", "the film was bad"] * 20
    tok = Tokenizer.train(texts, 40, "bpe", specials=True)
    assert tok.has_specials and [tok.id_to_piece(i) for i in (4, 5, 6)] == ["<cls>", "[MASK]", "<sep>"]
    assert 5 in tok.encode(["the movie was [MASK]"])[0]  # typed [MASK] is the one piece
    old = Tokenizer.train(texts, 40, "bpe")  # as translation (and every checkpoint before) trains them
    assert not old.has_specials
    with pytest.raises(QkvError, match="<cls>, \\[MASK\\], <sep>"):
        old.require_specials("mlm")


SPECIAL_NAMES = {"<pad>", "<unk>", "<s>", "</s>", "<cls>", "[MASK]", "<sep>"}


@pytest.mark.parametrize("text", ["red [MASK] cat", "[MASK]", "[MASK] [MASK] the [MASK]", "the big dog [MASK]"])
def test_fill_never_offers_a_special_piece(text):
    """Asked for every piece, fill offers the ordinary ones only, with the model's own probabilities
    (softmax over the whole vocabulary, the special ids then left out), best first."""
    fixture = Path(__file__).parent / "fixtures" / "checkpoints" / "mlm-transformer"
    enc = qkv.load(fixture)
    sp = enc.tokenizers.src.sp
    V = sp.get_piece_size()
    special = {i for i in range(V) if sp.id_to_piece(i) in SPECIAL_NAMES or sp.is_control(i) or sp.is_unknown(i)}
    assert len(special) == 7
    fills = enc.fill(text, k=1000)
    tokens = enc.input_tokens(text)
    with torch.no_grad():
        probs = torch.softmax(enc.model.eval()(tokens)[0, tokens[0] == MASK].double(), dim=-1)  # (M, V)
    assert len(fills) == text.count("[MASK]") == probs.size(0)
    for offered, p in zip(fills, probs):
        ordinary = sorted((i for i in range(V) if i not in special), key=lambda i: -float(p[i]))
        assert len(offered) == V - len(special)
        assert [piece for piece, _ in offered] == [sp.decode([i]) or sp.id_to_piece(i) for i in ordinary]
        assert [v for _, v in offered] == pytest.approx([float(p[i]) for i in ordinary], abs=1e-6)
        assert not {piece.strip() for piece, _ in offered} & (SPECIAL_NAMES | {"⁇", ""})
    code, out, _ = cli("fill", str(fixture), text, "--top-k", "100")
    lines = out.splitlines()
    assert code == 0 and lines[0] == text and len(lines) == 1 + text.count("[MASK]") * (V - len(special))
    pieces = {line.split(maxsplit=2)[2] if len(line.split()) > 2 else "" for line in lines[1:]}
    assert not pieces & (SPECIAL_NAMES | {"⁇", ""}), out
