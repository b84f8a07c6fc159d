"""An OPUS-MT (MarianMTModel) folder imported into qkv and fine-tuned on Multi30k En->De.

Without a network there is no downloaded OPUS-MT model here, so the folder is built as one looks:
opus-mt-en-de's configuration (swish, scaled embeddings, static sinusoidal positions, shared and
tied embeddings, final_logits_bias, ``</s>`` 0 / ``<unk>`` 1 / ``<pad>`` last) at a width this CPU
trains in minutes, random weights, a SentencePiece model per language trained on Multi30k's
training text and the vocab.json over their pieces, saved by transformers' ``save_pretrained``.
Then the commands a user runs on a downloaded folder:

    qkv import FOLDER --out OUT/import
    qkv train --init-from OUT/import --src-train ... --out OUT/finetuned --max-steps N ...
    qkv translate OUT/finetuned/best ...

It shows that the path works (the loss falls from the import's, the tokenizer and architecture
carry over), not a BLEU figure: the weights start random, not pretrained.

    python recipes/multi30k/opus_mt_finetune.py --data ../shared/data/multi30k --out runs/opus-mt-ft --steps 300
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fetch import data_dir  # noqa: E402 (recipes/fetch.py)


def lines(path: Path, n: int | None = None) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        out = [line.rstrip("\n") for line in f]
    return out[:n] if n else out


def spm_model(texts: list[str], vocab_size: int) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, minloglevel=2)
    return buf.getvalue()


def build_folder(folder: Path, en: list[str], de: list[str], vocab_size: int, d_model: int, layers: int) -> None:
    """An OPUS-MT-like MarianMTModel folder (random weights) with opus-mt-en-de's options."""
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    folder.mkdir(parents=True)
    t = folder / "inputs"
    t.mkdir()
    (t / "source.spm").write_bytes(spm_model(en, vocab_size))
    (t / "target.spm").write_bytes(spm_model(de, vocab_size))
    pieces = ["</s>", "<unk>"]
    seen = set(pieces)
    for name in ("source.spm", "target.spm"):
        sp = spm.SentencePieceProcessor(model_file=str(t / name))
        for i in range(sp.get_piece_size()):
            p = sp.id_to_piece(i)
            if not (sp.is_control(i) or sp.is_unknown(i)) and p not in seen:
                pieces.append(p)
                seen.add(p)
    pieces.append("<pad>")
    (t / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False))
    MarianTokenizer(str(t / "source.spm"), str(t / "target.spm"), str(t / "vocab.json")).save_pretrained(str(folder))
    for f in t.iterdir():
        f.unlink()
    t.rmdir()
    v = len(pieces)
    torch.manual_seed(0)
    cfg = MarianConfig(  # opus-mt-en-de's options; d_model, layers and FFN scaled down
        activation_function="swish", d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=4 * d_model,
        decoder_ffn_dim=4 * d_model, dropout=0.1, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=512, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, vocab_size=v, decoder_vocab_size=v, pad_token_id=v - 1, eos_token_id=0,
        bos_token_id=0, decoder_start_token_id=v - 1, forced_eos_token_id=0, architectures=["MarianMTModel"])
    model = MarianMTModel(cfg)
    model.generation_config.update(num_beams=4, max_length=512, bad_words_ids=[[v - 1]], renormalize_logits=True)
    model.save_pretrained(str(folder))


def qkv(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "qkv", *args], check=True, capture_output=True, text=True)
    sys.stderr.write(out.stderr[-3000:])
    return out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(data_dir("multi30k")),
                    help="the raw Multi30k folder (default: data/multi30k in the clone, or ../shared/data/multi30k "
                         "beside it where only that is present: %(default)s)")
    ap.add_argument("--out", default="runs/opus-mt-ft")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    data, out = Path(args.data), Path(args.out)
    en, de = lines(data / "train.en.gz"), lines(data / "train.de.gz")
    start = time.time()
    build_folder(out / "opus-mt-en-de-small", en, de, args.vocab_size, args.d_model, args.layers)
    qkv("import", str(out / "opus-mt-en-de-small"), "--out", str(out / "import"))
    for split, name in (("train", "train"), ("val", "val")):
        for lang in ("en", "de"):
            (out / f"{name}.{lang}").write_text("\n".join(lines(data / f"{split}.{lang}.gz")) + "\n")
    qkv("train", "--init-from", str(out / "import"), "--src-train", str(out / "train.en"), "--tgt-train",
        str(out / "train.de"), "--src-valid", str(out / "val.en"), "--tgt-valid", str(out / "val.de"),
        "--max-steps", str(args.steps), "--eval-every", str(max(1, args.steps // 3)), "--max-tokens", "2048",
        "--schedule", "inverse_sqrt", "--lr", "0.001", "--warmup-steps", str(max(1, args.steps // 5)),
        "--eval-bleu-samples", "100", "--threads", str(args.threads), "--out", str(out / "finetuned"))
    records = [json.loads(x) for x in (out / "finetuned" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in records if "valid_loss" in r]
    sample = lines(data / "test_2016_flickr.en.gz", 3)
    print(json.dumps({"steps": args.steps, "valid": [{k: r.get(k) for k in ("step", "valid_loss", "valid_bleu")}
                                                   for r in evals],
                      "first_train_loss": next((r.get("train_loss") for r in records if "train_loss" in r), None),
                      "translations": qkv("translate", str(out / "finetuned" / "best"), "--beam-size", "1",
                                          *sample).splitlines(),
                      "wall_s": round(time.time() - start)}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
