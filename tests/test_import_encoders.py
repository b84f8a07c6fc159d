"""qkv import of DistilBERT, ELECTRA, ALBERT and BertForPreTraining (qkv.importers.distilbert, .electra,
.albert, .bert): each computes what transformers computes (hidden states, masked-LM and classifier logits within
1e-4 on a right-padded batch, float32), ALBERT with its narrower embeddings and its layers sharing weights,
ELECTRA with its embedding projection; and the switches train from scratch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from encoder_families import (TEXTS, check_fill, imported, max_classify_difference, max_hidden_difference,
                              max_mlm_difference, save_folder, template, transformers, unigram, wordpiece)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_NAMES = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
ALBERT_SPECIALS = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
ALBERT_NAMES = {"pad": "<pad>", "unk": "<unk>", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
BERT_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=64)


def distilbert(path, kind="Model", **overrides):
    tok = wordpiece(BERT_SPECIALS, template("[CLS]", "[SEP]"))
    cfg = transformers.DistilBertConfig(vocab_size=tok.get_vocab_size(), dim=32, n_layers=2, n_heads=4, hidden_dim=48,
                                        max_position_embeddings=64, pad_token_id=0, **overrides)
    return save_folder(path, getattr(transformers, f"DistilBert{kind}"), cfg, tok, BERT_NAMES)


def electra(path, kind="Model", **overrides):
    tok = wordpiece(BERT_SPECIALS, template("[CLS]", "[SEP]"))
    cfg = transformers.ElectraConfig(vocab_size=tok.get_vocab_size(), embedding_size=16, pad_token_id=0,
                                     **{**BERT_SHAPE, **overrides})
    return save_folder(path, getattr(transformers, f"Electra{kind}"), cfg, tok, BERT_NAMES)


def albert(path, kind="Model", **overrides):
    tok = unigram(ALBERT_SPECIALS, template("[CLS]", "[SEP]"))
    cfg = transformers.AlbertConfig(vocab_size=tok.get_vocab_size(), embedding_size=16, pad_token_id=0,
                                    **{**BERT_SHAPE, "num_hidden_layers": 3, "num_hidden_groups": 2, **overrides})
    return save_folder(path, getattr(transformers, f"Albert{kind}"), cfg, tok, ALBERT_NAMES)


def bert(path, kind="Model", **overrides):
    tok = wordpiece(BERT_SPECIALS, template("[CLS]", "[SEP]"))
    cfg = transformers.BertConfig(vocab_size=tok.get_vocab_size(), pad_token_id=0, **{**BERT_SHAPE, **overrides})
    return save_folder(path, getattr(transformers, f"Bert{kind}"), cfg, tok, BERT_NAMES)


FAMILIES = {"distilbert": distilbert, "electra": electra, "albert": albert}
LABELS = dict(num_labels=3, id2label={0: "neg", 1: "neutral", 2: "pos"}, label2id={"neg": 0, "neutral": 1, "pos": 2})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hidden_states_equal_transformers(tmp_path, family):
    path, ref, tok = FAMILIES[family](tmp_path / "hf")
    loaded = imported(path, tmp_path)
    assert max_hidden_difference(loaded, ref, tok) < 1e-4
    assert {"embed", "search"} <= loaded.offers and "fill" not in loaded.offers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sequence_classification_logits_equal_transformers(tmp_path, family):
    path, ref, tok = FAMILIES[family](tmp_path / "hf", "ForSequenceClassification", **LABELS)
    loaded = imported(path, tmp_path)
    assert loaded.labels == ["neg", "neutral", "pos"]
    assert max_classify_difference(loaded, ref, tok) < 1e-4


@pytest.mark.parametrize("family", ["distilbert", "albert", "electra"])
def test_masked_lm_logits_and_fill_equal_transformers(tmp_path, family):
    """ELECTRA's is the generator (ElectraForMaskedLM): its head is exact GELU whatever hidden_act says, here
    ReLU in the layers."""
    overrides = {"hidden_act": "relu"} if family == "electra" else {}
    path, ref, tok = FAMILIES[family](tmp_path / "hf", "ForMaskedLM", **overrides)
    loaded = imported(path, tmp_path)
    assert max_mlm_difference(loaded, ref, tok) < 1e-4
    check_fill(loaded, ref, tok)
    assert "fill" in loaded.offers


def test_albert_runs_its_layers_from_shared_weights(tmp_path):
    """3 layers from 2 sets of weights (ALBERT's grouping: sets 0, 0, 1), embeddings 16 wide projected to 32:
    the checkpoint holds each set once."""
    from safetensors.torch import load_file

    path, ref, tok = albert(tmp_path / "hf", "ForMaskedLM")
    loaded = imported(path, tmp_path)
    cfg = loaded.model.cfg
    assert (cfg.embedding_dim, cfg.layer_groups, cfg.n_encoder_layers) == (16, 2, 3)
    layers = loaded.model.encoder_layers
    assert len(layers) == 3 and layers[0] is layers[1] and layers[2] is not layers[0]
    saved = load_file(str(tmp_path / "q-hf" / "model.safetensors"))
    assert {k.split(".")[1] for k in saved if k.startswith("encoder_layers.")} == {"0", "1"}
    assert saved["src_embed.weight"].shape[1] == 16 and saved["embed_proj.weight"].shape == (32, 16)
    path, ref, tok = albert(tmp_path / "one", num_hidden_groups=1)  # every layer the same weights (ALBERT's own)
    assert max_hidden_difference(imported(path, tmp_path), ref, tok) < 1e-4


def test_bert_for_pretraining_is_the_encoder_and_its_masked_lm_head(tmp_path):
    path, ref, tok = bert(tmp_path / "hf", "ForPreTraining")
    loaded = imported(path, tmp_path)
    assert loaded.model.cfg.mlm_head
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    from encoder_families import check_same_tokens, qkv_tokens

    check_same_tokens(loaded, tok)
    with torch.no_grad():
        want = ref(**enc).prediction_logits
        got = loaded.model(qkv_tokens(loaded))
    model_ids = loaded.tokenizers.src.to_model_ids(range(got.size(-1)))
    cols = [q for q, m in enumerate(model_ids) if m is not None]
    real = enc["attention_mask"].bool()
    assert (got[..., cols] - want[..., [model_ids[q] for q in cols]])[real].abs().max() < 1e-4


def test_what_qkv_cannot_convert_is_refused_by_name(tmp_path):
    from qkv.importers import ImportRefused, convert

    path, _, _ = distilbert(tmp_path / "sin", sinusoidal_pos_embds=True)
    with pytest.raises(ImportRefused, match="sinusoidal_pos_embds = true is not supported"):
        convert(path)
    path, _, _ = albert(tmp_path / "inner", inner_group_num=2)
    with pytest.raises(ImportRefused, match="inner_group_num 2 is not supported"):
        convert(path)
    path, _, _ = electra(tmp_path / "disc", "ForPreTraining")
    with pytest.raises(ImportRefused, match="ElectraForPreTraining of model_type 'electra' is not supported "
                                            r"\(the discriminator's replaced-token head scores each token real or "
                                            "replaced, a task qkv has not"):
        convert(path)


@pytest.mark.parametrize("flags", [["--embedding-dim", "16", "--layer-groups", "1", "--mlm-head-activation", "gelu_tanh"],
                                   ["--positional", "learned", "--position-offset", "2"]])
def test_the_switches_train_from_scratch(tmp_path, flags):
    """qkv train --task mlm with ALBERT's switches (narrow embeddings, one set of layer weights) or RoBERTa's
    (positions from row 2): it trains, saves, loads and fills, and qkv info names the switches."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 8), encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "qkv", "train", "--task", "mlm", "--preset", "tiny", "--train", str(data),
                        "--valid", str(data), "--out", str(tmp_path / "run"), "--max-steps", "3", "--eval-every", "3",
                        "--threads", "1", "--vocab-size", "60", "--max-len", "32", *flags],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    import qkv

    loaded = qkv.load(tmp_path / "run" / "best")
    assert len(loaded.fill("the quick [MASK] fox", k=2)[0]) == 2
    r = subprocess.run([sys.executable, "-m", "qkv", "info", str(tmp_path / "run" / "best")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    named = {f.lstrip("-").replace("-", "_") for f in flags[0::2]} - {"positional"}
    line = next(line for line in r.stdout.splitlines() if line.startswith("switches"))
    assert all(f"{name}=" in line for name in named), line


def test_the_commands_take_the_imports(tmp_path):
    """fill, embed, search, classify and viz attention from the command line, and serve's /fill, /embed and
    /classify, on a RoBERTa masked LM (its <mask> written [MASK]) and an ALBERT classifier (shared layers);
    train --init-from the ALBERT classifier keeps its switches."""
    import qkv
    from test_import_roberta import folder as roberta

    roberta(tmp_path / "mlm", "Roberta", "ForMaskedLM")
    albert(tmp_path / "clf", "ForSequenceClassification", **LABELS)
    mlm, clf = imported(tmp_path / "mlm", tmp_path), imported(tmp_path / "clf", tmp_path)
    q_mlm, q_clf = tmp_path / "q-mlm", tmp_path / "q-clf"

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "qkv", *map(str, args)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    top = mlm.fill("the quick [MASK] fox", k=2)[0]
    assert top[0][0] in run("fill", q_mlm, "--top-k", "2", "the quick [MASK] fox")
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    run("embed", q_clf, "--input", tmp_path / "texts.txt", "--output", tmp_path / "vectors.npy")
    assert TEXTS[0] in run("search", q_mlm, "--corpus", tmp_path / "texts.txt", "--top-k", "1", TEXTS[0])
    want = clf.classify(TEXTS[:2])
    out = run("classify", q_clf, *TEXTS[:2])
    assert all(label in out for label, _ in want)
    run("viz", "attention", q_clf, "the quick fox", "--out", tmp_path / "att")
    assert (tmp_path / "att.html").is_file()
    from import_folders import served

    with served(f"mlm={q_mlm}", f"clf={q_clf}") as client:
        r = client.post("/fill", json={"model": "mlm", "texts": ["the quick [MASK] fox"], "k": 2})
        assert r.status_code == 200, r.text
        r = client.post("/classify", json={"model": "clf", "texts": TEXTS[:2]})
        assert r.status_code == 200 and [row["label"] for row in r.json()["results"]] == [l for l, _ in want]
        r = client.post("/embed", json={"model": "clf", "texts": TEXTS[:2]})
        assert r.status_code == 200, r.text
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": "pos" if len(t) > 20 else "neg"}) + "\n"
                            for t in TEXTS * 4), encoding="utf-8")
    run("train", "--task", "classify", "--init-from", q_clf, "--train", data, "--valid", data, "--out", tmp_path / "run",
        "--max-steps", "2", "--eval-every", "2", "--threads", "1", "--pooling", "cls", "--pooler")
    cfg = json.loads((tmp_path / "run" / "last" / "config.json").read_text())["model"]
    assert (cfg["embedding_dim"], cfg["layer_groups"], cfg["n_encoder_layers"]) == (16, 2, 3)
    assert {label for label, _ in qkv.load(tmp_path / "run" / "best").classify(TEXTS)} <= {"pos", "neg"}


@pytest.mark.parametrize("family", ["distilbert", "electra"])
def test_the_commands_take_the_other_families(tmp_path, family, capsys):
    """DistilBERT and ELECTRA (its generator for the masked LM): fill, embed, search, classify and viz attention
    from the command line (the maps: transformers' eager attention weights), serve's /embed and /fill, and
    train --init-from, mlm and classify: every tensor continues, within the 64 positions; a classifier keeps its
    head (ELECTRA's GELU one) for the same labels and starts its output layer new for other labels."""
    import qkv
    from qkv.cli import main
    from qkv.viz import attention_data

    from import_folders import eager, max_map_difference, rows_sum_to_one, served

    _, ref, tok = FAMILIES[family](tmp_path / "mlm", "ForMaskedLM")
    FAMILIES[family](tmp_path / "clf", "ForSequenceClassification", **LABELS)
    mlm, clf = imported(tmp_path / "mlm", tmp_path), imported(tmp_path / "clf", tmp_path)
    q_mlm, q_clf = tmp_path / "q-mlm", tmp_path / "q-clf"

    def run(*args) -> str:
        capsys.readouterr()
        assert main([str(a) for a in args]) == 0
        seen = capsys.readouterr()
        return seen.out + seen.err

    top = mlm.fill("the quick [MASK] fox", k=2)[0]
    assert f"{top[0][1]:.4f}  {top[0][0]}" in run("fill", q_mlm, "--top-k", "2", "the quick [MASK] fox")
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    run("embed", q_mlm, "--input", tmp_path / "texts.txt", "--output", tmp_path / "vectors.npy")
    import numpy as np

    assert np.allclose(np.load(tmp_path / "vectors.npy"), mlm.embed(TEXTS).numpy(), atol=1e-5)
    found = run("search", q_mlm, "--corpus", tmp_path / "texts.txt", "--top-k", "1", TEXTS[1])
    assert f"1.0000  2: {TEXTS[1]}" in found
    want = clf.classify(TEXTS[:2])
    assert run("classify", q_clf, *TEXTS[:2]).splitlines()[:2] == [f"{label}\t{p:.4f}" for label, p in want]

    text = "the quick brown fox"
    data = attention_data(mlm, text)
    enc = tok([text], return_tensors="pt")
    enc.pop("token_type_ids", None)
    with torch.inference_mode():
        maps = eager(ref)(**enc, output_attentions=True).attentions
    assert len(data["tokens"]["text"]) == enc["input_ids"].size(1)
    assert max_map_difference(data["weights"]["encoder"], maps) < 1e-5 and rows_sum_to_one(data["weights"]["encoder"])
    run("viz", "attention", q_clf, text, "--out", tmp_path / "att")
    assert (tmp_path / "att.html").is_file()

    with served(f"mlm={q_mlm}") as client:
        r = client.post("/embed", json={"model": "mlm", "texts": TEXTS[:2]})
        assert r.status_code == 200, r.text
        got = torch.tensor([row["embedding"] for row in r.json()["results"]])
        assert torch.allclose(got, mlm.embed(TEXTS[:2]), atol=1e-5)
        r = client.post("/fill", json={"model": "mlm", "texts": ["the quick [MASK] fox"], "k": 2})
        assert r.status_code == 200, r.text

    data = tmp_path / "mlm.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4), encoding="utf-8")
    logged = run("train", "--task", "mlm", "--init-from", q_mlm, "--train", data, "--valid", data, "--out",
                 tmp_path / "run-mlm", "--max-steps", "2", "--eval-every", "2", "--threads", "1")
    assert "max_len 63 (not 256)" in logged and "new: none" in logged
    assert len(qkv.load(tmp_path / "run-mlm" / "best").fill("the quick [MASK] fox", k=2)[0]) == 2

    for labels, head in ((["neg", "neutral", "pos"], "new: none"),
                         (["a", "b", "c"], "new: classifier.weight, classifier.bias")):
        data = tmp_path / "clf.jsonl"
        data.write_text("".join(json.dumps({"text": t, "label": labels[i % 3]}) + "\n"
                                for i, t in enumerate(TEXTS * 3)), encoding="utf-8")
        out = tmp_path / f"run-{labels[0]}"
        logged = run("train", "--task", "classify", "--init-from", q_clf, "--train", data, "--valid", data,
                     "--out", out, "--max-steps", "2", "--eval-every", "2", "--threads", "1")
        assert head in logged, logged
        cfg = json.loads((out / "last" / "config.json").read_text())["model"]
        assert (cfg["pooling"], cfg["pooler"], cfg["pooler_activation"]) == \
            ("cls", True, "gelu" if family == "electra" else clf.model.cfg.pooler_activation)
