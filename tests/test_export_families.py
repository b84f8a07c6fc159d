"""``qkv export --format ctranslate2`` for the family switches (rotary positions, RMSNorm, the gated FFN,
grouped-query attention, the bias and scale switches), and the switches each format refuses by name.

* tiny random LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM folders built by transformers' classes (as in
  tests/test_import_llama.py), imported, exported: ``ctranslate2.Generator``'s greedy tokens equal
  qkv's greedy generation and transformers' ``generate``; the export's probe check passed;
* models trained from scratch with the switches (a Llama-style language model; a translation model
  with RMSNorm, GeGLU, no biases, no 1/sqrt(d_k)) export, greedy outputs equal qkv's;
* what CTranslate2's specs cannot hold (rotary positions and grouped-query attention in an encoder-decoder)
  and what a MarianMTModel cannot (every switch away from the paper's value) is refused by field,
  nothing written.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.config import EOS
from qkv.decoding.greedy import banned_ids
from qkv.decoding.sampling import sample

sys.path.insert(0, str(Path(__file__).parent))
from test_export import budget, data, qkv_greedy, train  # noqa: E402,F401  (the data fixture, shared helpers)
from test_family_switches import LLAMA_FLAGS  # noqa: E402

INSTALL = 'pip install -c constraints.txt -e ".[export]"'
HAS = all(importlib.util.find_spec(m) is not None for m in ("ctranslate2", "transformers", "tokenizers"))
pytestmark = [pytest.mark.skipif(not HAS, reason=f"ctranslate2, transformers or tokenizers missing: {INSTALL}"),
              pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["The Time Traveller", "His grey eyes", "The fire", "Größere"]
STEPS = ["--max-steps", "20", "--eval-every", "20"]
# a translation model with every switch CTranslate2's TransformerSpec takes (post-norm, sinusoidal positions)
T5_LIKE = ["--norm", "rmsnorm", "--no-norm-bias", "--ffn-gated", "--activation", "gelu", "--no-qkv-bias",
           "--no-out-bias", "--no-ffn-bias", "--no-attention-scale"]


def export(capsys, ckpt: Path, fmt: str, out: Path) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["export", str(ckpt), "--format", fmt, "--out", str(out)])
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def imported(request, tmp_path_factory):
    from test_import_llama import build

    from qkv.importers import import_model

    d = tmp_path_factory.mktemp(request.param)
    folder = build(d / "hf", request.param)
    return folder, import_model(folder, d / "run", log=lambda *a: None)


def test_llama_and_qwen2_export_greedy_equals_qkv_and_generate(imported, tmp_path, capsys):
    import ctranslate2
    import transformers

    folder, ckpt = imported
    out = tmp_path / "ct2"
    rc, err = export(capsys, ckpt, "ctranslate2", out)
    assert rc == 0, err
    info = json.loads((out / "qkv_export.json").read_text())
    assert info["verified"]["checked"] and info["verified"]["max_abs_log_prob_difference"] < 1e-3
    config = json.loads((out / "config.json").read_text())
    assert config["layer_norm_epsilon"] == 1e-6
    lm = qkv.load(ckpt)
    t = lm.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    eos = hf.config.eos_token_id
    suppress = [i for i in t.to_model_ids(banned_ids(t)) if i is not None]
    generator = ctranslate2.Generator(str(out), device="cpu", intra_threads=1)
    vocab = json.loads((out / "vocabulary.json").read_text())
    outputs = set()
    for prompt in PROMPTS:
        ids = t.encode_text(prompt)
        want = t.to_model_ids(sample(lm.model, ids, 24, temperature=0, stop_at_eos=True, banned=banned_ids(t)))
        r = generator.generate_batch([[vocab[i] for i in ids]], max_length=24, sampling_topk=1,
                                     include_prompt_in_result=False, end_token=vocab[EOS])
        got = t.to_model_ids(r[0].sequences_ids[0])
        x = torch.tensor([t.to_model_ids(ids)])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1, max_new_tokens=24,
                          pad_token_id=eos, suppress_tokens=suppress)[0, x.size(1):].tolist()
        ref = ref[: ref.index(eos)] if eos in ref else ref
        assert got == want == ref, prompt
        outputs.add(tuple(got))
    assert len(outputs) >= 3


def test_llama_style_lm_trained_from_scratch_exports(data, tmp_path, capsys):
    """Rotary + RMSNorm + SwiGLU + multi-query attention, bias-free, trained from scratch: the Generator's
    greedy tokens are qkv's greedy generation."""
    import ctranslate2

    ckpt = train(data, "llama-lm", "--task", "lm", *STEPS, *LLAMA_FLAGS)
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "lm")
    assert rc == 0, err
    model = qkv.load(ckpt)
    assert model.model.cfg.positional == "rotary" and model.model.cfg.n_kv_heads == 1
    generator = ctranslate2.Generator(str(tmp_path / "lm"), intra_threads=1)
    vocab = json.loads((tmp_path / "lm" / "vocabulary.json").read_text())
    for prefix in ["red cat", "sun\ntree", "dog"]:
        ids = model.prompt_ids(prefix)
        want = list(sample(model.model, ids, 30, temperature=0.0))
        r = generator.generate_batch([[vocab[i] for i in ids]], max_length=30, sampling_topk=1,
                                     include_prompt_in_result=False, end_token=[])
        assert r[0].sequences_ids[0] == want, prefix


def test_switched_translation_model_exports_to_ctranslate2_and_hf_names_every_switch(data, tmp_path, capsys):
    """RMSNorm without bias, GeGLU, no Q/K/V, output or FFN biases, no 1/sqrt(d_k): CTranslate2's greedy
    translations are ``qkv translate --beam-size 1``'s; --format hf names each switch and writes nothing."""
    ckpt = train(data, "t5-like", *STEPS, *T5_LIKE)
    rc, err = export(capsys, ckpt, "hf", tmp_path / "hf")
    assert rc == 2 and not (tmp_path / "hf").exists()
    for field in ("norm = 'rmsnorm'", "norm_bias = false", "ffn_gated = true", "ffn_bias = false", "qkv_bias = false",
                  "out_bias = false", "attention_scale = false"):
        assert field in err, (field, err)
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "ct2")
    assert rc == 0, err
    out = tmp_path / "ct2"
    sentences = ["red cat", "tree sun dog blue", "dog", "cat dog red sun tree"]
    got = ct2_greedy(out, sentences)
    assert got == qkv_greedy(capsys, ckpt, sentences)


def ct2_greedy(out, sentences: list[str]) -> list[str]:
    """The exported translator's greedy translations, one sentence at a time, through its own SentencePiece models."""
    import ctranslate2
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(out / "source.spm"))
    tp = spm.SentencePieceProcessor(model_file=str(out / "target.spm"))
    translator = ctranslate2.Translator(str(out), intra_threads=1)
    got = []
    for s in sentences:
        pieces = sp.encode(s, out_type=str)
        r = translator.translate_batch([pieces], beam_size=1, max_decoding_length=budget(len(pieces)))
        got.append(tp.decode(r[0].hypotheses[0]))
    return got


def test_t5_style_translation_model_with_relative_buckets_exports(data, tmp_path, capsys):
    """T5's choices trained from scratch (pre-norm, relative position buckets, RMSNorm, GeGLU, no biases,
    no 1/sqrt(d_k)): CTranslate2's greedy translations are ``qkv translate --beam-size 1``'s."""
    ckpt = train(data, "t5-relative", *STEPS, *T5_LIKE, "--norm-first", "--positional", "relative",
                 "--relative-buckets", "8", "--relative-max-distance", "20")
    assert qkv.load(ckpt).model.cfg.positional == "relative"
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "ct2")
    assert rc == 0, err
    out = tmp_path / "ct2"
    sentences = ["red cat", "tree sun dog blue", "dog", "cat dog red sun tree blue red"]
    got = ct2_greedy(out, sentences)
    assert got == qkv_greedy(capsys, ckpt, sentences)
    assert len(set(got)) >= 2, got  # outputs that depend on the source
    print(f"t5-style: {got}, probe max |delta log p| "
          f"{json.loads((out / 'qkv_export.json').read_text())['verified']['max_abs_log_prob_difference']:.2g}")


def test_what_ctranslate2s_encoder_decoder_cannot_hold_is_refused_by_name(data, tmp_path, capsys):
    """Rotary positions and grouped-query attention in a translation model, RMSNorm with a bias: each named
    in the one line of --format ctranslate2, each (and pre-norm) in --format hf's; nothing written."""
    ckpt = train(data, "rotary-translate", "--max-steps", "2", "--eval-every", "2", "--positional", "rotary",
                 "--norm-first", "--n-kv-heads", "1", "--norm", "rmsnorm")
    rc, err = export(capsys, ckpt, "ctranslate2", tmp_path / "ct2")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for field in ("positional = 'rotary'", "n_kv_heads = 1", "norm = 'rmsnorm' with norm_bias = true"):
        assert field in err, (field, err)
    assert not (tmp_path / "ct2").exists()
    rc, err = export(capsys, ckpt, "hf", tmp_path / "hf")
    for field in ("pre-norm", "positional = 'rotary'", "n_kv_heads = 1", "norm = 'rmsnorm'"):
        assert rc == 2 and field in err, (field, err)
    assert not (tmp_path / "hf").exists()
