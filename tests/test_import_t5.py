"""Importing Hugging Face T5ForConditionalGeneration folders (T5 v1: ReLU, head tied and scaled; v1.1 /
Flan-T5: gated-GELU, untied head) as qkv translation models: the paper's encoder-decoder with relative
position buckets (bidirectional in the encoder, causal in the decoder, one table per stack), RMSNorm,
no 1/sqrt(d_k), no biases, and T5's decoder start (its pad token) through qkv's id map.

The folders are built by transformers' own classes with random weights (2 layers, d_model 32, 4
heads), norm gains perturbed, saved by ``save_pretrained``, with a SentencePiece Unigram tokenizer
saved as tokenizer.json; a v1.1 folder gets its own lm_head, as Flan-T5's files have it. The
references are transformers' classes on those folders.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

HAS_HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("tokenizers") is not None
pytestmark = pytest.mark.skipif(not HAS_HF, reason="transformers and tokenizers are not installed")

TEXT = ["The Time Traveller (for so it will be convenient to speak of him) was expounding a recondite matter to us.",
        "His grey eyes shone and twinkled, and his usually pale face was flushed and animated.",
        "The fire burned brightly, and the soft radiance of the incandescent lights caught the bubbles."]
SOURCES = ["The fire burned", "His grey eyes shone and twinkled", "a recondite matter to us", "Time"]


def unigram_tokenizer(out: Path):
    """T5's kind: a SentencePiece Unigram (Metaspace) with <pad> </s> <unk> at 0 1 2 and "$A </s>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=150, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(TEXT * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out))
    return fast


def build(out: Path, version: str, seed: int = 0) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    tok = unigram_tokenizer(out)
    torch.manual_seed(seed)
    v1 = version == "v1"
    cfg = T5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=20,
                   feed_forward_proj="relu" if v1 else "gated-gelu", tie_word_embeddings=v1,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=2.0,
                   architectures=["T5ForConditionalGeneration"])
    model = T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.eval().save_pretrained(str(out))
    if not v1:  # Flan-T5's files: an lm_head of its own, tie_word_embeddings false
        weights = load_file(str(out / "model.safetensors"))
        weights["lm_head.weight"] = torch.randn_like(weights["shared.weight"])
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        config["tie_word_embeddings"] = False
        (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=["v1", "v1.1"])
def folder(request, tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("t5") / request.param, request.param)


def reference(folder: Path):
    from transformers import PreTrainedTokenizerFast, T5ForConditionalGeneration

    return T5ForConditionalGeneration.from_pretrained(str(folder)).eval(), PreTrainedTokenizerFast.from_pretrained(str(folder))


def test_settings(folder):
    from qkv.importers import convert

    cfg = convert(folder).model_cfg
    v1 = folder.name == "v1"
    assert (cfg.task, cfg.positional, cfg.norm, cfg.attention_scale, cfg.qkv_bias, cfg.ffn_gated, cfg.activation) == \
        ("translate", "relative", "rmsnorm", False, False, not v1, "relu" if v1 else "gelu_tanh")
    assert (cfg.relative_buckets, cfg.relative_max_distance, cfg.tie_output) == (8, 20, False)


def test_decoder_logits_equal_transformers_on_padded_batches(folder):
    """Teacher-forced logits of right-padded sources and targets, at every real target position, within 1e-4."""
    import qkv
    from qkv.config import BOS, EOS, PAD

    hf, tok = reference(folder)
    tr = qkv.load(folder)
    t = tr.tokenizers.src
    src_ids = [x + [EOS] for x in t.encode(SOURCES)]
    tgt_ids = [[BOS] + x for x in t.encode(list(reversed(SOURCES)))]
    pad = lambda rows: torch.tensor([r + [PAD] * (max(map(len, rows)) - len(r)) for r in rows])  # noqa: E731
    src, tgt = pad(src_ids), pad(tgt_ids)
    assert [t.to_model_ids(r) for r in src_ids] == tok(SOURCES)["input_ids"]  # </s> last, as T5's tokenizer
    model_ids = torch.tensor([m if m is not None else 0 for m in t.ids.model_ids])
    have = torch.tensor([m is not None for m in t.ids.model_ids])
    with torch.inference_mode():
        want = hf(input_ids=model_ids[src], attention_mask=(src != PAD).long(), decoder_input_ids=model_ids[tgt],
                  decoder_attention_mask=(tgt != PAD).long()).logits[..., model_ids]
        got = tr.model(src, tgt)
    real = tgt != PAD
    diff = float((got - want)[real][:, have].abs().max())
    print(f"max |qkv - transformers| {diff:.2e}, logits std {float(want[real].std()):.2f}")
    assert diff <= 1e-4, diff
    assert want[real].std() > 1.0


def test_greedy_equals_generate_and_cached_steps_equal_the_forward(folder):
    import qkv
    from qkv.config import EOS, PAD
    from qkv.decoding.greedy import banned_ids, greedy

    hf, tok = reference(folder)
    tr = qkv.load(folder)
    t = tr.tokenizers.src
    model = tr.model.eval()
    src_ids = [x + [EOS] for x in t.encode(SOURCES)]
    src = torch.tensor([r + [PAD] * (max(map(len, src_ids)) - len(r)) for r in src_ids])
    with torch.inference_mode():
        got = greedy(model, src, 12, banned=banned_ids(t))
    suppress = [i for i in t.to_model_ids(banned_ids(t)) if i is not None]  # qkv never emits <pad>, <unk>
    outputs = set()
    for row, ids in zip(got, src_ids):
        x = torch.tensor([t.to_model_ids(ids)])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1, max_new_tokens=13,
                          suppress_tokens=suppress)[0, 1:].tolist()  # without the decoder start
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id)]
        assert t.to_model_ids(row) == out[:12]
        outputs.add(tuple(row))
    assert len(outputs) >= 3
    with torch.inference_mode():  # the cached steps (relative bias at each step's position) = the full forward
        tgt = torch.tensor([[2] + got[0][:6]])
        full = model(src[:1], tgt)
        state = model.start(src[:1])
        for i in range(tgt.size(1)):
            logits, state = model.step(tgt[:, i], state)
            assert torch.allclose(logits, full[:, i], atol=1e-4)


def test_translate_api_and_import_command(folder, tmp_path, capsys):
    import qkv
    from qkv.cli import main

    hf, tok = reference(folder)
    capsys.readouterr()
    assert main(["import", str(folder), "--out", str(tmp_path / "t5")]) == 0
    tr = qkv.load(tmp_path / "t5")
    out = tr.translate(SOURCES[:2], beam_size=1)
    assert all(isinstance(s, str) for s in out) and out == qkv.load(folder).translate(SOURCES[:2], beam_size=1)


@pytest.mark.parametrize("change, refused", [
    ({"d_kv": 16}, "d_kv = 16"),
    ({"decoder_start_token_id": 1}, "decoder_start_token_id = 1"),
    ({"feed_forward_proj": "gated-tanh"}, "feed_forward_proj 'gated-tanh'"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, change, refused):
    from qkv.importers import ImportRefused, convert

    folder = build(tmp_path / "v1", "v1")
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ImportRefused, match=refused):
        convert(folder)


@pytest.mark.parametrize("max_length", [None, 9])
def test_translate_cuts_outputs_where_generate_does(tmp_path, max_length):
    """The folder's search (greedy; max_length counting the decoder start, or transformers' 20 new tokens where
    the folder sets none) gives the text transformers' generate() gives, on outputs the length limit cuts."""
    import qkv
    from qkv.decoding.greedy import banned_ids

    folder = build(tmp_path / "v1.1", "v1.1", seed=3)
    if max_length is not None:
        gen = json.loads((folder / "generation_config.json").read_text())
        (folder / "generation_config.json").write_text(json.dumps({**gen, "max_length": max_length}))
    hf, tok = reference(folder)
    tr = qkv.load(folder)
    t = tr.tokenizers.src
    suppress = [i for i in t.to_model_ids(banned_ids(t)) if i is not None]
    cut = 0
    for source in SOURCES[:2]:
        x = tok([source], return_tensors="pt")
        out = hf.generate(**x, suppress_tokens=suppress)[0].tolist()
        cut += tok.eos_token_id not in out  # the limit ended it
        assert tr.translate([source])[0] == tok.decode(out, skip_special_tokens=True)
    assert cut, "no output reached the length limit"


def test_the_commands_take_the_import(folder, tmp_path, capsys):
    """translate (the CLI: the API's greedy), score (transformers' log-probabilities of T5's labels, target
    </s>), evaluate, serve's /translate and /score, and viz attention: the encoder's, the decoder's masked and
    the cross-attention weights of every layer and head, relative-position buckets in the first two, are
    transformers' (eager)."""
    import qkv
    from qkv.cli import main
    from qkv.importers import import_model
    from qkv.viz import attention_data

    from import_folders import eager, max_map_difference, rows_sum_to_one, served

    out = tmp_path / "q"
    import_model(folder, out, log=lambda s: None)
    tr = qkv.load(out)
    hf, tok = reference(folder)
    want = tr.translate(SOURCES[:2], beam_size=1)
    capsys.readouterr()
    assert main(["translate", str(out), "--beam-size", "1", *SOURCES[:2]]) == 0
    assert capsys.readouterr().out.splitlines() == want

    targets = list(reversed(SOURCES))
    got = tr.score(SOURCES, targets)
    enc = tok(SOURCES, text_target=targets, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logp = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                  labels=enc["labels"]).logits.log_softmax(-1)
    totals = []
    for i in range(len(SOURCES)):
        labels = enc["labels"][i][enc["labels"][i] != tok.pad_token_id]  # the target's pieces, </s>
        totals.append(float(logp[i, torch.arange(len(labels)), labels].sum()))
        assert len(got[i]) == len(labels) and abs(sum(got[i]) - totals[i]) < 1e-3
    (tmp_path / "src.txt").write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    (tmp_path / "tgt.txt").write_text("\n".join(targets) + "\n", encoding="utf-8")
    assert main(["score", str(out), "--src", str(tmp_path / "src.txt"), "--tgt", str(tmp_path / "tgt.txt"),
                 "--output", str(tmp_path / "scores.txt")]) == 0
    lines = (tmp_path / "scores.txt").read_text().splitlines()
    assert len(lines) == len(totals)
    assert all(abs(float(line.split("\t")[0]) - t) < 1e-3 for line, t in zip(lines, totals))

    assert main(["evaluate", str(out), "--src", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "tgt.txt"),
                 "--beam-size", "1"]) == 0
    assert "BLEU" in capsys.readouterr().out

    with served(out) as client:
        r = client.post("/translate", json={"texts": SOURCES[:2], "beam_size": 1})
        assert r.status_code == 200, r.text
        assert [x["hypotheses"][0]["text"] for x in r.json()["results"]] == want
        r = client.post("/score", json={"sources": SOURCES, "targets": targets})
        assert r.status_code == 200, r.text
        assert all(abs(x["logprob"] - t) < 1e-3 for x, t in zip(r.json()["results"], totals))

    source, target = TEXT[1], SOURCES[1]
    data = attention_data(tr, source, target)
    src = tok([source], return_tensors="pt")["input_ids"]
    tgt = torch.cat([torch.zeros(1, 1, dtype=torch.long), tok([target], add_special_tokens=False,
                                                               return_tensors="pt")["input_ids"]], 1)
    assert (len(data["tokens"]["source"]), len(data["tokens"]["target"])) == (src.size(1), tgt.size(1))
    with torch.inference_mode():
        ref = eager(hf)(input_ids=src, decoder_input_ids=tgt, output_attentions=True)
    for kind, want_maps in (("encoder", ref.encoder_attentions), ("decoder_self", ref.decoder_attentions),
                            ("cross", ref.cross_attentions)):
        maps = data["weights"][kind]
        assert len(maps) == 2 and len(maps[0]) == 4, kind
        assert max_map_difference(maps, want_maps) < 1e-5 and rows_sum_to_one(maps), kind
    assert main(["viz", "attention", str(out), source, "--target", target, "--out", str(tmp_path / "att")]) == 0
    assert (tmp_path / "att.html").is_file() and (tmp_path / "att.png").is_file()


def test_finetune_from_the_import_keeps_its_switches(folder, tmp_path, capsys):
    """qkv train --init-from a T5 import on a few pairs: every tensor continues (none new), and the relative
    positions, RMSNorm, T5's FFN, the unscaled attention and the tokenizer stay."""
    import qkv
    from qkv.checkpoint import read_checkpoint, read_config
    from qkv.cli import main
    from qkv.importers import import_model

    import_model(folder, tmp_path / "q", log=lambda s: None)
    (tmp_path / "src.txt").write_text("\n".join(SOURCES * 3) + "\n", encoding="utf-8")
    (tmp_path / "tgt.txt").write_text("\n".join(reversed(SOURCES * 3)) + "\n", encoding="utf-8")
    files = ["--src-train", "src.txt", "--tgt-train", "tgt.txt", "--src-valid", "src.txt", "--tgt-valid", "tgt.txt"]
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--init-from", str(tmp_path / "q"), *[str(tmp_path / f) if f.endswith(".txt") else f
                                                                for f in files],
                 "--max-steps", "2", "--eval-every", "2", "--schedule", "constant", "--lr", "0.001",
                 "--out", str(out), "--threads", "1"]) == 0
    logged = capsys.readouterr()
    assert "new: none" in logged.out + logged.err
    a, b = read_checkpoint(tmp_path / "q"), read_checkpoint(out / "last")
    want, cfg = read_config(a, "model"), read_config(b, "model")
    fields = ("positional", "relative_buckets", "relative_max_distance", "norm", "norm_bias", "ffn_gated", "activation",
              "ffn_bias", "qkv_bias", "out_bias", "attention_scale", "output_bias", "tie_output")
    assert [getattr(cfg, f) for f in fields] == [getattr(want, f) for f in fields]
    assert (cfg.positional, cfg.norm, cfg.ffn_gated) == ("relative", "rmsnorm", folder.name != "v1")
    moved = [n for n in a.state_dict if not torch.equal(a.state_dict[n], b.state_dict[n])]
    assert set(a.state_dict) == set(b.state_dict) and len(moved) > len(a.state_dict) // 2
    assert (out / "last" / "tokenizer.json").read_bytes() == (tmp_path / "q" / "tokenizer.json").read_bytes()
    assert len(qkv.load(out / "last").translate(SOURCES[:2], beam_size=1)) == 2
