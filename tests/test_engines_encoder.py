"""The CTranslate2 engine for encoders (qkv.engines.encoder): embeddings, class probabilities and
fill-in predictions equal to qkv's float model within 1e-4, for qkv's own fixture checkpoints, an
imported BERT (a sentence-transformers-like folder and BertForMaskedLM / BertForSequenceClassification,
built with transformers' classes) and all-MiniLM-L6-v2; its int8 engine within cosine 0.99 of the
float model on every sentence of a varied set; the conversion made once and cached; the commands'
--engine flag; what it cannot run refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ctranslate2", reason="pip install -c constraints.txt -e '.[export]'")

import qkv  # noqa: E402
from encoder_families import sentence_transformers_layout  # noqa: E402
from qkv.cli import main  # noqa: E402
from qkv.engines.encoder import CT2Encoder  # noqa: E402
from qkv.errors import QkvError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"

# short, long, punctuation, numbers, non-ASCII, blank: the set the int8 agreement is measured on
VARIED = [
    "", "   ", "a", "Hi!", "OK.", "42", "3.14159 2.71828 1.41421", "The year 1969, July 20th, 20:17 UTC.",
    "A man is riding a horse.", "A woman is slicing an onion in the kitchen.",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris, of course!",
    "Semantic search ranks documents by the cosine similarity of their embeddings to the query's.",
    "I'd've thought -- wouldn't you? -- that (nested (parentheses)) and [brackets] {braces} parse fine...",
    "café, naïve, façade, crème brûlée, Ærø, Größe",
    "東京は日本の首都です。", "Москва — столица России.", "Emoji: 💖 🎉 🤖 👍🏽",
    "e-mail: someone@example.org, URL-like: www dot example dot org / path?q=1&r=2",
    "ALL CAPS SENTENCE WITH SHOUTING", "repeated repeated repeated repeated repeated words",
    "Line one<br />line two", "tabs\tand  double  spaces",
    "Transformers replaced recurrent networks in most sequence transduction tasks because attention "
    "relates every pair of positions in a constant number of operations, which parallelises well on "
    "modern accelerators and shortens the paths that long-range dependencies have to travel.",
    " ".join(["a long text of many words that goes past the model's length"] * 40),
    "¿Dónde está la biblioteca?", "Ceci n'est pas une pipe.", "1 + 1 = 2; 2 * 3 = 6; 10 / 4 = 2.5",
    "C'est la vie!", "The end.",
]


def copy(name: str, root: Path) -> Path:
    """A fixture checkpoint copied (the conversion is cached beside it)."""
    shutil.copytree(FIXTURES / name, root / name)
    return root / name


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    return {name: copy(name, root) for name in ("mlm-transformer", "classify-transformer", "classify-bilstm")}


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


@pytest.mark.parametrize("name", ["mlm-transformer", "classify-transformer"])
def test_own_encoders_equal_the_float_model(own, name):
    """Embeddings (both poolings), in the caller's order across batches of sorted lengths, class
    probabilities and fill-in predictions: CTranslate2's equal qkv's float model within 1e-4."""
    ours, theirs = qkv.load(own[name]), qkv.load(own[name], engine="ctranslate2", threads=1)
    assert isinstance(theirs, CT2Encoder) and theirs.engine == "ctranslate2"
    ours.batch_size = theirs.batch_size = 3  # several batches of sorted lengths, restored to the caller's order
    texts = VARIED[:12]
    for pooling in ("mean", "cls"):
        want, got = ours.embed(texts, pooling), theirs.embed(texts, pooling)
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4
    if name.startswith("classify"):
        assert (theirs.probabilities(texts) - ours.probabilities(texts)).abs().max() < 1e-4
        assert [c for c, _ in theirs.classify(texts)] == [c for c, _ in ours.classify(texts)]
    else:
        for text in ["the [MASK] is", "[MASK] time [MASK]"]:
            want, got = ours.fill(text, 5), theirs.fill(text, 5)
            assert [[p for p, _ in m] for m in got] == [[p for p, _ in m] for m in want]
            assert np.allclose([[v for _, v in m] for m in got], [[v for _, v in m] for m in want], atol=1e-4)
    hits = theirs.search("the movie", texts, k=3)
    assert [i for _, i in hits] == [i for _, i in ours.search("the movie", texts, k=3)]


def test_the_conversion_is_made_once_and_follows_the_checkpoint(own, tmp_path):
    """A second load reuses the cached conversion (nothing converted); a changed checkpoint (another
    manifest) gets a new one, the old one removed."""
    path = copy("mlm-transformer", tmp_path)
    said = []
    from qkv.engines import load

    load(path, threads=1, log=said.append)
    assert len([s for s in said if s.startswith("converting")]) == 1
    first = sorted(p.name for p in path.glob("ct2-*"))
    said.clear()
    load(path, threads=1, log=said.append)
    assert said == [] and sorted(p.name for p in path.glob("ct2-*")) == first
    manifest = json.loads((path / "manifest.json").read_text())  # a new training step: other checksums
    (path / "config.json").write_text((path / "config.json").read_text() + " ")
    from qkv.files import sha256_file

    manifest["files"]["config.json"] = {"size": (path / "config.json").stat().st_size,
                                        "sha256": sha256_file(path / "config.json")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    load(path, threads=1, log=said.append)
    assert any(s.startswith("converting") for s in said)
    second = sorted(p.name for p in path.glob("ct2-*"))
    assert len(second) == 1 and second != first


def test_what_the_engine_cannot_run_is_refused_by_name(own, tmp_path):
    with pytest.raises(QkvError, match="'classify' model with arch 'lstm'.*--engine qkv"):
        qkv.load(own["classify-bilstm"], engine="ctranslate2")
    with pytest.raises(QkvError, match="attention"):
        qkv.load(own["mlm-transformer"], engine="ctranslate2", threads=1).model.attention_maps(torch.tensor([[4, 9]]))
    with pytest.raises(QkvError, match="engine 'other'"):
        qkv.load(own["mlm-transformer"], engine="other")


def test_commands_take_engine_and_int8(own, tmp_path, capsys):
    """qkv embed / classify / fill / search --engine ctranslate2: qkv's outputs (embeddings within 1e-4);
    --int8 runs; an unsupported model is one line and status 2."""
    mlm, clf = str(own["mlm-transformer"]), str(own["classify-transformer"])
    (tmp_path / "in.txt").write_text("\n".join(VARIED[:8]) + "\n", encoding="utf-8")
    for engine, out in (("qkv", "a.npy"), ("ctranslate2", "b.npy"), ("ctranslate2", "c.npy")):
        extra = ["--int8"] if out == "c.npy" else []
        assert main(["embed", mlm, "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / out), "--engine", engine,
                     "--threads", "1", "--batch-size", "3", *extra]) == 0
    a, b, c = (np.load(tmp_path / f) for f in ("a.npy", "b.npy", "c.npy"))
    assert a.shape == (8, 16) and np.abs(a - b).max() < 1e-4
    assert cosines(torch.from_numpy(a), torch.from_numpy(c)).min() > 0.9  # int8: close, not equal
    capsys.readouterr()
    for argv in (["classify", clf, "good film", "bad", "--all"], ["fill", mlm, "the [MASK] is"],
                 ["search", mlm, "--corpus", str(tmp_path / "in.txt"), "a horse"]):
        assert main(argv) == 0
        want = capsys.readouterr().out
        assert main([*argv, "--engine", "ctranslate2", "--threads", "1"]) == 0
        assert capsys.readouterr().out == want
    assert main(["classify", str(own["classify-bilstm"]), "x", "--engine", "ctranslate2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'lstm'" in err and "Traceback" not in err


def test_served_embeddings_equal_on_both_engines(own):
    """qkv serve --engine ctranslate2: /embed answers qkv's float model's embeddings within 1e-4 (a blank
    text included)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from qkv.serve import Limits
    from qkv.serve.app import create_app
    from qkv.serve.service import load_models

    rows = []
    for engine in ("qkv", "ctranslate2"):
        models = load_models([str(own["mlm-transformer"])], Limits(), engine=engine, threads=1)
        with TestClient(create_app(models, Limits()), base_url="http://127.0.0.1") as client:
            r = client.post("/embed", json={"texts": VARIED[:6]})
            assert r.status_code == 200, r.text
            rows.append(torch.tensor([x["embedding"] for x in r.json()["results"]]))
    assert rows[0].shape == (6, 16) and (rows[0] - rows[1]).abs().max() < 1e-4


# --- imported models ----------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=64, type_vocab_size=2)


def bert_folder(path: Path, arch: str, sentence: bool = False) -> Path:
    """A tiny random BERT of ``arch`` (noise on every tensor, so no LayerNorm is the identity) with a
    WordPiece tokenizer, saved by save_pretrained; ``sentence``: a sentence-transformers folder around it
    (modules.json, mean Pooling, Normalize)."""
    from tokenizers.implementations import BertWordPieceTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(VARIED * 2, vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok = transformers.BertTokenizerFast(tokenizer_object=wp._tokenizer, unk_token="[UNK]", sep_token="[SEP]",
                                         pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    torch.manual_seed(0)
    model = getattr(transformers, arch)(transformers.BertConfig(vocab_size=tok.vocab_size, num_labels=3, **BERT))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if sentence:
        sentence_transformers_layout(path, 32)
    return path


@pytest.mark.parametrize("arch", ["BertModel", "BertForMaskedLM", "BertForSequenceClassification"])
def test_imported_bert_equals_the_float_model(tmp_path, arch):
    """A BERT built with transformers' classes, qkv import, then the engine: qkv's float model's
    embeddings within 1e-4 (the sentence-transformers-like folder: normalised mean pooling), its fill
    and class probabilities within 1e-4."""
    from qkv.importers import import_model

    folder = bert_folder(tmp_path / "hf", arch, sentence=arch == "BertModel")
    ckpt = import_model(folder, tmp_path / "q", log=lambda *a: None)
    ours, theirs = qkv.load(ckpt), qkv.load(ckpt, engine="ctranslate2", threads=1)
    ours.batch_size = theirs.batch_size = 4
    want, got = ours.embed(VARIED), theirs.embed(VARIED)
    assert (got - want).abs().max() < 1e-4
    if arch == "BertModel":
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(VARIED)), atol=1e-5)  # its Normalize
    if arch == "BertForMaskedLM":
        want, got = ours.fill("the quick [MASK] fox", 5), theirs.fill("the quick [MASK] fox", 5)
        assert [p for p, _ in got[0]] == [p for p, _ in want[0]]
        assert np.allclose([v for _, v in got[0]], [v for _, v in want[0]], atol=1e-4)
    if arch == "BertForSequenceClassification":
        assert (theirs.probabilities(VARIED) - ours.probabilities(VARIED)).abs().max() < 1e-4
    with pytest.raises(QkvError, match="qkv import"):  # the folder itself: its cache needs a checkpoint's manifest
        qkv.load(folder, engine="ctranslate2")


@pytest.fixture(scope="module")
def minilm(minilm_dir, tmp_path_factory):
    from qkv.importers import import_model

    return import_model(minilm_dir, tmp_path_factory.mktemp("minilm") / "q", log=lambda *a: None)


# CTranslate2 4.8.5's int8 alone reached a minimum of 0.977 on this set (the blank texts and "OK.": the
# shortest, whose mean pools [CLS] and [SEP] most; every row of 8 tokens or more stayed >= 0.992); the engine
# runs rows of at most SHORT_ROWS tokens in float32, and the goal, >= 0.99 on every sentence, holds.
MINILM_INT8_MIN_COSINE = 0.99


def test_minilm_engine_equals_float_and_int8_keeps_the_answers(minilm, capsys):
    """all-MiniLM-L6-v2: the float engine's embeddings equal qkv's float model's within 1e-4 on the
    varied set; the int8 engine reaches cosine >= 0.99 to the float model on every sentence (the
    minimum is printed): its short rows run in float32 (equal within 1e-4), the others in int8 (not
    equal: int8 ran)."""
    ours = qkv.load(minilm)
    want = ours.embed(VARIED)
    got = qkv.load(minilm, engine="ctranslate2", threads=1).embed(VARIED)
    assert (got - want).abs().max() < 1e-4
    int8 = qkv.load(minilm, engine="ctranslate2", quantize="int8", threads=1).embed(VARIED)
    cos = cosines(int8, want)
    with capsys.disabled():
        print(f"\nall-MiniLM-L6-v2, CTranslate2 int8 vs float over {len(VARIED)} sentences: min cosine "
              f"{float(cos.min()):.4f} (sentence {int(cos.argmin())}: {VARIED[int(cos.argmin())][:40]!r}), "
              f"mean {float(cos.mean()):.4f}")
    assert float(cos.min()) >= MINILM_INT8_MIN_COSINE
    from qkv.engines.encoder import SHORT_ROWS

    rows = [len(r) + 1 for r in ours._ids(VARIED)]  # <cls> + the tokenizer's ids
    short = [i for i, n in enumerate(rows) if n <= SHORT_ROWS]
    long = [i for i, n in enumerate(rows) if n > SHORT_ROWS]
    assert short and long
    assert (int8[short] - want[short]).abs().max() < 1e-4
    assert (int8[long] - want[long]).abs().max() > 1e-3


@pytest.mark.parametrize("switch", [{"positional": "rotary"}, {"norm": "rmsnorm", "norm_bias": False},
                                    {"ffn_gated": True}, {"attention_scale": False}, {"n_kv_heads": 1}])
def test_an_encoder_with_a_family_switch_is_refused_by_name(switch):
    """The engines' encoder conversion is BERT's spec: an encoder-only model with a switch it has no slot for is
    refused naming the field, never converted approximately."""
    import dataclasses
    import types

    from qkv.config import ModelConfig
    from qkv.export import ct2

    cfg = dataclasses.replace(ModelConfig(task="mlm", n_heads=2), **switch)
    src = types.SimpleNamespace(model=cfg, task="mlm", key=("mlm", "transformer"), path="ckpt")
    field = next(iter(switch))
    refused = [f for f, _ in ct2.family_refusals(src)]
    assert any(f.startswith(field) for f in refused), refused
