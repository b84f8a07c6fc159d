"""qkv import of BartForConditionalGeneration (qkv.importers.bart): BART is the paper's encoder-decoder with
learned positions from row 2, a LayerNorm on each stack's embeddings, GELU and a final_logits_bias. The folder
is built with transformers' own classes (a tiny BartConfig, a byte-level BPE tokenizer.json with RoBERTa's
post-processor), trained a little in transformers so that outputs depend on the source and end at several
lengths, its norms and biases perturbed. The import's encoder states and logits are transformers' within 1e-4
on a padded batch; greedy and beam outputs are generate()'s token for token; cached incremental decoding is
the full forward; the commands take it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from encoder_families import byte_bpe, roberta_processing, transformers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EN = ["A man in a blue shirt is standing on a ladder.", "Two dogs play in the snow.",
      "A little girl climbs into a wooden playhouse.", "People are walking down the street at night.",
      "A woman with a red hat sells fruit at the market.", "The children are playing football in the park."]
DE = ["Ein Mann in einem blauen Hemd steht auf einer Leiter.", "Zwei Hunde spielen im Schnee.",
      "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.", "Menschen gehen nachts die Straße entlang.",
      "Eine Frau mit rotem Hut verkauft Obst auf dem Markt.", "Die Kinder spielen Fußball im Park."]
SAMPLE = ["Größere Häuser: café, naïve 🎉", "Two dogs.", "A man is standing at night in the park."]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
NAMES = {"bos": "<s>", "eos": "</s>", "cls": "<s>", "sep": "</s>", "pad": "<pad>", "unk": "<unk>", "mask": "<mask>"}


def build_bart(path, train_steps: int = 60):
    tok = byte_bpe(SPECIALS, roberta_processing, EN + DE + SAMPLE)  # the BPE learns the pairs' words
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": v for k, v in NAMES.items()})
    cfg = transformers.BartConfig(vocab_size=tok.get_vocab_size(), d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                  decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                  decoder_start_token_id=2, forced_eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg)
    batch = fast(EN, text_target=DE, padding=True, return_tensors="pt")
    batch["labels"][batch["labels"] == fast.pad_token_id] = -100
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(train_steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.05)
        model.final_logits_bias.normal_(0, 0.5)
        model.final_logits_bias[0, 2] = 1.0  # </s>
    model.generation_config.update(num_beams=4, max_length=60)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path, model, fast


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    from qkv.importers import import_model

    root = tmp_path_factory.mktemp("bart")
    path, model, tok = build_bart(root / "hf")
    import_model(path, root / "q", log=lambda s: None)
    return path, model, tok, root / "q"


def to_model(tr, ids: torch.Tensor) -> torch.Tensor:
    """qkv ids -> the model's (qkv's BOS row is the decoder's start token, </s>)."""
    from qkv.config import BOS, PAD

    m = [x if x is not None else -1 for x in tr.tokenizers.src.to_model_ids(range(tr.tokenizers.src.vocab_size))]
    m[BOS], m[PAD] = 2, 1
    return torch.tensor(m)[ids]


def test_token_ids_equal_the_tokenizers(bart):
    import qkv
    from qkv.data.batching import collate

    _, _, tok, out = bart
    tr = qkv.load(out)
    batch = collate(tr.tokenizers.src.encode(EN + SAMPLE), tr.tokenizers.tgt.encode(DE + SAMPLE))
    want = tok(EN + SAMPLE, padding=True, return_tensors="pt")["input_ids"]
    assert torch.equal(to_model(tr, batch.src), want)  # <s> X </s>, padded
    labels = tok(text_target=DE + SAMPLE, padding=True, return_tensors="pt")["input_ids"]
    assert torch.equal(to_model(tr, batch.tgt_out), labels)  # the target: <s> Y </s>, BART's labels
    assert tr.translate([""], beam_size=1) is not None


def test_hidden_states_and_logits_equal_transformers(bart):
    import qkv
    from qkv.config import PAD
    from qkv.data.batching import collate

    _, hf, _, out = bart
    tr = qkv.load(out)
    cfg = tr.model.cfg
    assert (cfg.position_offset, cfg.embedding_norm, cfg.scale_embeddings, cfg.activation, cfg.output_bias) == \
        (2, True, False, "gelu", True)
    batch = collate(tr.tokenizers.src.encode(EN[:4]), tr.tokenizers.tgt.encode(DE[:4]))
    assert (batch.src == PAD).any() and (batch.tgt_in == PAD).any()
    with torch.inference_mode():
        ref = hf(input_ids=to_model(tr, batch.src), attention_mask=batch.src != PAD,
                 decoder_input_ids=to_model(tr, batch.tgt_in), decoder_attention_mask=batch.tgt_in != PAD)
        memory, _, _ = tr.model.encode(batch.src)
        logits = tr.model(batch.src, batch.tgt_in)
    assert float((memory - ref.encoder_last_hidden_state)[batch.src != PAD].abs().max()) < 1e-4
    cols = [q for q, m in enumerate(tr.tokenizers.src.to_model_ids(range(logits.size(-1)))) if m is not None]
    model_cols = [tr.tokenizers.src.ids.model_ids[q] for q in cols]
    real = batch.tgt_in != PAD
    real[:, 0] = True
    assert float((logits[..., cols] - ref.logits[..., model_cols])[real].abs().max()) < 1e-4
    assert ref.logits.abs().max() > 1.0


def test_cached_incremental_decoding_equals_the_full_forward(bart):
    """start + step, one position at a time from the caches, gives the logits of the whole target at once."""
    import qkv
    from qkv.data.batching import collate

    _, _, _, out = bart
    tr = qkv.load(out)
    batch = collate(tr.tokenizers.src.encode(EN[:3]), tr.tokenizers.tgt.encode(DE[:3]))
    model = tr.model.eval()
    with torch.inference_mode():
        full = model(batch.src, batch.tgt_in)
        state = model.start(batch.src)
        steps = []
        for t in range(batch.tgt_in.size(1)):
            logits, state = model.step(batch.tgt_in[:, t], state)
            steps.append(logits)
    real = batch.tgt_in != 0
    real[:, 0] = True
    assert float((torch.stack(steps, 1) - full)[real].abs().max()) < 1e-4


def hf_generate(hf, tr, texts, num_beams, max_new_tokens):
    """generate() on qkv's inputs under qkv's settings: <pad>, <unk> and <mask> never emitted (qkv emits no special
    piece but EOS), EOS forced at the limit, lengths normalised by |Y| (length_penalty 1)."""
    from qkv.config import EOS, MASK, PAD, UNK
    from qkv.data.batching import collate

    model_ids = tr.tokenizers.src.ids.model_ids
    src = to_model(tr, collate(tr.tokenizers.src.encode(texts), None).src)
    out = hf.generate(input_ids=src, attention_mask=src != 1, num_beams=num_beams, length_penalty=1.0,
                      early_stopping=False, max_new_tokens=max_new_tokens, do_sample=False, no_repeat_ngram_size=0,
                      repetition_penalty=1.0, renormalize_logits=False, forced_bos_token_id=None,
                      bad_words_ids=[[model_ids[PAD]], [model_ids[UNK]], [model_ids[MASK]]],
                      forced_eos_token_id=model_ids[EOS])
    back = tr.tokenizers.src.ids.to_qkv
    result = []
    for row in out.tolist():
        ids = [back[m] for m in row[1:]]
        result.append(ids[: ids.index(EOS)] if EOS in ids else [i for i in ids if i != PAD])
    return result


@pytest.mark.parametrize("beam, limit", [(1, 25), (4, 40)])
def test_greedy_and_beam_equal_generate(bart, beam, limit):
    import qkv
    from qkv.decoding.batch import decode_sentences
    from qkv.decoding.greedy import banned_ids

    _, hf, _, out = bart
    tr = qkv.load(out)
    texts = EN + SAMPLE
    want = hf_generate(hf, tr, texts, beam, limit + 1)
    cfg = tr.decode_cfg.__class__(beam_size=beam, length_penalty=1.0, length_norm="length", max_len_a=0,
                                  max_len_b=limit, early_stopping=False)
    best = decode_sentences(tr.model, tr.tokenizers.src.encode(texts), cfg, banned_ids(tr.tokenizers.tgt))
    got = [n[0].tokens for n in best]
    assert got == want
    assert len({len(g) for g in got}) > 1 and len(set(map(tuple, got))) > 4  # several lengths, source-dependent
    if beam > 1:
        assert max(len(g) for g in got) < limit


def test_the_commands_take_the_import(bart, tmp_path):
    """translate (the CLI), score, viz attention, serve's /translate; the translation is the model's own text
    (the <s> it writes first is not shown)."""
    import qkv
    from qkv.cli import main

    _, _, tok, out = bart
    tr = qkv.load(out)
    want = tr.translate(EN[:2], beam_size=1)
    assert want[1] == DE[1]  # the model learned its pairs in transformers: the import translates them
    r = subprocess.run([sys.executable, "-m", "qkv", "translate", str(out), "--beam-size", "1", *EN[:2]],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == want
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text("\n".join(EN[:3]) + "\n")
    tgt.write_text("\n".join(DE[:3]) + "\n")
    assert main(["score", str(out), "--src", str(src), "--tgt", str(tgt), "--output", str(tmp_path / "s.txt")]) == 0
    assert len((tmp_path / "s.txt").read_text().splitlines()) == 3
    assert main(["viz", "attention", str(out), EN[1], "--target", DE[1], "--out", str(tmp_path / "att")]) == 0
    assert (tmp_path / "att.html").is_file()
    from import_folders import served

    with served(out) as c:
        r = c.post("/translate", json={"texts": EN[:2], "beam_size": 1})
        assert r.status_code == 200, r.text
        assert [x["hypotheses"][0]["text"] for x in r.json()["results"]] == want


def test_score_is_transformers_log_probability(bart, tmp_path):
    """qkv's score of a pair is the sum of transformers' log-probabilities of BART's labels (<s> Y </s>): the
    rows qkv adds take no probability."""
    import qkv

    _, hf, tok, out = bart
    tr = qkv.load(out)
    got = tr.score(EN[:2], DE[:2])
    enc = tok(EN[:2], text_target=DE[:2], padding=True, return_tensors="pt")
    with torch.inference_mode():
        logp = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                  labels=enc["labels"]).logits.log_softmax(-1)
    for i in range(2):
        labels = enc["labels"][i][enc["labels"][i] != 1]
        want = float(logp[i, torch.arange(len(labels)), labels].sum())
        assert len(got[i]) == len(labels) and abs(sum(got[i]) - want) < 1e-3


def test_finetune_from_the_import_within_its_positions(bart, tmp_path):
    """qkv train --init-from the import (64 positions) with the default max_len: it trains, keeps BART's switches
    and tokenizer, and translates."""
    _, _, _, out = bart
    d = tmp_path
    (d / "train.en").write_text("\n".join(EN * 3) + "\n")
    (d / "train.de").write_text("\n".join(DE * 3) + "\n")
    r = subprocess.run([sys.executable, "-m", "qkv", "train", "--init-from", str(out), "--src-train", str(d / "train.en"),
                        "--tgt-train", str(d / "train.de"), "--src-valid", str(d / "train.en"), "--tgt-valid",
                        str(d / "train.de"), "--max-steps", "2", "--eval-every", "2", "--max-tokens", "600",
                        "--schedule", "constant", "--lr", "0.0001", "--out", str(d / "run"), "--threads", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((d / "run" / "last" / "config.json").read_text())
    assert cfg["model"]["position_offset"] == 2 and cfg["model"]["embedding_norm"] and cfg["train"]["max_len"] <= 63
    import qkv

    assert len(qkv.load(d / "run" / "last").translate(EN[:2], beam_size=1)) == 2


def test_mbart_is_refused_by_name(bart, tmp_path):
    import shutil

    from qkv.importers import ImportRefused, convert

    path, _, _, _ = bart
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "mbart",
                                                            "architectures": ["MBartForConditionalGeneration"]}))
    with pytest.raises(ImportRefused, match="MBartForConditionalGeneration is not supported: .*language code"):
        convert(tmp_path / "m")
