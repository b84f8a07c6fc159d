"""``qkv export --format hf`` of a language model qkv trained itself with Llama's (Qwen2's, GPT-2's)
switches writes a LlamaForCausalLM (Qwen2ForCausalLM, GPT2LMHeadModel): a tiny model trained from
scratch for a few updates, exported and loaded back with transformers' own class and tokenizer, computes
qkv's logits (within 1e-4 on a right-padded batch), greedy ``generate`` continues a prompt token for
token as qkv's greedy sampler does, and the tokenizer reads texts into qkv's SentencePiece ids
(``PreTrainedTokenizerFast``, as the model card loads it: ``AutoTokenizer`` of a Qwen2 folder builds
Qwen2's own pipeline instead). A model the classes cannot hold is refused by name, exit 2, nothing
written."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import transformers  # noqa: E402

from qkv.cli import main  # noqa: E402
from qkv.config import EOS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = "the cat sat on a mat while dogs ran over green hills and birds sang songs of morning light".split()
LLAMA = ["--positional", "rotary", "--norm-first", "--norm", "rmsnorm", "--no-norm-bias", "--ffn-gated",
         "--activation", "silu", "--no-ffn-bias", "--no-out-bias"]
# texts of the corpus' words, and of others: spaces doubled and at the ends, a tab, characters it lacks
TEXTS = ["the cat sat on a mat", "dogs ran over green hills and", "  birds   sang\tsongs  ",
         "Hello, world! 123", "thecat sathills ünï ½", ""]


def corpus(path):
    rng = random.Random(0)
    path.write_text("".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) + "\n"
                            for _ in range(200)), encoding="utf-8")
    return str(path)


def train(tmp, name, *switches, tokenizer="bpe"):
    out = tmp / name
    assert main(["train", "--task", "lm", "--train", corpus(tmp / "text.txt"), "--valid-fraction", "0.1",
                 "--preset", "tiny", "--tokenizer", tokenizer, "--vocab-size", "60", "--max-len", "32",
                 "--max-tokens", "256", "--max-steps", "60", "--eval-every", "60", "--lr", "0.01",
                 "--warmup-steps", "10", "--schedule", "inverse_sqrt", "--threads", "1",
                 "--out", str(out), *switches]) == 0
    return out / "best"


@pytest.fixture(scope="module", params=[
    # Llama: tied, unscaled, grouped-query attention
    ("LlamaForCausalLM", [*LLAMA, "--no-qkv-bias", "--no-scale-embeddings", "--n-kv-heads", "1"], "bpe"),
    # Qwen2: q/k/v biases, untied (the √d_model scale folded into the embedding), RoPE θ 1e6
    ("Qwen2ForCausalLM", [*LLAMA, "--qkv-bias", "--no-tie-output", "--rope-theta", "1000000"], "unigram"),
    # GPT-2: learned positions, pre-norm LayerNorm with biases, GELU (tanh), every bias, tied, unscaled
    ("GPT2LMHeadModel", ["--positional", "learned", "--norm-first", "--activation", "gelu_tanh",
                         "--no-scale-embeddings"], "char"),
], ids=["llama", "qwen2", "gpt2"])
def exported(request, tmp_path_factory):
    arch, switches, tokenizer = request.param
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp(arch)
    ckpt = train(tmp, "run", *switches, tokenizer=tokenizer)
    assert main(["export", str(ckpt), "--format", "hf", "--out", str(tmp / "hf")]) == 0
    return arch, ckpt, tmp / "hf"


def test_trained_lm_exports_as_its_class_with_qkv_logits(exported, capsys):
    import qkv
    from qkv.export.reference import lm_logits

    arch, ckpt, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    card = (out / "README.md").read_text()
    assert "written as tokenizer.json" in card and "PreTrainedTokenizerFast.from_pretrained" in card
    hf = getattr(transformers, arch).from_pretrained(str(out)).eval()
    assert type(hf).__name__ == arch
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    lm = qkv.load(str(ckpt))
    ids = lm.tokenizer.encode(TEXTS[:3])
    width = max(map(len, ids))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in ids])
    mask = batch != 0
    assert not mask.all()
    with torch.inference_mode():
        got = hf(input_ids=batch, attention_mask=mask.long()).logits
    ref = lm_logits(lm.model.eval(), ids)  # qkv's own network on the same right-padded batch
    delta = (got - ref)[mask].abs().max()
    assert float(delta) <= 1e-4, delta
    assert float(ref[mask].std()) > 0.1  # logits that say something
    # the tokenizer, as transformers loads it, pads and reads texts into qkv's ids
    enc = tok(TEXTS[:3], padding=True, return_tensors="pt")
    assert torch.equal(enc["input_ids"], batch) and torch.equal(enc["attention_mask"].bool(), mask)


def test_trained_lm_tokenizer_reads_qkv_ids(exported):
    import qkv

    _, ckpt, out = exported
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    sp = qkv.load(str(ckpt)).tokenizer
    assert tok(TEXTS)["input_ids"] == sp.encode(TEXTS)
    assert any(1 in row for row in sp.encode(TEXTS))  # an unknown character: UNK in both
    ids = sp.encode(TEXTS[:2])
    assert tok.batch_decode(ids) == sp.decode(ids)


def test_trained_lm_greedy_generate_is_qkvs(exported):
    import qkv
    from qkv.decoding.greedy import banned_ids
    from qkv.decoding.sampling import sample

    _, ckpt, out = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    lm = qkv.load(str(ckpt))
    on = copy.deepcopy(hf.generation_config)  # the written config (qkv's specials suppressed), no end at EOS:
    on.eos_token_id = 0  # PAD, suppressed, never drawn
    on.update(do_sample=False, max_new_tokens=24)
    for prompt in ("the cat", "birds sang songs of"):
        ids = lm.prompt_ids(prompt)
        want = list(sample(lm.model.eval(), ids, 24, temperature=0.0, banned=banned_ids(lm.tokenizer)))
        enc = tok([prompt], return_tensors="pt")
        assert enc["input_ids"][0].tolist() == ids
        with torch.inference_mode():
            whole = hf.generate(**enc, generation_config=on)
            got = hf.generate(**enc, do_sample=False, max_new_tokens=24)
        assert whole[0, len(ids):].tolist() == want  # qkv's stream: EOS ends a line, the next one follows
        assert len(set(want) - {EOS}) > 2  # a model that continues the prompt with words
        if EOS in want:  # as written, transformers ends the text at EOS
            want = want[:want.index(EOS) + 1]
        assert got[0, len(ids):].tolist() == want


def test_paper_lm_is_refused_by_name(tmp_path, capsys):
    ckpt = train(tmp_path, "paper")  # post-norm, sinusoidal, LayerNorm, ReLU, biases, scaled tied embedding
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for field in ("positional = 'sinusoidal'", "norm_first = false", "norm = 'layernorm'", "ffn_gated = false",
                  "scale_embeddings = true with tie_output = true", "LlamaForCausalLM"):
        assert field in err, err
    assert not out.exists()


def test_scaled_tied_embedding_and_output_bias_are_refused_by_name(tmp_path, capsys):
    # Llama's switches but the paper's √d_model on a tied embedding, and a trained output bias
    ckpt = train(tmp_path, "scaled", *LLAMA, "--no-qkv-bias", "--output-bias")
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "scale_embeddings = true with tie_output = true" in err and "output_bias = true" in err, err
    assert "positional =" not in err and "norm =" not in err and "norm_first =" not in err, err
    assert not out.exists()
