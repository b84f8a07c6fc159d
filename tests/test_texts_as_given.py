"""Texts reach a model as its own tools give them: qkv's `<br />` cleaning belongs to the models trained
with it (``clean_html``, recorded in the run's config) and never to an import; a blank text is embedded as
sentence-transformers embeds it (its ``[CLS] [SEP]`` vector) in Python, ``qkv embed`` and ``/embed``; every
inference command takes ``--threads`` and the batching ones ``--batch-size``."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import qkv
from qkv.cli import main
from qkv.importers import import_model

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
# an HTML line break, blank texts, and a plain one
TEXTS = ["line one<br />line two", "", "   ", "a dog runs on the beach", "Line<br/>break<BR>twice"]


def edit_config(ckpt: Path, edit) -> None:
    """Change a copied checkpoint's config.json and list its new size and checksum in the manifest."""
    from qkv.checkpoint import _describe

    config = json.loads((ckpt / "config.json").read_text())
    edit(config)
    (ckpt / "config.json").write_text(json.dumps(config))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["config.json"] = _describe(ckpt / "config.json")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def minilm_import(minilm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("as-given") / "q"
    import_model(minilm_dir, out, log=lambda s: None)
    return minilm_dir, out


@pytest.fixture(scope="module")
def sentence_transformers_vectors(minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(minilm_dir), device="cpu")
    return torch.as_tensor(model.encode(TEXTS))


def test_an_import_embeds_every_text_as_sentence_transformers_does(minilm_import, sentence_transformers_vectors):
    """`<br />` kept as the tokenizer reads it, blank texts embedded: the checkpoint, the folder loaded in
    memory, and the checkpoint's recorded setting."""
    folder, out = minilm_import
    for source in (out, folder):
        got = qkv.load(source).embed(TEXTS)
        assert (got - sentence_transformers_vectors).abs().max() < 1e-5, source
    assert json.loads((out / "config.json").read_text())["train"]["clean_html"] is False


def test_an_import_written_before_the_setting_is_not_cleaned(minilm_import, tmp_path, sentence_transformers_vectors):
    """An imported checkpoint whose config has no clean_html (written by an earlier qkv) reads texts as given."""
    _, out = minilm_import
    old = tmp_path / "old"
    shutil.copytree(out, old)
    edit_config(old, lambda config: config["train"].pop("clean_html"))
    got = qkv.load(old).embed(TEXTS[:1])
    assert (got - sentence_transformers_vectors[:1]).abs().max() < 1e-5


def test_qkv_embed_takes_blank_lines_threads_and_batch_size(minilm_import, tmp_path, sentence_transformers_vectors):
    _, out = minilm_import
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    code, _, err = cli("embed", str(out), "--input", str(lines), "--output", str(tmp_path / "v.npy"),
                       "--threads", "1", "--batch-size", "2")
    assert code == 0, err
    got = torch.as_tensor(np.load(tmp_path / "v.npy"))
    assert got.shape == (len(TEXTS), 384)
    assert (got - sentence_transformers_vectors).abs().max() < 1e-5


def test_served_embed_takes_a_blank_text(minilm_import, sentence_transformers_vectors):
    pytest.importorskip("fastapi", reason='pip install -c constraints.txt -e ".[serve]"')
    from fastapi.testclient import TestClient

    from qkv.serve import Limits
    from qkv.serve.app import create_app
    from qkv.serve.service import load_models

    _, out = minilm_import
    limits = Limits()
    with TestClient(create_app(load_models([str(out)], limits), limits), base_url="http://127.0.0.1") as client:
        r = client.post("/embed", json={"texts": TEXTS})
        assert r.status_code == 200, r.text
        r_classify = client.post("/classify", json={"texts": [" "]})
    got = torch.tensor([row["embedding"] for row in r.json()["results"]])
    assert (got - sentence_transformers_vectors).abs().max() < 1e-5
    assert r_classify.status_code == 422  # the import has no /classify; blank-text rules elsewhere are unchanged


def test_a_model_trained_with_the_cleaning_keeps_it(tmp_path):
    """A classifier checkpoint written before clean_html was recorded cleans as its training did; the same
    checkpoint recorded with clean_html false reads `<br />` as text."""
    ckpt = FIXTURES / "classify-transformer"
    cleaned = qkv.load(ckpt)
    assert cleaned.clean is True
    with_br, plain = cleaned.embed(["great<br />film", "great film"])
    torch.testing.assert_close(with_br, plain)
    raw = tmp_path / "raw"
    shutil.copytree(ckpt, raw)
    edit_config(raw, lambda config: config["train"].update(clean_html=False))
    as_given = qkv.load(raw)
    assert as_given.clean is False
    with_br, plain = as_given.embed(["great<br />film", "great film"])
    assert not torch.allclose(with_br, plain)


def test_training_records_and_honours_clean_html(tmp_path):
    rows = [json.dumps({"text": f"the film<br />was {w}", "label": w}) for w in ["good", "bad"] * 20]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    for flag, want in (("--clean-html", True), ("--no-clean-html", False)):
        out = tmp_path / f"run{want}"
        code, _, err = cli("train", "--task", "classify", "--preset", "tiny", "--vocab-size", "40", "--tokenizer",
                           "char", "--max-tokens", "512", "--max-steps", "1", "--threads", "1", flag,
                           "--train", str(tmp_path / "train.jsonl"), "--out", str(out))
        assert code == 0, err
        assert json.loads((out / "best" / "config.json").read_text())["train"]["clean_html"] is want
        # the char vocabulary shows what training read: '>' and '/' only when the texts were kept as given
        pieces = qkv.load(out / "best").tokenizers.src.sp
        chars = {pieces.id_to_piece(i) for i in range(pieces.get_piece_size())}
        assert (">" in chars and "/" in chars) is (not want), sorted(chars)


@pytest.mark.parametrize("command,extra", [
    ("classify", ["great film"]), ("fill", ["the [MASK]"]), ("embed", ["--input", "x", "--output", "y.npy"]),
    ("search", ["q", "--corpus", "x"]), ("generate", []), ("score", ["--src", "a", "--tgt", "b"]),
    ("evaluate", ["--test", "x"]),
])
def test_every_inference_command_takes_threads(command, extra):
    from collections import defaultdict

    from qkv.cli_options import build_parser

    parser = build_parser(defaultdict(lambda: (lambda a: 0)))
    args = parser.parse_args([command, "model", *extra, "--threads", "2"])
    assert args.threads == 2
    if command in ("classify", "embed", "search"):
        assert parser.parse_args([command, "model", *extra, "--batch-size", "3"]).batch_size == 3


def test_batch_size_reaches_the_encoder(tmp_path, monkeypatch):
    """--batch-size sets how many texts one forward pass takes (counted on the model's forward)."""
    ckpt = FIXTURES / "classify-transformer"
    seen = []
    import qkv.frontends.encoder as encoder

    real = encoder.encoder_input
    monkeypatch.setattr(encoder, "encoder_input", lambda ids: seen.append(len(ids)) or real(ids))
    code, _, err = cli("classify", str(ckpt), "a", "b", "c", "d", "e", "--batch-size", "2", "--threads", "1")
    assert code == 0, err
    assert seen == [2, 2, 1]
