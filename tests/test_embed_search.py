"""Sentence embeddings and semantic search: `qkv embed` (.npy / .tsv, mean or cls pooling)
and `qkv search` (cosine similarity), checked against embeddings computed by hand."""

from __future__ import annotations

import contextlib
import io
import json
import random

import numpy as np
import pytest
import torch

import qkv
from qkv.cli import main


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("embed")
    rng = random.Random(0)
    rows = [json.dumps({"text": f"the {rng.choice(['movie', 'film'])} was {a}", "label": a})
            for a in [rng.choice(["great", "bad"]) for _ in range(60)]]
    (d / "train.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    code, _, err = cli("train", "--task", "classify", "--preset", "tiny", "--vocab-size", "50", "--max-tokens", "512",
                       "--max-steps", "3", "--threads", "1", "--train", str(d / "train.jsonl"), "--out", str(d / "run"))
    assert code == 0, err
    return d


def test_embed_npy_tsv_and_pooling(model_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    texts = ["the movie was great", "the film was bad", "great great film"]
    corpus.write_text("\n".join(texts) + "\n", encoding="utf-8")
    model = qkv.load(model_dir / "run" / "best")
    for pooling in ("mean", "cls"):
        code, _, err = cli("embed", str(model_dir / "run" / "best"), "--input", str(corpus), "--output",
                           str(tmp_path / "v.npy"), "--pooling", pooling)
        assert code == 0, err
        v = np.load(tmp_path / "v.npy")
        assert v.shape == (3, model.model.cfg.d_model)
        # by hand: the encoder's states of "<cls> pieces", pooled
        from qkv.config import CLS

        ids = model.tokenizers.src.encode([texts[1]])[0]
        with torch.no_grad():
            h, _, _ = model.model.encode(torch.tensor([[CLS, *ids]]))
        expected = h[0].mean(0) if pooling == "mean" else h[0, 0]
        assert np.allclose(v[1], expected.numpy(), atol=1e-5)
    code, _, _ = cli("embed", str(model_dir / "run" / "best"), "--input", str(corpus), "--output", str(tmp_path / "v.tsv"))
    rows = (tmp_path / "v.tsv").read_text().splitlines()
    assert code == 0 and len(rows) == 3 and len(rows[0].split("\t")) == model.model.cfg.d_model


def test_search_ranks_by_cosine(model_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    texts = ["the movie was great", "the film was bad", "great great film", "bad bad movie"]
    corpus.write_text("\n".join(texts) + "\n", encoding="utf-8")
    model = qkv.load(model_dir / "run" / "best")
    v = model.embed(texts, "mean")
    q = model.embed(["the movie was great"], "mean")
    cos = (q @ v.T / (q.norm() * v.norm(dim=1)))[0]
    code, out, err = cli("search", str(model_dir / "run" / "best"), "--corpus", str(corpus), "--top-k", "4",
                         "--pooling", "mean", "the movie was great")
    assert code == 0, err
    lines = out.strip().splitlines()[1:]
    ranked = [int(line.split()[1].rstrip(":")) - 1 for line in lines]
    assert ranked == cos.argsort(descending=True).tolist()
    assert float(lines[0].split()[0]) == pytest.approx(1.0, abs=1e-4)  # the query itself is in the corpus


def test_bad_inputs(model_dir, tmp_path):
    f = tmp_path / "in.txt"
    f.write_text("a\n\nb\n", encoding="utf-8")
    # a blank line is a text: embedded as the model reads an empty one (<cls> alone for qkv's own models)
    code, _, err = cli("embed", str(model_dir / "run" / "best"), "--input", str(f), "--output", str(tmp_path / "o.npy"))
    assert code == 0, err
    model = qkv.load(model_dir / "run" / "best")
    from qkv.config import CLS

    with torch.no_grad():
        h, _, _ = model.model.encode(torch.tensor([[CLS]]))
    pooled = h[0, 0] if model.default_pooling == "cls" else h[0].mean(0)
    assert np.allclose(np.load(tmp_path / "o.npy")[1], pooled.numpy(), atol=1e-5)
    code, _, err = cli("embed", str(model_dir / "run" / "best"), "--input", str(f), "--output", str(tmp_path / "o.csv"))
    assert code == 2 and ".npy" in err
    code, _, err = cli("fill", str(model_dir / "run" / "best"), "the [MASK]")
    assert code == 2 and "masked language model" in err
