"""``qkv export --format hf`` of an imported model writes its own family's transformers class
(qkv.export.hf_families): the tiny random folders of the import tests, imported, exported and loaded
back with transformers' own class compute what the ORIGINAL folder's model computes (logits or hidden
states within 1e-4 on a right-padded batch; greedy ``generate`` token for token), and the exported
tokenizer encodes texts to the original's ids. An option the class cannot say is refused by name,
exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import transformers  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["The Time Traveller was expounding a recondite matter to us.", "His grey eyes shone.",
         "Größere Häuser, café!", "x"]


def export_folder(folder, tmp_path, capsys=None):
    """``qkv import`` then ``qkv export --format hf`` (the command line), the exported folder."""
    from qkv.cli import main

    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--out", str(tmp_path / "exported")]) == 0
    return tmp_path / "exported"


def right_padded(tok, texts=TEXTS):
    enc = tok(texts, padding=True, return_tensors="pt")
    enc.pop("token_type_ids", None)
    assert (enc["attention_mask"] == 0).any() and (enc["attention_mask"][:, 0] == 1).all()
    return enc


def same_ids(original, exported, texts=TEXTS):
    assert exported(texts)["input_ids"] == original(texts)["input_ids"]


# --- decoder-only: Llama, Qwen2, Mistral, GPT-2 ----------------------------------------------------------

LMS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "LlamaForCausalLM-tied", "GPT2LMHeadModel"]


def build_lm(path, name):
    if name == "GPT2LMHeadModel":
        from test_import_gpt2 import build_gpt2

        return build_gpt2(path, train_steps=10)
    from test_import_llama import build

    return build(path, name.removesuffix("-tied"), tie=name.endswith("-tied"))


@pytest.mark.parametrize("name", LMS)
def test_causal_lm_exports_as_its_own_class(tmp_path, name):
    folder = build_lm(tmp_path / "hf", name)
    out = export_folder(folder, tmp_path)
    arch = name.removesuffix("-tied")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert "the imported tokenizer.json" in (out / "README.md").read_text()  # not a SentencePiece model's
    cls = getattr(transformers, arch)
    original, exported = cls.from_pretrained(str(folder)).eval(), cls.from_pretrained(str(out)).eval()
    assert type(transformers.AutoModelForCausalLM.from_pretrained(str(out))) is cls
    assert exported.config.tie_word_embeddings == original.config.tie_word_embeddings
    tok_o = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    tok_e = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    same_ids(tok_o, tok_e)
    if tok_o.pad_token is None:
        tok_o.pad_token = tok_o.eos_token
    enc = right_padded(tok_o)
    with torch.inference_mode():
        want, got = original(**enc).logits, exported(**enc).logits
    real = enc["attention_mask"].bool()
    assert float((got - want)[real].abs().max()) <= 1e-4
    for text in TEXTS[:2]:
        x = tok_o([text], return_tensors="pt")
        kw = dict(do_sample=False, num_beams=1, max_new_tokens=12, pad_token_id=tok_o.eos_token_id)
        assert exported.generate(**x, **kw).tolist() == original.generate(**x, **kw).tolist()
    info = json.loads((out / "qkv_export.json").read_text())
    assert info["runtime"] == f"transformers.{arch}" and info["verified"]["max_abs_logit_difference"] <= 1e-4


def test_an_option_the_class_cannot_say_is_refused_by_name(tmp_path, capsys):
    """An imported Llama whose checkpoint says scale_embeddings = true (a qkv switch no LlamaForCausalLM has)
    is refused in one line naming it: exit 2, nothing written."""
    from qkv.cli import main
    from test_import_llama import build

    from qkv.checkpoint import save_checkpoint
    from qkv.export.source import read_source
    from qkv.models import build_model

    assert main(["import", str(build(tmp_path / "hf", "LlamaForCausalLM")), "--out", str(tmp_path / "ckpt")]) == 0
    src = read_source(tmp_path / "ckpt")
    model = build_model(src.model)
    model.load_state_dict(src.weights)
    config = {**src.config, "model": {**src.config["model"], "scale_embeddings": True}}
    save_checkpoint(tmp_path / "bad", model, config, write_extra=src.tokenizers.save)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "bad"), "--format", "hf", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "scale_embeddings = true" in err and "LlamaForCausalLM" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


# --- encoders: BERT, RoBERTa (XLM-R), DistilBERT, ALBERT, ELECTRA ------------------------------------------

ENCODERS = [("bert", "Model"), ("bert", "ForMaskedLM"), ("bert", "ForSequenceClassification"),
            ("Roberta", "ForMaskedLM"), ("Roberta", "ForSequenceClassification"), ("XLMRoberta", "Model"),
            ("distilbert", "ForMaskedLM"), ("distilbert", "ForSequenceClassification"),
            ("albert", "Model"), ("albert", "ForMaskedLM"), ("albert", "ForSequenceClassification"),
            ("electra", "Model"), ("electra", "ForSequenceClassification")]


def build_encoder(path, family, kind):
    """The import tests' tiny random folder (weights and norms perturbed), and its transformers class."""
    import test_import_encoders as enc
    import test_import_roberta as rob

    labels = enc.LABELS if kind == "ForSequenceClassification" else {}
    if family in rob.FAMILIES:
        folder, model, tok = rob.folder(path, family, kind, **labels)
    else:
        folder, model, tok = getattr(enc, family)(path, kind, **labels)
    return folder, type(model)


@pytest.mark.parametrize("family,kind", ENCODERS)
def test_encoder_exports_as_its_own_class(tmp_path, family, kind):
    folder, cls = build_encoder(tmp_path / "hf", family, kind)
    out = export_folder(folder, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [cls.__name__]
    original, exported = cls.from_pretrained(str(folder)).eval(), cls.from_pretrained(str(out)).eval()
    tok_o = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    tok_e = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    same_ids(tok_o, tok_e)
    assert (tok_e.cls_token, tok_e.sep_token, tok_e.pad_token) == (tok_o.cls_token, tok_o.sep_token, tok_o.pad_token)
    enc = right_padded(tok_o)
    with torch.inference_mode():
        want, got = original(**enc), exported(**enc)
    if kind == "Model":  # the pooler, which the import leaves out, is not compared (nor written)
        real = enc["attention_mask"].bool()
        assert float((got.last_hidden_state - want.last_hidden_state)[real].abs().max()) <= 1e-4
    elif kind == "ForMaskedLM":
        real = enc["attention_mask"].bool()
        assert float((got.logits - want.logits)[real].abs().max()) <= 1e-4
    else:
        assert float((got.logits - want.logits).abs().max()) <= 1e-4
        assert exported.config.id2label == original.config.id2label


# --- encoder-decoders: BART, T5 (v1: tied and scaled output; v1.1: an lm_head of its own) ------------------

SEQ2SEQ = ["BartForConditionalGeneration", "T5-v1", "T5-v1.1"]


def build_seq2seq(path, name):
    if name == "BartForConditionalGeneration":
        from test_import_bart import build_bart

        return build_bart(path, train_steps=10)[0], transformers.BartForConditionalGeneration
    from test_import_t5 import build

    return build(path, name.removeprefix("T5-")), transformers.T5ForConditionalGeneration


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_decoder_exports_as_its_own_class(tmp_path, name):
    folder, cls = build_seq2seq(tmp_path / "hf", name)
    out = export_folder(folder, tmp_path)
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls.__name__]
    original, exported = cls.from_pretrained(str(folder)).eval(), cls.from_pretrained(str(out)).eval()
    assert type(transformers.AutoModelForSeq2SeqLM.from_pretrained(str(out))) is cls
    tok_o = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    tok_e = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    same_ids(tok_o, tok_e)
    enc = right_padded(tok_o)
    start = original.config.decoder_start_token_id
    target = torch.cat([torch.full((len(TEXTS), 1), start), enc["input_ids"][:, 1:6]], 1)  # any decoder input
    with torch.inference_mode():
        want = original(**enc, decoder_input_ids=target).logits
        got = exported(**enc, decoder_input_ids=target).logits
    assert float((got - want).abs().max()) <= 1e-4
    kw = dict(do_sample=False, num_beams=1, max_new_tokens=12)
    assert exported.generate(**enc, **kw).tolist() == original.generate(**enc, **kw).tolist()


def test_a_sentence_transformers_import_is_refused_by_name(tmp_path, capsys):
    """A sentence-transformers folder's import (a BertModel with its pooling) is no transformers class of its
    own: refused in one line naming what was imported and what --format hf writes, exit 2, nothing written."""
    from encoder_families import sentence_transformers_layout
    from qkv.cli import main

    build_encoder(tmp_path / "st", "bert", "Model")
    sentence_transformers_layout(tmp_path / "st", 32)
    assert main(["import", str(tmp_path / "st"), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "sentence-transformers BertModel" in err and "BertForMaskedLM" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family,kind", [("bert", "ForSequenceClassification")])
def test_the_cards_code_runs_as_written(tmp_path, family, kind):
    """The model card's install line names what its code imports, and the code runs from the folder that holds
    the export, printing the original model's labels."""
    import re
    import subprocess
    import sys

    folder, cls = build_encoder(tmp_path / "hf", family, kind)
    out = export_folder(folder, tmp_path)
    code = dict(re.findall(r"^```(\w*)\n(.*?)^```$", (out / "README.md").read_text(), flags=re.M | re.S))
    assert code["bash"].split()[3:] == ["tokenizers", "torch"] and "sentencepiece" not in code["bash"]
    run = subprocess.run([sys.executable, "-c", code["python"]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    labels = cls.from_pretrained(str(folder)).config.id2label.values()
    printed = eval(run.stdout.strip().splitlines()[-1])  # a list of label names
    assert len(printed) == 2 and set(printed) <= set(labels)


@pytest.mark.parametrize("name", ["Qwen2ForCausalLM", "GPT2LMHeadModel", "albert-ForMaskedLM", "T5-v1.1"])
def test_a_checkpoint_without_its_import_record_exports_as_the_class_of_its_options(tmp_path, name):
    """A checkpoint that keeps an import's tokenizer.json but not the record of the import (as train
    --init-from writes one) is written as the first class whose config.json says all its options: the
    same class here, equal to the original."""
    from qkv.checkpoint import save_checkpoint
    from qkv.cli import main
    from qkv.export.source import read_source
    from qkv.models import build_model

    if name in LMS:
        folder, cls = build_lm(tmp_path / "hf", name), getattr(transformers, name)
    elif name in SEQ2SEQ:
        folder, cls = build_seq2seq(tmp_path / "hf", name)
    else:
        folder, cls = build_encoder(tmp_path / "hf", *name.split("-"))
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt")]) == 0
    src = read_source(tmp_path / "ckpt")
    model = build_model(src.model)
    model.load_state_dict(src.weights)
    save_checkpoint(tmp_path / "tuned", model, {k: v for k, v in src.config.items() if k != "imported"},
                    write_extra=src.tokenizers.save)
    assert main(["export", str(tmp_path / "tuned"), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [cls.__name__]
    original, exported = cls.from_pretrained(str(folder)).eval(), cls.from_pretrained(str(tmp_path / "out")).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    x = tok(TEXTS[:1], return_tensors="pt")
    x.pop("token_type_ids", None)
    extra = {"decoder_input_ids": x["input_ids"][:, :3]} if name in SEQ2SEQ else {}
    with torch.inference_mode():
        assert float((exported(**x, **extra).logits - original(**x, **extra).logits).abs().max()) <= 1e-4
