"""Importing a Hugging Face GPT2LMHeadModel folder as a qkv language model.

The folder is built as GPT-2's looks: a GPT2Config with GPT-2's options (pre-norm blocks, ln_f,
gelu_new, learned positions, tied output, ``<|endoftext|>`` last in the vocabulary) at a test's
size, a byte-level BPE trained on a small text and saved by ``GPT2TokenizerFast.save_pretrained``
(tokenizer.json), weights trained a little in transformers (so that greedy continuations are not
ties among near-uniform logits). The references are transformers' ``GPT2LMHeadModel`` and
``GPT2TokenizerFast`` on that folder.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

INSTALL = 'pip install -c constraints.txt -e ".[export]"'
HAS_HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("tokenizers") is not None
pytestmark = pytest.mark.skipif(not HAS_HF, reason=f"transformers and tokenizers are not installed: {INSTALL}")

TEXT = ["The Time Traveller (for so it will be convenient to speak of him) was expounding a recondite matter to us.",
        "His grey eyes shone and twinkled, and his usually pale face was flushed and animated.",
        "The fire burned brightly, and the soft radiance of the incandescent lights in the lilies of silver caught "
        "the bubbles that flashed and passed in our glasses.",
        "Größere Häuser, café, naïve façade.", "東京で寿司を食べました。", "Emoji: 💖 🎉"]
# accents, CJK, emoji, long words, several spaces, line breaks, a special token written in the text
SAMPLE = ["Größere Häuser: café, naïve, Ærø.", "東京で寿司を食べました。", "I 💖 emoji 🎉!",
          "Donaudampfschifffahrtsgesellschaftskapitänswitwe antidisestablishmentarianism",
          "   spaces   around   ", "two\nlines", "end<|endoftext|>start", ""]


def build_gpt2(out: Path, seed: int = 0, train_steps: int = 40) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT * 5, vocab_size=400, min_frequency=1, show_progress=False)
    t = out / "bpe"
    t.mkdir()
    bpe.save_model(str(t))
    tok = GPT2TokenizerFast(vocab=str(t / "vocab.json"), merges=str(t / "merges.txt"))
    for f in t.iterdir():
        f.unlink()
    t.rmdir()
    tok.save_pretrained(str(out))
    tok = GPT2TokenizerFast.from_pretrained(str(out))
    eos = tok.eos_token_id
    assert eos == len(tok) - 1 and len(tok) > 300  # as GPT-2's 50256: the last id of a real vocabulary
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                     activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                     layer_norm_epsilon=1e-5, bos_token_id=eos, eos_token_id=eos, architectures=["GPT2LMHeadModel"])
    model = GPT2LMHeadModel(cfg)
    ids = [tok(x)["input_ids"][:60] + [eos] for x in TEXT]
    width = max(map(len, ids))
    batch = torch.tensor([x + [eos] * (width - len(x)) for x in ids])
    labels = torch.tensor([x + [-100] * (width - len(x)) for x in ids])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(train_steps):
        opt.zero_grad()
        model(input_ids=batch, labels=labels).loss.backward()
        opt.step()
    model.eval().save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    return build_gpt2(tmp_path_factory.mktemp("gpt2") / "gpt2-tiny")


@pytest.fixture(scope="module")
def imported(gpt2_dir, tmp_path_factory) -> Path:
    from qkv.importers import import_model

    return import_model(gpt2_dir, tmp_path_factory.mktemp("runs") / "gpt2", log=lambda *a: None)


def reference(gpt2_dir):
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    return GPT2LMHeadModel.from_pretrained(str(gpt2_dir)).eval(), GPT2TokenizerFast.from_pretrained(str(gpt2_dir))


def test_token_ids_equal_gpt2_tokenizer(gpt2_dir, imported):
    import qkv

    _, tok = reference(gpt2_dir)
    lm = qkv.load(imported)
    t = lm.tokenizer
    got = [t.to_model_ids(ids) for ids in t.encode(SAMPLE)]
    assert got == tok(SAMPLE)["input_ids"]
    assert sum(map(len, got)) > 100 and max(map(len, got)) > 10
    assert any(tok.eos_token_id in ids for ids in got)  # "<|endoftext|>" written in a text is that token
    assert t.decode(t.encode(SAMPLE[:5])) == SAMPLE[:5]  # byte-level: every text comes back


def test_logits_equal_transformers_on_a_padded_batch(gpt2_dir, imported):
    from import_folders import padded_logits

    import qkv

    hf, _ = reference(gpt2_dir)
    lm = qkv.load(imported)
    got, want, real, have = padded_logits(lm, hf, lm.tokenizer.encode(TEXT[:4]))
    assert float((got - want)[real][:, have].abs().max()) <= 1e-4
    assert want[real].std() > 1.0  # logits that discriminate


def test_greedy_continuation_equals_generate(gpt2_dir, imported):
    import qkv
    from qkv.decoding.greedy import banned_ids
    from qkv.decoding.sampling import sample

    hf, tok = reference(gpt2_dir)
    lm = qkv.load(imported)
    t = lm.tokenizer
    outputs = set()
    for prompt in ["The Time Traveller", "His grey eyes", "The fire", "Größere"]:
        ids = t.encode([prompt])[0]
        got = t.to_model_ids(sample(lm.model, ids, 20, temperature=0, stop_at_eos=True, banned=banned_ids(t)))
        x = torch.tensor([t.to_model_ids(ids)])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1, max_new_tokens=20,
                          pad_token_id=tok.eos_token_id)[0, x.size(1):].tolist()
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id)]
        assert got == out, prompt
        outputs.add(tuple(got))
    assert len(outputs) == 4


def test_imported_settings(imported):
    from qkv.checkpoint import read_config

    cfg = read_config(imported, "model")
    assert (cfg.task, cfg.norm_first, cfg.has_final_norm, cfg.activation, cfg.positional, cfg.scale_embeddings) == \
        ("lm", True, True, "gelu_tanh", "learned", False)


def test_generate_command(imported, capsys):
    """``qkv generate`` continues a prompt with the imported model (greedy: as the API's sample)."""
    import qkv
    from qkv.cli import main

    lm = qkv.load(imported)
    want = "".join(lm.generate("The Time Traveller", max_new_tokens=8, temperature=0))
    capsys.readouterr()
    assert main(["generate", str(imported), "--prefix", "The Time Traveller", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert want.strip() and want.strip() in capsys.readouterr().out


def test_evaluate_is_transformers_perplexity(gpt2_dir, imported, tmp_path, capsys):
    """``qkv evaluate --test`` on the import: the perplexity of the text's stream (its tokens, then
    <|endoftext|>) from transformers' own next-token log-probabilities; the rows qkv adds take none."""
    import qkv
    from qkv.cli import main
    from qkv.data.text import token_stream

    lm = qkv.load(imported)
    t = lm.tokenizer
    hf, _ = reference(gpt2_dir)
    stream = token_stream([TEXT[0]], t.encode)
    x = torch.tensor([t.to_model_ids(stream)])
    with torch.inference_mode():
        logp = hf(input_ids=x).logits[0, :-1].log_softmax(-1)
    nll = -float(logp[torch.arange(x.size(1) - 1), x[0, 1:]].sum())
    got = lm.score([TEXT[0]])
    assert got.tokens == len(stream) - 1 and abs(got.nll - nll) < 1e-4 * len(stream)
    (tmp_path / "text.txt").write_text(TEXT[0] + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["evaluate", str(imported), "--test", str(tmp_path / "text.txt")]) == 0
    assert f"perplexity {got.ppl:.4f} per token" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"activation_function": "tanh"}, "activation_function 'tanh'"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"architectures": ["GPT2ForSequenceClassification"]}, "GPT2ForSequenceClassification"),
])
def test_unsupported_options_are_refused_by_name(gpt2_dir, tmp_path, change, message):
    import shutil

    from qkv.errors import QkvError
    from qkv.importers import import_model

    d = tmp_path / "g"
    shutil.copytree(gpt2_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QkvError, match=message):
        import_model(d, tmp_path / "out", log=lambda *a: None)
    assert not (tmp_path / "out").exists()


def test_serve_generates_with_the_import(imported):
    """``qkv serve``'s /generate on the imported GPT-2 answers as the front-end does."""
    import qkv
    from import_folders import served

    args = dict(prefix="The fire", max_new_tokens=12, temperature=0.8, top_k=0, top_p=1.0, seed=7)
    want = "".join(qkv.load(imported).generate(**args))
    with served(imported) as c:
        r = c.post("/generate", json=args)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == want


def test_export_to_ctranslate2_generates_as_transformers(gpt2_dir, imported, tmp_path, capsys):
    """``--format ctranslate2`` writes a ``ctranslate2.Generator`` with GPT-2's tokenizer.json (GELU-tanh,
    unscaled embeddings, learned positions, final LayerNorm): its greedy continuations equal
    transformers' ``generate``, and its card's code runs as written. (``--format hf`` writes it back as a
    GPT2LMHeadModel: tests/test_export_hf_families.py.)"""
    import re
    import subprocess
    import sys

    from qkv.cli import main

    pytest.importorskip("ctranslate2", reason=INSTALL)
    import ctranslate2
    import tokenizers

    out = tmp_path / "gpt2-ct2"
    assert main(["export", str(imported), "--format", "ctranslate2", "--out", str(out)]) == 0
    info = json.loads((out / "qkv_export.json").read_text())
    assert info["verified"]["checked"] and info["tokenizer_json"] == {"tgt": "tokenizer.json"}
    hf, hf_tok = reference(gpt2_dir)
    generator = ctranslate2.Generator(str(out), device="cpu", intra_threads=1)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for prompt in ["The Time Traveller", "His grey eyes", "Größere"]:
        pieces = tok.encode(prompt, add_special_tokens=False).tokens
        got = generator.generate_batch([pieces], max_length=20, sampling_topk=1, include_prompt_in_result=False,
                                       end_token=["<|endoftext|>"])[0].sequences[0]
        x = torch.tensor([hf_tok(prompt)["input_ids"]])
        want = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1, max_new_tokens=20,
                           pad_token_id=hf_tok.eos_token_id)[0, x.size(1):].tolist()
        if hf_tok.eos_token_id in want:
            want = want[: want.index(hf_tok.eos_token_id)]
        assert [tok.token_to_id(p) for p in got] == want, prompt
    code = dict(re.findall(r"^```(\w*)\n(.*?)^```$", (out / "README.md").read_text(), flags=re.M | re.S))
    assert code["bash"].startswith("pip install") and "tokenizers" in code["bash"] and "sentencepiece" not in code["bash"]
    run = subprocess.run([sys.executable, "-c", code["python"]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-2000:]


def test_viz_attention_on_the_import(imported, tmp_path):
    from qkv.cli import main

    assert main(["viz", "attention", str(imported), "The Time Traveller", "--out", str(tmp_path / "att")]) == 0
    assert (tmp_path / "att.html").is_file()


def test_finetune_from_the_import(imported, tmp_path):
    """``qkv train --task lm --init-from`` the import: its architecture, tokenizer and weights continue."""
    from qkv.checkpoint import read_checkpoint, read_config
    from qkv.cli import main

    (tmp_path / "book.txt").write_text("\n".join(TEXT * 4) + "\n")
    out = tmp_path / "run"
    assert main(["train", "--task", "lm", "--init-from", str(imported), "--train", str(tmp_path / "book.txt"),
                 "--max-steps", "4", "--eval-every", "4", "--max-len", "32", "--max-tokens", "256",
                 "--schedule", "constant", "--lr", "0.0003", "--valid-fraction", "0.2", "--out", str(out)]) == 0
    a, b = read_checkpoint(imported), read_checkpoint(out / "last")
    cfg = read_config(b, "model")
    assert (cfg.activation, cfg.scale_embeddings, cfg.norm_first) == ("gelu_tanh", False, True)
    assert (out / "last" / "tokenizer.json").is_file()
    moved = [n for n in a.state_dict if not torch.equal(a.state_dict[n], b.state_dict[n])]
    assert len(moved) > len(a.state_dict) // 2
