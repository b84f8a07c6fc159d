"""``qkv export``: a trained model leaves qkv, for CTranslate2 and Hugging Face transformers, and
gives the same outputs there.

Tiny models are trained in-process (``qkv.cli.main``, a word-reversal task, a few seconds each):
post-norm with one shared vocabulary; pre-norm with learned positions, separate vocabularies and an
untied output projection; post-norm with separate vocabularies; a pre-norm decoder-only language
model. The fixture prefix-LM checkpoint covers the prefix language model. Each is exported and
compared with qkv:

* CTranslate2 greedy translations equal ``qkv translate --beam-size 1``, sentence by sentence
  (CTranslate2 gets each sentence's qkv length limit, |x| + 50, as its max_decoding_length);
* the Hugging Face MarianMTModel's teacher-forced logits are within 1e-4 of qkv's on a padded
  batch, its greedy ``generate`` gives qkv's greedy tokens, and it loads with qkv unimportable;
* the CTranslate2 Generator's greedy continuation equals qkv's greedy generation, token for token.

The conversions need ``ctranslate2`` and ``transformers`` (``pip install -c constraints.txt -e
".[export]"``); without them those tests are skipped with that message, and the error tests
(bad input, a missing package) still run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.config import BOS, EOS, SEP, ModelConfig
from qkv.decoding.batch import decode_sentences
from qkv.decoding.sampling import sample

INSTALL = 'pip install -c constraints.txt -e ".[export]"'
HAS_CT2 = importlib.util.find_spec("ctranslate2") is not None
HAS_HF = importlib.util.find_spec("transformers") is not None
needs_ct2 = pytest.mark.skipif(not HAS_CT2, reason=f"ctranslate2 is not installed: {INSTALL}")
needs_hf = pytest.mark.skipif(not HAS_HF, reason=f"transformers is not installed: {INSTALL}")

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
WORDS = ["red", "blue", "cat", "dog", "sun", "tree"]
SENTENCES = ["red cat", "tree sun dog blue", "dog", "blue blue cat cat", "sun tree", "cat dog red sun tree",
             "red Zebra!"]  # 'Z' and '!' are in no character vocabulary, 'e' in no target one: <unk>
TRAIN = ["--preset", "tiny", "--max-steps", "40", "--eval-every", "40", "--tokenizer", "char", "--vocab-size", "60",
         "--max-tokens", "512", "--eval-bleu-samples", "5", "--threads", "1"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def target(sentence: str) -> str:
    """The task: the words reversed and upper-cased (so that separate vocabularies differ)."""
    return " ".join(reversed(sentence.upper().split()))


def reversal(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
        pairs.append((" ".join(words), target(" ".join(words))))
    return pairs


def write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("export-data")
    train, valid = reversal(300, 0), reversal(20, 1)
    return {"dir": d,
            "src_train": write(d / "train.en", [s for s, _ in train]), "tgt_train": write(d / "train.de", [t for _, t in train]),
            "src_valid": write(d / "valid.en", [s for s, _ in valid]), "tgt_valid": write(d / "valid.de", [t for _, t in valid]),
            "text": write(d / "text.txt", [" ".join(random.Random(i).choices(WORDS, k=5)) for i in range(200)])}


def train(data, name: str, *flags: str) -> Path:
    out = data["dir"] / name
    if not (out / "best").is_dir():
        files = (["--train", data["text"], "--valid-fraction", "0.1", "--max-len", "32"] if "lm" in flags else
                 ["--src-train", data["src_train"], "--tgt-train", data["tgt_train"],
                  "--src-valid", data["src_valid"], "--tgt-valid", data["tgt_valid"]])
        assert main(["train", *files, *TRAIN, *flags, "--out", str(out)]) == 0
    return out / "best"


MODELS = {  # name -> training flags
    "post": (),
    "pre": ("--norm-first", "--positional", "learned", "--max-positions", "128", "--max-len", "100", "--no-joint-vocab",
            "--no-share-embeddings", "--no-tie-output"),
    "separate": ("--no-joint-vocab", "--no-share-embeddings"),
    # BART's switches trained from scratch: learned positions from row 2, a LayerNorm on each stack's embeddings
    "bart": ("--positional", "learned", "--position-offset", "2", "--embedding-norm", "--no-scale-embeddings",
             "--activation", "gelu", "--output-bias", "--max-positions", "128", "--max-len", "100"),
}


@pytest.fixture(scope="module")
def trained(data):
    """Trained lazily: a model is trained the first time a test asks for it."""
    return lambda name: train(data, name, *MODELS[name])


@pytest.fixture(scope="module")
def lm(data):
    return train(data, "lm", "--task", "lm", "--norm-first")


def export(capsys, ckpt: Path, fmt: str, out: Path, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["export", str(ckpt), "--format", fmt, "--out", str(out), *extra])
    return rc, capsys.readouterr().err


def qkv_greedy(capsys, ckpt: Path, sentences: list[str]) -> list[str]:
    """What `qkv translate CKPT --beam-size 1 SENTENCES...` prints."""
    capsys.readouterr()
    assert main(["translate", str(ckpt), "--beam-size", "1", *sentences]) == 0
    return capsys.readouterr().out.split("\n")[: len(sentences)]


def budget(n_pieces: int) -> int:
    """qkv's default output limit: max_len_a · (pieces + EOS) + max_len_b tokens."""
    return n_pieces + 1 + 50


# --- CTranslate2 ----------------------------------------------------------------------------------------

def ct2_translate(out: Path, sentences: list[str]) -> list[str]:
    import ctranslate2
    import sentencepiece as spm

    translator = ctranslate2.Translator(str(out), intra_threads=1)
    source = spm.SentencePieceProcessor(model_file=str(out / "source.spm"))
    target = spm.SentencePieceProcessor(model_file=str(out / "target.spm"))
    hyps = []
    for s in sentences:  # one call each: qkv's limit is per sentence
        pieces = source.encode(s, out_type=str)
        r = translator.translate_batch([pieces], beam_size=1, max_decoding_length=budget(len(pieces)))
        hyps.append(target.decode(r[0].hypotheses[0]))
    return hyps


@needs_ct2
@pytest.mark.parametrize("name", ["post", "pre", "separate", "bart"])
def test_ctranslate2_greedy_equals_qkv_translate(trained, tmp_path, capsys, name):
    ckpt = trained(name)
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "ct2")
    assert rc == 0, err
    assert "agree on 3 probe sequences" in err
    out = tmp_path / "ct2"
    info = json.loads((out / "qkv_export.json").read_text())
    assert info["verified"]["checked"] and info["verified"]["max_abs_log_prob_difference"] < 1e-4
    joint = name in ("post", "bart")
    assert (out / "shared_vocabulary.json").is_file() == joint
    assert (out / "source_vocabulary.json").is_file() == (not joint)
    model = qkv.load(ckpt)
    vocab = json.loads((out / ("shared_vocabulary.json" if joint else "target_vocabulary.json")).read_text())
    assert vocab == [model.tokenizers.tgt.id_to_piece(i) for i in range(model.tokenizers.tgt.vocab_size)]
    assert (out / "source.spm").read_bytes() == model.tokenizers.src.model_bytes
    assert (out / "target.spm").read_bytes() == model.tokenizers.tgt.model_bytes
    want = qkv_greedy(capsys, ckpt, SENTENCES)
    assert ct2_translate(out, SENTENCES) == want
    if name == "pre":  # learned positions: a long source is cut where qkv cuts it, outputs end where qkv's do
        import ctranslate2
        import sentencepiece as spm

        long = " ".join(["red cat dog sun tree blue"] * 8)  # 208 pieces, max_positions 128
        limits = info["decode"]["ctranslate2"]
        pieces = spm.SentencePieceProcessor(model_file=str(out / "source.spm")).encode(long, out_type=str)
        r = ctranslate2.Translator(str(out)).translate_batch([pieces], beam_size=1, max_decoding_length=127,
                                                             max_input_length=limits["max_input_length"])
        target = spm.SentencePieceProcessor(model_file=str(out / "target.spm")).decode(r[0].hypotheses[0])
        assert [target] == qkv_greedy(capsys, ckpt, [long])


def quantized_log_prob_bound(ckpt: Path, levels: int) -> float:
    """What a quantized model promises for the export's check (the largest |Δ log p| over the probe
    sequences), derived from the quantisation step rather than measured on one CPU. A matrix product
    with weights and activations rounded to ``levels`` steps each side of 0 (int8: 127, one scale per
    row; float16: a 10-bit mantissa, 1024) is off by at most half a step of each factor, together
    1/levels of its output's scale; the model's L matrices in sequence add that to first order, so a
    logit z is off by at most L · max|z| / levels and a log-probability (z_y - logsumexp z) by twice that.
    L counts every weight matrix of the model, more than any path through it has."""
    from qkv.export.reference import probe_sequences, reference_model, translation_logits
    from qkv.export.source import read_source

    src = read_source(ckpt)
    sources, targets = probe_sequences(src)
    largest = float(translation_logits(reference_model(src), sources, targets).abs().max())
    matrices = sum(1 for w in src.weights.values() if w.dim() == 2)
    return 2 * matrices * largest / levels


@needs_ct2
def test_ctranslate2_beam_is_qkv_beam_with_length_norm_length_and_early_stopping(trained, tmp_path, capsys):
    """On this model CTranslate2's beam search gives qkv's outputs under --length-norm length
    --early-stopping, given qkv's min_len (0) as min_decoding_length. (Here CTranslate2's default
    min_decoding_length 1 changes one of the seven outputs, and qkv's default stopping rule another.)
    The export's note says so for most outputs, not all (the next test: why not all)."""
    import ctranslate2
    import sentencepiece as spm

    ckpt = trained("post")
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "ct2")
    assert rc == 0, err
    out = tmp_path / "ct2"
    note = "its beam outputs are mostly, not always, qkv's with --length-norm length --early-stopping"
    assert note in err.splitlines()[-1]
    assert any(note in d for d in json.loads((out / "qkv_export.json").read_text())["decode"]["differences"])
    assert note in (out / "README.md").read_text()
    model = qkv.load(ckpt)
    cfg = dataclasses.replace(model.decode_cfg, length_norm="length", early_stopping=True)
    want = decode_sentences(model.model, model.tokenizers.src.encode(SENTENCES), cfg)
    translator = ctranslate2.Translator(str(out), intra_threads=1)
    source = spm.SentencePieceProcessor(model_file=str(out / "source.spm"))
    for sentence, hyps in zip(SENTENCES, want):
        pieces = source.encode(sentence, out_type=str)
        r = translator.translate_batch([pieces], beam_size=cfg.beam_size, length_penalty=cfg.length_penalty,
                                       max_decoding_length=budget(len(pieces)), min_decoding_length=cfg.min_len)
        assert r[0].hypotheses[0] == [model.tokenizers.tgt.id_to_piece(t) for t in hyps[0].tokens], sentence


@needs_ct2
@pytest.mark.parametrize("quantization", ["int8", "float16"])
def test_ctranslate2_quantized_models_load_and_translate(trained, tmp_path, capsys, quantization):
    rc, err = export(capsys, trained("post"), "ctranslate2", tmp_path / "q", "--quantization", quantization)
    assert rc == 0, err
    assert "reported, not checked" in err
    info = json.loads((tmp_path / "q" / "qkv_export.json").read_text())
    assert info["quantization"] == quantization and not info["verified"]["checked"]
    bound = quantized_log_prob_bound(trained("post"), 127 if quantization == "int8" else 1024)
    assert info["verified"]["max_abs_log_prob_difference"] <= bound  # close, not equal
    assert all(isinstance(h, str) for h in ct2_translate(tmp_path / "q", SENTENCES[:2]))


@needs_ct2
@pytest.mark.parametrize("which", ["trained", "fixture"])
def test_ctranslate2_generator_equals_qkv_greedy_generation(lm, tmp_path, capsys, which):
    import ctranslate2

    ckpt = lm if which == "trained" else FIXTURES / "lm-transformer"
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "lm")
    assert rc == 0, err
    model = qkv.load(ckpt)
    generator = ctranslate2.Generator(str(tmp_path / "lm"), intra_threads=1)
    vocab = json.loads((tmp_path / "lm" / "vocabulary.json").read_text())
    for prefix in ["", "red cat", "sun\ntree"]:
        ids = model.prompt_ids(prefix) if prefix else []
        want = list(sample(model.model, ids, 30, temperature=0.0))  # what `qkv generate --greedy` runs
        prompt = [vocab[i] for i in (ids or [BOS])]
        r = generator.generate_batch([prompt], max_length=30, sampling_topk=1, include_prompt_in_result=False,
                                     end_token=[])  # EOS is a line break in qkv's text stream
        assert r[0].sequences_ids[0] == want, prefix


@needs_ct2
def test_ctranslate2_prefix_lm_translates_as_qkv(tmp_path, capsys):
    import ctranslate2
    import sentencepiece as spm

    ckpt = FIXTURES / "prefix_lm-transformer"
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "p")
    assert rc == 0, err
    info = json.loads((tmp_path / "p" / "qkv_export.json").read_text())
    assert info["runtime"] == "ctranslate2.Generator" and info["prompt"][1:] == ["</s>", "<sep>", "<s>"]
    generator = ctranslate2.Generator(str(tmp_path / "p"), intra_threads=1)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "p" / "spm.model"))
    sentences = ["red cat", "the big dog sun", "small tree"]
    got = []
    for s in sentences:
        pieces = sp.encode(s, out_type=str)
        r = generator.generate_batch([pieces + ["</s>", "<sep>", "<s>"]], max_length=budget(len(pieces)),
                                     sampling_topk=1, include_prompt_in_result=False, end_token="</s>")
        got.append(sp.decode(r[0].sequences[0]))
    assert got == qkv_greedy(capsys, ckpt, sentences)
    assert sp.id_to_piece(SEP) == "<sep>"


# --- Hugging Face transformers ----------------------------------------------------------------------------

@needs_hf
@pytest.mark.parametrize("name", ["post", "separate"])
def test_hf_marian_logits_and_greedy_generate_equal_qkv(trained, tmp_path, capsys, name):
    from transformers import MarianMTModel, MarianTokenizer

    from qkv.data.batching import collate

    ckpt = trained(name)
    rc, err = export(capsys, ckpt, "hf", tmp_path / "hf")
    assert rc == 0, err
    out = tmp_path / "hf"
    model = qkv.load(ckpt)
    tok = MarianTokenizer.from_pretrained(str(out))
    hf = MarianMTModel.from_pretrained(str(out)).eval()
    assert (out / "target_vocab.json").is_file() == (name == "separate")
    assert hf.config.decoder_start_token_id == BOS and hf.generation_config.decoder_start_token_id == BOS
    assert hf.generation_config.eos_token_id == EOS and hf.generation_config.num_beams == model.decode_cfg.beam_size

    # the tokenizer: qkv's ids, EOS appended
    enc = tok(SENTENCES, return_tensors="pt", padding=True)
    src_ids = model.tokenizers.src.encode(SENTENCES)
    refs = [target(s) for s in SENTENCES]
    tgt_ids = model.tokenizers.tgt.encode(refs)
    batch = collate(src_ids, tgt_ids)
    assert torch.equal(enc["input_ids"], batch.src)
    assert tok(text_target=refs)["input_ids"] == [t + [EOS] for t in tgt_ids]

    # teacher-forced logits on a padded batch
    with torch.inference_mode():
        want = model.model(batch.src, batch.tgt_in)
        got = hf(**enc, decoder_input_ids=batch.tgt_in).logits
    real = torch.zeros_like(batch.tgt_in, dtype=torch.bool)
    for i, t in enumerate(tgt_ids):
        real[i, : len(t) + 1] = True
    delta = float((got - want)[real].abs().max())
    assert delta < 1e-4, delta

    # greedy generate, each sentence with qkv's limit (its tokens, then EOS)
    greedy = decode_sentences(model.model, src_ids, dataclasses.replace(model.decode_cfg, beam_size=1))
    for i, ids in enumerate(src_ids):
        x = torch.tensor([ids + [EOS]])
        y = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), num_beams=1, do_sample=False,
                        max_new_tokens=budget(len(ids)) + 1)[0].tolist()
        assert y[0] == BOS
        assert [t for t in y[1:] if t != EOS] == greedy[i][0].tokens, SENTENCES[i]


@needs_hf
def test_hf_export_loads_without_qkv(trained, tmp_path, capsys):
    """A user with transformers and no qkv: the directory loads, tokenizes and generates."""
    rc, err = export(capsys, trained("post"), "hf", tmp_path / "hf")
    assert rc == 0, err
    code = textwrap.dedent(f"""
        import sys
        sys.modules["qkv"] = None  # any import of qkv now fails
        from transformers import MarianMTModel, MarianTokenizer
        tok = MarianTokenizer.from_pretrained({str(tmp_path / "hf")!r})
        model = MarianMTModel.from_pretrained({str(tmp_path / "hf")!r})
        batch = tok(["red cat", "dog"], return_tensors="pt", padding=True)
        out = model.generate(**batch, max_new_tokens=8)
        print(tok.batch_decode(out, skip_special_tokens=True))
        print([m for m in sys.modules if m.startswith("qkv")])
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "['qkv']"  # only the blocked entry


@needs_hf
def test_hf_model_card_and_generation_config(trained, data, tmp_path, capsys):
    import yaml

    test_src = write(tmp_path / "test.en", SENTENCES[:3])
    test_ref = write(tmp_path / "test.de", [target(s) for s in SENTENCES[:3]])
    rc, err = export(capsys, trained("post"), "hf", tmp_path / "hf", "--src", test_src, "--ref", test_ref,
                     "--license", "cc-by-4.0")
    assert rc == 0, err
    readme = (tmp_path / "hf" / "README.md").read_text()
    front = yaml.safe_load(readme.split("---\n")[1])
    assert front["language"] == ["en", "de"]  # from the training files' names, train.en / train.de
    assert front["license"] == "cc-by-4.0" and "translation" in front["tags"]
    assert "datasets" not in front  # the training files' paths name no data set
    assert front["metrics"] == ["bleu", "chrf"]
    results = front["model-index"][0]["results"]
    test_metrics = {m["type"]: m for m in results[0]["metrics"]}
    assert results[0]["dataset"]["name"] == "test.de"  # the test set, named after its file
    assert test_metrics["bleu"]["args"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert "chrF2|" in test_metrics["chrf"]["args"] or "nrefs:1" in test_metrics["chrf"]["args"]
    assert results[1]["dataset"]["name"] == "validation"
    assert '"max_steps": 40' in readme  # the training configuration
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["decoder_start_token_id"] == BOS and gen["forced_eos_token_id"] == EOS
    assert gen["suppress_tokens"] == [0, 1, 2] and gen["num_beams"] == 4 and gen["length_penalty"] == 0.6
    # qkv's stopping rule (early_stopping false), and qkv's limit for the longest training source:
    # max_len 256 (the default) tokens -> 1.0 * 256 + 50, then EOS
    assert gen["early_stopping"] is False and gen["max_new_tokens"] == 256 + 50 + 1


@needs_hf
def test_hf_beam_generate_stops_as_qkv_and_gives_its_outputs(trained, tmp_path, capsys):
    """generate() with the written generation_config: qkv's beam outputs (qkv ranking as Hugging Face
    does, length_norm length, the same alpha) and qkv's stopping rule, so a sentence's search ends
    soon after its best hypothesis, far below the length limit."""
    from transformers import MarianMTModel

    ckpt = trained("post")
    rc, err = export(capsys, ckpt, "hf", tmp_path / "hf")
    assert rc == 0, err
    model = qkv.load(ckpt)
    hf = MarianMTModel.from_pretrained(str(tmp_path / "hf")).eval()
    steps = []
    hf.model.decoder.register_forward_hook(lambda *_: steps.append(1))
    src_ids = model.tokenizers.src.encode(SENTENCES)
    cfg = dataclasses.replace(model.decode_cfg, length_norm="length")
    assert cfg.beam_size == hf.generation_config.num_beams == 4
    beam = decode_sentences(model.model, src_ids, cfg)
    for i, ids in enumerate(src_ids):
        x = torch.tensor([ids + [EOS]])
        for limit in (budget(len(ids)) + 1, None):  # qkv's limit for this sentence; the written one
            steps.clear()
            y = hf.generate(input_ids=x, attention_mask=torch.ones_like(x),
                            **({"max_new_tokens": limit} if limit else {}))[0].tolist()
            assert [t for t in y[1:] if t != EOS] == beam[i][0].tokens, SENTENCES[i]
            assert len(steps) < budget(len(ids)) // 2, (SENTENCES[i], len(steps))  # ended long before the limit


FIXTURE_SENTENCES = [" ".join(random.Random(i).choices(["red", "blue", "cat", "dog", "sun", "tree", "big", "small"],
                                                        k=1 + i % 6)) for i in range(50)]


@needs_ct2
def test_ctranslate2_beam_claim_is_what_holds_and_says_why(tmp_path, capsys):
    """The note (printed, in qkv_export.json and the card) claims beam agreement for most outputs, not all,
    and names the causes, each checked here on the fixture model, 50 sentences:

    * CTranslate2 ranks by log-probabilities renormalised over the tokens qkv never emits: its reported
      score of each output ended by </s> is log P' / |Y|^α, P' from the checkpoint's own logits with those
      columns left out of the softmax and |Y| counting </s>, to 1e-4; qkv's own-log-probability score of
      the same output differs from it (by more than 1e-3 on some);
    * with each sentence's qkv limit as max_decoding_length, the outputs are not all qkv's (--length-norm
      length --early-stopping): the old claim, all of them, fails here."""
    import ctranslate2
    import sentencepiece as spm
    from qkv.decoding import banned_ids

    ckpt = FIXTURES / "translate-transformer"
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "ct2")
    assert rc == 0, err
    out = tmp_path / "ct2"
    note = "its beam outputs are mostly, not always, qkv's with --length-norm length --early-stopping"
    assert note in err and "renormalised over the tokens qkv never emits" in err
    assert any(note in d for d in json.loads((out / "qkv_export.json").read_text())["decode"]["differences"])
    assert note in (out / "README.md").read_text()
    assert "beam outputs are qkv's with both" not in (out / "README.md").read_text()

    model = qkv.load(ckpt)
    cfg = dataclasses.replace(model.decode_cfg, length_norm="length", early_stopping=True)
    alpha, tgt, net = cfg.length_penalty, model.tokenizers.tgt, model.model.eval()
    ids = model.tokenizers.src.encode(FIXTURE_SENTENCES)
    want = [h[0].tokens for h in decode_sentences(model.model, ids, cfg)]
    translator = ctranslate2.Translator(str(out), intra_threads=1)
    source = spm.SentencePieceProcessor(model_file=str(out / "source.spm"))
    banned = list(banned_ids(tgt))
    equal, renorm_gap, checked = 0, 0.0, 0
    for x, sentence, ours in zip(ids, FIXTURE_SENTENCES, want):
        limit = budget(len(x))
        r = translator.translate_batch([source.encode(sentence, out_type=str)], beam_size=cfg.beam_size,
                                       length_penalty=alpha, max_decoding_length=limit, min_decoding_length=0,
                                       return_scores=True)[0]
        y = [tgt.sp.piece_to_id(p) for p in r.hypotheses[0]]
        equal += y == ours
        if len(y) >= limit:  # ended by the limit, without </s>
            continue
        with torch.no_grad():
            z = net(torch.tensor([x + [EOS]]), torch.tensor([[BOS] + y]))[0].double()  # (|y|+1, V)
        gold = torch.tensor(y + [EOS])[:, None]
        own = float(torch.log_softmax(z, -1).gather(1, gold).sum())
        z[:, banned] = -math.inf
        renormalised = float(torch.log_softmax(z, -1).gather(1, gold).sum())
        assert r.scores[0] == pytest.approx(renormalised / (len(y) + 1) ** alpha, abs=1e-4), sentence
        renorm_gap = max(renorm_gap, abs(r.scores[0] - own / (len(y) + 1) ** alpha))
        checked += 1
    assert checked >= 10 and renorm_gap > 1e-3
    assert 0 < equal < len(FIXTURE_SENTENCES), equal


def card_code_blocks(readme: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a model card: (language, code)."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", readme, flags=re.M | re.S)


@pytest.mark.skipif(not (HAS_CT2 and HAS_HF), reason=f"ctranslate2 and transformers are needed: {INSTALL}")
@pytest.mark.parametrize("fixture,fmt", [("translate-transformer", "hf"), ("translate-transformer", "ctranslate2"),
                                         ("lm-transformer", "ctranslate2"), ("prefix_lm-transformer", "ctranslate2"),
                                         ("classify-transformer", "ctranslate2"), ("mlm-transformer", "ctranslate2")])
def test_every_code_block_of_a_model_card_runs_as_written(tmp_path, capsys, fixture, fmt):
    """Each card's Python runs unchanged from the folder that holds the export (it names the export's
    folder, not a path of the exporting machine); its JSON parses; its bash is the install line."""
    rc, err = export(capsys, FIXTURES / fixture, fmt, tmp_path / "export")
    assert rc == 0, err
    blocks = card_code_blocks((tmp_path / "export" / "README.md").read_text(encoding="utf-8"))
    assert sorted(lang for lang, _ in blocks) == ["bash", "json", "python"], blocks
    for lang, code in blocks:
        if lang == "json":
            json.loads(code)
            continue
        if lang == "bash":
            assert code.startswith("pip install ") and code.count("\n") == 1, code
            continue
        result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, f"{fixture} {fmt} card:\n{code}\n{result.stderr[-2000:]}"
        assert result.stdout.strip(), f"{fixture} {fmt} card's code printed nothing"


# an absolute path in text: a leading separator (or ~/ or a drive) then a name and another separator
ABSOLUTE_PATH = re.compile(r"(?<![\w.)\]|])(?:/|~/|[A-Za-z]:[\\/])[\w.-]+[\\/]")


def installed_packages(code: str) -> set[str]:
    """The distributions (lower case) that the non-standard-library imports of ``code`` come from."""
    import ast
    from importlib.metadata import packages_distributions

    dists = packages_distributions()
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module.split(".")[0])
    return {d.lower() for m in modules - set(sys.stdlib_module_names) for d in dists[m]}


@pytest.mark.skipif(not (HAS_CT2 and HAS_HF), reason=f"ctranslate2 and transformers are needed: {INSTALL}")
def test_no_card_carries_a_path_of_the_exporting_machine_and_each_says_what_to_install(trained, lm, data, tmp_path,
                                                                                        capsys):
    """Every kind of card (HF and CTranslate2; translation, language model, prefix LM; with a test set, with
    quantized weights; runs whose data, checkpoint and export lie in the temp folder): no file of the
    export names the temp folder, the home folder, the working directory, the checkpoint's or the data's
    folders, nor any absolute path; the training data are named by file name; the card's install line
    names the packages its code imports (the runtime at the exported version or later) and not qkv."""
    import tempfile
    from importlib.metadata import version

    test_src = write(tmp_path / "test.en", SENTENCES[:3])
    test_ref = write(tmp_path / "test.de", [target(s) for s in SENTENCES[:3]])
    cases = [(FIXTURES / "translate-transformer", "hf", ()), (FIXTURES / "translate-transformer", "ctranslate2", ()),
             (FIXTURES / "lm-transformer", "ctranslate2", ()), (FIXTURES / "prefix_lm-transformer", "ctranslate2", ()),
             (trained("post"), "hf", ("--src", test_src, "--ref", test_ref, "--license", "cc-by-4.0")),
             (trained("post"), "ctranslate2", ("--src", test_src, "--ref", test_ref, "--quantization", "int8")),
             (lm, "ctranslate2", ())]
    private = {str(tmp_path), str(data["dir"]), tempfile.gettempdir() + os.sep, str(Path.home()) + os.sep,
               os.getcwd() + os.sep}
    for i, (ckpt, fmt, extra) in enumerate(cases):
        out = tmp_path / "exports" / f"model-{i}"
        rc, err = export(capsys, ckpt, fmt, out, *extra)
        assert rc == 0, err
        where = private | {str(ckpt.resolve().parent) + os.sep}
        texts = {f.name: f.read_text(encoding="utf-8") for f in out.iterdir()
                 if f.suffix in (".md", ".json", ".txt", ".vocab")}
        assert "README.md" in texts and "qkv_export.json" in texts
        for name, text in texts.items():
            assert not [w for w in where if w in text], (ckpt, fmt, name, [w for w in where if w in text])
            assert not ABSOLUTE_PATH.findall(text), (ckpt, fmt, name, ABSOLUTE_PATH.findall(text))
        readme = texts["README.md"]
        config = json.loads(card_code_blocks(readme.split("## Training configuration")[1])[0][1])
        if ckpt.parent.parent == data["dir"]:  # trained here: data named by their file names alone
            assert config["data"]["train"] in ("train.en/train.de", "text.txt"), config["data"]
        blocks = dict(card_code_blocks(readme))
        install = blocks["bash"].split()
        assert install[:2] == ["pip", "install"] and len(blocks["bash"].splitlines()) == 1, blocks["bash"]
        runtime = "transformers" if fmt == "hf" else "ctranslate2"
        assert f'"{runtime}>={version(runtime)}"' in install, install
        wanted = {p.strip('"').split(">=")[0].lower() for p in install[2:]}
        assert installed_packages(blocks["python"]) <= wanted, (installed_packages(blocks["python"]), wanted)
        assert "qkv" not in wanted and (fmt != "hf" or "torch" in wanted)  # MarianMTModel is a PyTorch model


@pytest.fixture(scope="module")
def numbers_run(tmp_path_factory):
    """A few updates on the embedded default task (English number words -> German), tiny model."""
    out = tmp_path_factory.mktemp("numbers") / "run"
    assert main(["train", "--out", str(out), "--preset", "tiny", "--max-steps", "4", "--eval-every", "4",
                 "--eval-bleu-samples", "20", "--max-tokens", "1024", "--threads", "1"]) == 0
    return out


def test_number_task_validates_by_exact_match(numbers_run):
    """One word a number: the run records and logs exact match, not a BLEU of 0."""
    records = [json.loads(line) for line in (numbers_run / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if "valid_loss" in r]
    assert valid and all(0.0 <= r["valid_exact"] <= 1.0 for r in valid)
    assert not any("valid_bleu" in r or "valid_chrf" in r for r in records)


def test_number_task_validation_line():
    from qkv.tasks.translate import TranslateTask

    assert TranslateTask().summary({"valid_exact": 0.985}) == "  exact 98.5%"
    assert TranslateTask().summary({"valid_bleu": 20.0, "valid_chrf": 40.0, "valid_exact": 0.25}) == \
        "  BLEU 20.00  chrF 40.00  exact 25.0%"


@needs_hf
def test_number_task_card_reports_exact_match(numbers_run, tmp_path, capsys):
    import yaml

    rc, err = export(capsys, numbers_run / "best", "hf", tmp_path / "hf")
    assert rc == 0, err
    readme = (tmp_path / "hf" / "README.md").read_text()
    front = yaml.safe_load(readme.split("---\n")[1])
    record = [json.loads(line) for line in (numbers_run / "metrics.jsonl").read_text().splitlines()][-1]
    assert front["language"] == ["en", "de"] and "datasets" not in front
    assert front["metrics"] == ["exact_match"]
    metrics = front["model-index"][0]["results"][0]["metrics"]
    assert [m["type"] for m in metrics] == ["exact_match", "perplexity"]
    assert metrics[0]["value"] == round(100 * record["valid_exact"], 2)
    assert "BLEU" not in readme.split("## Training configuration")[0]
    assert f"exact match {100 * record['valid_exact']:.2f}%" in readme


@needs_hf
def test_card_datasets_name_a_given_data_set(trained, tmp_path, capsys):
    import yaml

    rc, err = export(capsys, trained("post"), "hf", tmp_path / "hf", "--dataset", "wmt14")
    assert rc == 0, err
    front = yaml.safe_load((tmp_path / "hf" / "README.md").read_text().split("---\n")[1])
    assert front["datasets"] == ["wmt14"]


# --- what cannot be represented, and bad input ---------------------------------------------------------------

def assert_export_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err and "qkv export: error:" in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


@needs_hf
def test_hf_refuses_what_marian_cannot_compute_by_name(trained, lm, tmp_path, capsys):
    rc, err = export(capsys, trained("pre"), "hf", tmp_path / "a")
    assert_export_error(rc, err, "pre-norm", "norm_first", "post-norm only", "--format ctranslate2")
    rc, err = export(capsys, lm, "hf", tmp_path / "b")  # a language model: the Llama switches it lacks, by name
    assert_export_error(rc, err, "positional = 'sinusoidal'", "LlamaForCausalLM", "--format ctranslate2")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_hf_refuses_learned_positions_by_name():
    from qkv.export import hf
    from qkv.export.source import Source
    from qkv.errors import QkvError

    cfg = ModelConfig(positional="learned", src_vocab_size=10, tgt_vocab_size=10)
    src = Source(Path("runs/x/best"), cfg, None, None, {}, {}, None, "0")
    with pytest.raises(QkvError, match="positional = .learned., not sinusoidal"):
        hf.check(src)


@pytest.mark.parametrize("fixture", ["translate-lstm-general", "classify-bilstm"])
def test_unsupported_task_or_arch_is_refused_by_name(tmp_path, capsys, fixture):
    rc, err = export(capsys, FIXTURES / fixture, "ctranslate2", tmp_path / "o")
    task, arch = ("translate", "lstm") if fixture.startswith("translate") else ("classify", "lstm")
    assert_export_error(rc, err, f"'{task}' model with arch '{arch}'", "translate (transformer)", "classify (transformer)")
    assert not (tmp_path / "o").exists()


def test_bad_checkpoints_and_outputs_are_refused(tmp_path, capsys):
    ckpt = FIXTURES / "translate-transformer"
    rc, err = export(capsys, tmp_path / "missing", "ctranslate2", tmp_path / "o")
    assert_export_error(rc, err, "checkpoint not found")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    rc, err = export(capsys, tmp_path / "junk", "ctranslate2", tmp_path / "o")
    assert_export_error(rc, err, "is not a qkv checkpoint")
    rc, err = export(capsys, tmp_path / "junk" / "notes.txt", "ctranslate2", tmp_path / "o")
    assert_export_error(rc, err, "is a file, not a checkpoint directory")
    run = tmp_path / "run"
    (run / "last").mkdir(parents=True)
    rc, err = export(capsys, run, "ctranslate2", tmp_path / "o")
    assert_export_error(rc, err, "is a run directory")
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "junk")  # not empty
    assert_export_error(rc, err, "exists and is not empty")
    assert (tmp_path / "junk" / "notes.txt").read_text() == "hello"
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "junk" / "notes.txt")
    assert_export_error(rc, err, "exists and is not a directory")
    rc, err = export(capsys, ckpt, "hf", tmp_path / "o", "--quantization", "int8")
    assert_export_error(rc, err, "--quantization is for --format ctranslate2")
    rc, err = export(capsys, FIXTURES / "lm-transformer", "ctranslate2", tmp_path / "o", "--src", str(ckpt))
    assert_export_error(rc, err, "--src/--ref score a translation model")
    assert not (tmp_path / "o").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk", "run"]  # no temporary directory left behind


@pytest.mark.parametrize("fmt,package", [("ctranslate2", "ctranslate2"), ("hf", "transformers")])
def test_a_missing_package_names_the_install_command(tmp_path, capsys, monkeypatch, fmt, package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if it were not installed
    rc, err = export(capsys, FIXTURES / "translate-transformer", fmt, tmp_path / "o")
    assert_export_error(rc, err, f"needs the {package} package", INSTALL)
    assert not (tmp_path / "o").exists() and list(tmp_path.iterdir()) == []


def test_an_empty_out_directory_is_used(tmp_path, capsys):
    if not HAS_CT2:
        pytest.skip(f"ctranslate2 is not installed: {INSTALL}")
    (tmp_path / "o").mkdir()
    rc, err = export(capsys, FIXTURES / "translate-transformer", "ctranslate2", tmp_path / "o")
    assert rc == 0, err
    assert (tmp_path / "o" / "model.bin").is_file() and (tmp_path / "o" / "README.md").is_file()


def killed_exports(fmt: str, out: Path, times: int) -> list[str]:
    """Run ``qkv export`` ``times`` times as processes killed outright (SIGKILL, through the fault point
    ``export:NAME``: everything written, nothing renamed); the temporaries they leave beside ``out``."""
    env = {**os.environ, "QKV_FAULT": f"export:{out.name}@1", "OMP_NUM_THREADS": "1"}
    for _ in range(times):
        proc = subprocess.run([sys.executable, "-m", "qkv", "export", str(FIXTURES / "translate-transformer"),
                               "--format", fmt, "--out", str(out)], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == -9, proc.stderr
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-"))


@pytest.mark.parametrize("fmt", ["ctranslate2", "hf"])
def test_the_temporaries_of_killed_exports_are_removed_by_the_next_export(tmp_path, capsys, fmt):
    """kill -9 leaves an export's temporary directory (nothing can remove it then); it is named by the
    process's pid, and the next export to the same place removes those whose process is gone, as
    translate and preprocess do. A live process's temporary is left alone."""
    if not (HAS_CT2 if fmt == "ctranslate2" else HAS_HF):
        pytest.skip(f"{fmt} is not installed: {INSTALL}")
    out = tmp_path / "exported"
    seen = []
    for _ in range(2 if fmt == "ctranslate2" else 1):  # each killed export removes the one killed before it
        left = killed_exports(fmt, out, 1)
        assert len(left) == 1 and left[0] not in seen and not out.exists(), (left, seen)
        seen += left
    live = tmp_path / f".exported.tmp-{os.getpid()}-abcdefgh"  # this test's own process: alive
    live.mkdir()
    rc, err = export(capsys, FIXTURES / "translate-transformer", fmt, out)
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "exported"]


@needs_hf
def test_an_hf_export_makes_no_temporary_outside_its_own_directory(tmp_path, capsys, monkeypatch):
    """Every temporary file or directory an export makes lies beside its --out, where the next export
    finds it: none in the system temp folder, where a killed export would leave it for good."""
    import tempfile

    made = []
    for name in ("mkdtemp", "mkstemp"):
        real = getattr(tempfile, name)
        monkeypatch.setattr(tempfile, name, lambda *a, _real=real, **k: made.append(_real(*a, **k)) or made[-1])
    out = tmp_path / "hf"
    rc, err = export(capsys, FIXTURES / "translate-transformer", "hf", out)
    assert rc == 0, err
    paths = [Path(m if isinstance(m, str) else m[1]) for m in made]
    assert paths and all(p.parent == tmp_path for p in paths), paths
    assert not (out / ".tokenizer-inputs").exists()


def test_the_core_does_not_import_the_export_packages():
    code = ("import sys, qkv, qkv.cli, qkv.export; "
            "print(sorted(m for m in ('ctranslate2', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


def test_the_command_offers_what_the_library_does():
    import argparse

    from qkv.cli import COMMANDS, main as _main  # noqa: F401
    from qkv.cli_options import build_parser
    from qkv.export import FORMATS, QUANTIZATIONS

    parser = build_parser({name: (lambda args: 0) for name in COMMANDS})
    export_parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["export"]
    choices = {a.dest: a.choices for a in export_parser._actions if a.choices}
    assert tuple(choices["format"]) == FORMATS and tuple(choices["quantization"]) == QUANTIZATIONS
