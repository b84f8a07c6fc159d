"""Importing Hugging Face LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM folders as qkv
language models: the decoder-only stack with rotary positions, RMSNorm, SwiGLU and grouped-query
attention (and Qwen2's q/k/v biases).

Each folder is built by transformers' own classes with random weights (2 layers, d_model 64, 4 query
heads over 2 key/value heads), its RMSNorm gains (and Qwen2's biases) perturbed away from their
initial values, and saved by ``save_pretrained``; the tokenizer is a byte-fallback BPE (Llama's
kind: ``<0xNN>`` pieces for characters outside its vocabulary) with Llama's ``<s> $A`` template,
saved as tokenizer.json. The references are transformers' classes on that folder.
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
        "The fire burned brightly, and the soft radiance of the incandescent lights caught the bubbles."]
SAMPLE = ["Größere Häuser: café, naïve, Ærø.", "東京で寿司", "I 💖 emoji!", "two\nlines", "   spaces  ", ""]
FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def byte_fallback_bpe(out: Path):
    """A Llama-style tokenizer: SentencePiece-like BPE over "▁"-joined words with byte fallback, <unk> <s> </s>
    at 0 1 2, and the template "<s> $A"; saved by PreTrainedTokenizerFast.save_pretrained (tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([t.replace(" ", "▁") for t in TEXT * 5], trainer)
    data = json.loads(tok.to_str())  # Llama's layout: the specials, then the 256 byte pieces <0x00>..<0xFF>, then the rest
    learned = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])[len(specials):]
    pieces = specials + [f"<0x{i:02X}>" for i in range(256)] + [p for p, _ in learned]
    data["model"]["vocab"] = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer.from_str(json.dumps(data))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out))
    return fast


def build(out: Path, arch: str, seed: int = 0, tie: bool = False) -> Path:
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tok = byte_fallback_bpe(out)
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=tie, initializer_range=0.2,
                  architectures=[arch])
    if arch == "LlamaForCausalLM":
        cfg = transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    elif arch == "Qwen2ForCausalLM":
        cfg = transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        cfg = transformers.MistralConfig(**common, sliding_window=None)
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():  # gains and biases away from their initial 1 and 0
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
    model.eval().save_pretrained(str(out))
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("hf") / request.param, request.param)


def reference(folder: Path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    # the folder's tokenizer.json as written (AutoTokenizer would give Qwen2 folders Qwen2Tokenizer's own pipeline)
    return AutoModelForCausalLM.from_pretrained(str(folder)).eval(), PreTrainedTokenizerFast.from_pretrained(str(folder))


def load(folder: Path):
    import qkv

    return qkv.load(folder)


def test_settings_are_the_switches(folder):
    from qkv.importers import convert

    imported = convert(folder)
    cfg = imported.model_cfg
    assert (cfg.task, cfg.positional, cfg.norm, cfg.norm_bias, cfg.ffn_gated, cfg.activation, cfg.n_kv_heads) == \
        ("lm", "rotary", "rmsnorm", False, True, "silu", 2)
    assert (cfg.qkv_bias, cfg.out_bias, cfg.ffn_bias) == ((True, False, False) if "Qwen2" in folder.name
                                                          else (False, False, False))
    assert cfg.tie_output is False and cfg.scale_embeddings is False
    assert cfg.rope_theta == {"LlamaForCausalLM": 500.0, "Qwen2ForCausalLM": 1e6, "MistralForCausalLM": 10000.0}[folder.name]


def test_token_ids_equal_the_tokenizer(folder):
    _, tok = reference(folder)
    t = load(folder).tokenizer
    got = [t.encode_text(s) for s in SAMPLE]
    want = tok(SAMPLE)["input_ids"]
    assert [t.to_model_ids(ids) for ids in got] == want
    assert any(any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids) for ids in want)  # byte fallback used
    assert t.decode(t.encode(SAMPLE[:3])) == SAMPLE[:3]


def test_logits_equal_transformers_on_a_padded_batch(folder):
    from import_folders import padded_logits

    hf, tok = reference(folder)
    lm = load(folder)
    got, want, real, have = padded_logits(lm, hf, [lm.tokenizer.encode_text(s) for s in TEXT + SAMPLE[:3]])
    diff = float((got - want)[real][:, have].abs().max())
    print(f"{folder.name}: max |qkv - transformers| {diff:.2e}, logits std {float(want[real].std()):.2f}")
    assert diff <= 1e-4, diff
    assert want[real].std() > 1.0  # logits that discriminate


def test_greedy_equals_generate(folder):
    from qkv.decoding.greedy import banned_ids
    from qkv.decoding.sampling import sample

    hf, tok = reference(folder)
    lm = load(folder)
    t = lm.tokenizer
    outputs = set()
    suppress = [i for i in t.to_model_ids(banned_ids(t)) if i is not None]  # qkv never emits <s>, <unk>
    for prompt in ["The Time Traveller", "His grey eyes", "The fire", "Größere"]:
        ids = t.encode_text(prompt)
        got = t.to_model_ids(sample(lm.model, ids, 24, temperature=0, stop_at_eos=True, banned=banned_ids(t)))
        x = torch.tensor([t.to_model_ids(ids)])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1, max_new_tokens=24,
                          pad_token_id=tok.eos_token_id, suppress_tokens=suppress)[0, x.size(1):].tolist()
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id)]
        assert got == out, prompt
        outputs.add(tuple(got))
    assert len(outputs) >= 3


def test_kv_cached_steps_equal_the_full_forward(folder):
    """start() on a right-padded batch of prefixes of different lengths, then one step a token: each step's
    logits equal the full forward's at that row's position (RoPE at each row's own positions, GQA caches)."""
    from qkv.config import PAD

    lm = load(folder)
    model = lm.model.eval()
    t = lm.tokenizer
    rows = [t.encode_text(s + " " + x) for s, x in zip(SAMPLE, TEXT)]
    prefix_len = [3, 7, 5]
    assert min(len(r) - n for r, n in zip(rows, prefix_len)) >= 8
    prefix = [r[:n] for r, n in zip(rows, prefix_len)]
    width = max(prefix_len)
    with torch.inference_mode():
        state = model.start(torch.tensor([p + [PAD] * (width - len(p)) for p in prefix]))
        for k in range(8):
            tokens = torch.tensor([r[n + k] for r, n in zip(rows, prefix_len)])
            logits, state = model.step(tokens, state)
            for b, (r, n) in enumerate(zip(rows, prefix_len)):
                full = model(torch.tensor([r[: n + k + 1]]))[0, -1]
                assert torch.allclose(logits[b], full, atol=1e-5), (b, k)


def test_tied_embeddings_import(tmp_path):
    from qkv.config import PAD  # noqa: F401

    folder = build(tmp_path / "tied", "LlamaForCausalLM", seed=1, tie=True)
    hf, _ = reference(folder)
    lm = load(folder)
    assert lm.model.cfg.tie_output is True and lm.model.output_proj is None
    t = lm.tokenizer
    ids = t.encode_text(TEXT[0])
    model_ids = torch.tensor([m if m is not None else 0 for m in t.ids.model_ids])
    have = torch.tensor([m is not None for m in t.ids.model_ids])
    with torch.inference_mode():
        want = hf(input_ids=torch.tensor([t.to_model_ids(ids)])).logits[..., model_ids]
        got = lm.model(torch.tensor([ids]))
    assert float((got - want)[..., have].abs().max()) <= 1e-4


@pytest.mark.parametrize("change, refused", [
    ({"sliding_window": 16}, "sliding_window = 16"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}, "rope_type 'llama3'"),
    ({"head_dim": 32}, "head_dim = 32"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, change, refused):
    import json

    from qkv.importers import ImportRefused, convert

    arch = "MistralForCausalLM" if "sliding_window" in change else "LlamaForCausalLM"
    folder = build(tmp_path / "m", arch)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ImportRefused, match=refused.replace("(", r"\(").replace("[", r"\[")):
        convert(folder)


def test_a_window_that_covers_every_position_imports(tmp_path):
    import json

    from qkv.importers import convert

    folder = build(tmp_path / "m", "MistralForCausalLM")
    config = json.loads((folder / "config.json").read_text())
    config["sliding_window"] = config["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))
    assert convert(folder).model_cfg.positional == "rotary"


def test_the_commands_take_the_import(folder, tmp_path, capsys):
    """generate (greedy: the API's continuation, which is generate()'s), evaluate (perplexity: the sum of
    transformers' next-token log-probabilities over the text's stream), serve's /generate and viz attention (the
    masked self-attention of every layer and query head, GQA's key/value heads shared: transformers' weights)
    on the imported checkpoint."""
    import qkv
    from qkv.cli import main
    from qkv.data.text import token_stream
    from qkv.importers import import_model
    from qkv.viz import attention_data

    from import_folders import eager, max_map_difference, rows_sum_to_one, served

    out = tmp_path / "q"
    import_model(folder, out, log=lambda s: None)
    lm = qkv.load(out)
    t = lm.tokenizer
    hf, _ = reference(folder)
    prompt = "His grey eyes"
    want = "".join(lm.generate(prompt, max_new_tokens=12, temperature=0))
    capsys.readouterr()
    assert main(["generate", str(out), "--prefix", prompt, "--max-new-tokens", "12", "--greedy"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == prompt + want and want.strip()

    (tmp_path / "text.txt").write_text(TEXT[1] + "\n", encoding="utf-8")
    stream = token_stream([TEXT[1]], t.encode)
    x = torch.tensor([t.to_model_ids(stream)])
    with torch.inference_mode():
        logp = hf(input_ids=x).logits[0, :-1].log_softmax(-1)
    nll = -float(logp[torch.arange(x.size(1) - 1), x[0, 1:]].sum())
    got = lm.score([TEXT[1]])
    assert got.tokens == len(stream) - 1 and abs(got.nll - nll) < 1e-4 * len(stream)
    assert main(["evaluate", str(out), "--test", str(tmp_path / "text.txt")]) == 0
    assert f"perplexity {got.ppl:.4f} per token" in capsys.readouterr().out

    args = dict(prefix="The fire", max_new_tokens=10, temperature=0.8, top_k=0, top_p=1.0, seed=7)
    with served(out) as client:
        r = client.post("/generate", json=args)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == "".join(lm.generate(**args))

    text = "The Time Traveller was"
    data = attention_data(lm, text)
    ids = t.encode_text(text)
    assert data["tokens"]["text"] == [t.id_to_piece(i) for i in ids]
    maps = data["weights"]["decoder_self"]
    with torch.inference_mode():
        ref = eager(hf)(input_ids=torch.tensor([t.to_model_ids(ids)]), output_attentions=True).attentions
    assert len(maps) == 2 and len(maps[0]) == 4 and len(maps[0][0]) == len(ids)  # 4 query heads over 2 kv heads
    assert max_map_difference(maps, ref) < 1e-5 and rows_sum_to_one(maps)
    assert main(["viz", "attention", str(out), text, "--out", str(tmp_path / "att")]) == 0
    assert (tmp_path / "att.html").is_file() and (tmp_path / "att.png").is_file()


def test_finetune_from_the_import_keeps_its_switches_and_positions(tmp_path, capsys):
    """qkv train --task lm --init-from a Qwen2 import (rotary positions trained to 128, RMSNorm, SwiGLU, GQA, q/k/v
    biases) with the default max_len (256): every tensor continues (none starts new), the switches and the
    tokenizer stay, and max_len becomes the import's 128 positions, said once in the log."""
    from qkv.checkpoint import read_checkpoint, read_config
    from qkv.cli import main
    from qkv.importers import import_model

    folder = build(tmp_path / "Qwen2ForCausalLM", "Qwen2ForCausalLM")
    import_model(folder, tmp_path / "q", log=lambda s: None)
    (tmp_path / "book.txt").write_text("\n".join(TEXT * 4) + "\n", encoding="utf-8")
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--task", "lm", "--init-from", str(tmp_path / "q"), "--train", str(tmp_path / "book.txt"),
                 "--max-steps", "2", "--eval-every", "2", "--schedule", "constant", "--lr", "0.001",
                 "--valid-fraction", "0.2", "--out", str(out), "--threads", "1"]) == 0
    logged = capsys.readouterr()
    logged = logged.out + logged.err
    assert "max_len 128 (not 256): its rotary positions end at max_positions=128" in logged
    assert "new: none" in logged
    a, b = read_checkpoint(tmp_path / "q"), read_checkpoint(out / "last")
    cfg = read_config(b, "model")
    assert (cfg.positional, cfg.rope_theta, cfg.norm, cfg.norm_bias, cfg.ffn_gated, cfg.ffn_bias, cfg.n_kv_heads,
            cfg.qkv_bias, cfg.out_bias) == ("rotary", 1e6, "rmsnorm", False, True, False, 2, True, False)
    assert read_config(b, "train").max_len == 128
    assert set(a.state_dict) == set(b.state_dict)
    moved = [n for n in a.state_dict if not torch.equal(a.state_dict[n], b.state_dict[n])]
    assert len(moved) > len(a.state_dict) // 2
    assert (out / "last" / "tokenizer.json").read_bytes() == (tmp_path / "q" / "tokenizer.json").read_bytes()
