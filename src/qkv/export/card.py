"""The model card: README.md with Hugging Face's YAML front matter (languages, license, tags,
datasets, metrics with their sacreBLEU signatures where known) and a body that says what the model
is, how it was trained (the whole config), how to use the exported directory, and where it may
differ from ``qkv translate``.

Scores come from two places: a test set given to the export (``--src``/``--ref``: translated by
qkv from the checkpoint with its saved decoding settings and scored with sacreBLEU, signatures
included), and the run's ``metrics.jsonl`` beside the checkpoint (validation scores recorded
during training: greedy decoding of the first ``eval_bleu_samples`` validation sentences; their
sacreBLEU version was not recorded).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from qkv.config import BOS, EOS
from qkv.decoding.greedy import MAX_OUTPUT_LEN
from qkv.errors import QkvError
from qkv.export.source import Source, checkpoint_name

EMBEDDED = "toy/train"  # the data name qkv train records for its embedded default task
EMBEDDED_LANGS = ("en", "de")
VALIDATION_SIGNATURE = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp (sacreBLEU's defaults; version not recorded)"


@dataclass(frozen=True)
class CardInfo:
    """What the checkpoint does not record and the user may give (``qkv export`` options)."""

    source_lang: str | None = None
    target_lang: str | None = None
    license: str = "unknown"
    dataset: str | None = None
    test_src: str | None = None  # a test set to score (translation)
    test_ref: str | None = None


@dataclass
class TestScores:
    name: str
    sentences: int
    bleu: float
    bleu_signature: str
    chrf: float
    chrf_signature: str


# A path in a string: two or more parts of anything but separators, whitespace and ':' (which ends a
# binarized corpus' path, "DIR:train"), each ended by one separator, with an optional drive or leading one.
PATH_RE = re.compile(r"(?:[A-Za-z]:)?[\\/]?(?:[^\\/\s:]+[\\/])+([^\\/\s:]+)")


def file_names(text: str) -> str:
    """``text`` with every path in it cut to its last part: "/home/me/data/train.en/tmp/x/train.de"
    -> "train.en/train.de", "/data/wmt14-bin:train" -> "wmt14-bin:train". What a card or qkv_export.json
    says of a file of the exporting machine (they name files, never where they were)."""
    if text == EMBEDDED:
        return text
    halves = split_pair(text)
    if halves:
        return "/".join(Path(h).name for h in halves)
    return PATH_RE.sub(lambda m: m.group(1), text)


def split_pair(name: str) -> list[str]:
    """"SRC/TGT" as training records parallel data, split where both halves name a file with a language
    suffix (``train.en``); [] where it is not such a pair."""
    from qkv.metrics import language_of

    for i, c in enumerate(name):
        if c == "/" and i and language_of(name[:i]) and language_of(name[i + 1:]):
            return [name[:i], name[i + 1:]]
    return []


def public_config(src: Source) -> dict:
    """The checkpoint's configuration (model, train, decode, data) with every path cut to its file name."""
    def scrub(v):
        if isinstance(v, dict):
            return {k: scrub(x) for k, x in v.items()}
        if isinstance(v, list):
            return [scrub(x) for x in v]
        return file_names(v) if isinstance(v, str) else v

    return {k: scrub(src.config[k]) for k in ("model", "train", "decode", "data") if k in src.config}


def training_files(src: Source) -> list[str]:
    """The training data's files as training recorded them: ``[source, target]`` for parallel data
    (recorded as "SRC/TGT", split where both halves name a file), ``[text]`` or ``[]`` (the embedded task)."""
    data = src.config.get("data") if isinstance(src.config.get("data"), dict) else {}
    name = str(data.get("train", ""))
    if not name or name == EMBEDDED:
        return []
    return split_pair(name) or [name]


def languages(src: Source, info: CardInfo) -> tuple[str | None, str | None]:
    """Source and target language: given, else from the training files' names (``train.en``,
    ``train.de.gz``), else the embedded task's (English -> German)."""
    from qkv.metrics import language_of

    data = src.config.get("data") if isinstance(src.config.get("data"), dict) else {}
    files = training_files(src)
    guess: tuple[str | None, str | None] = (None, None)
    if data.get("train") == EMBEDDED:
        guess = EMBEDDED_LANGS
    elif len(files) == 2:
        guess = (language_of(files[0]), language_of(files[1]))
    elif len(files) == 1 and src.task == "lm":
        guess = (language_of(files[0]), None)
    return info.source_lang or guess[0], info.target_lang or guess[1]


def dataset_name(info: CardInfo) -> str | None:
    """The training data's name for the card's ``datasets``: a data set's name given with ``--dataset``;
    never the training files' paths nor the embedded task, which name no data set."""
    return info.dataset or None


def own_metric(src: Source, valid: dict) -> str:
    """The validation metric the run reports: "exact" for the embedded number task (one word a number:
    BLEU means nothing) and runs that recorded exact match alone, else "bleu"."""
    data = src.config.get("data") if isinstance(src.config.get("data"), dict) else {}
    if data.get("train") == EMBEDDED or ("valid_exact" in valid and "valid_bleu" not in valid):
        return "exact"
    return "bleu"


def score_test_set(src: Source, info: CardInfo) -> TestScores | None:
    """Translate --src with the checkpoint (qkv, its saved decoding settings) and score it against --ref."""
    if not (info.test_src or info.test_ref):
        return None
    if not (info.test_src and info.test_ref):
        raise QkvError("give both --src (test sources) and --ref (their references) to put test scores in the card")
    if src.task != "translate":
        raise QkvError(f"--src/--ref score a translation model; {src.path} is a {src.task!r} model")
    from qkv.data.corpus import read_lines
    from qkv.frontends import load
    from qkv.metrics import bleu, chrf

    sources, refs = read_lines(info.test_src), read_lines(info.test_ref)
    if len(sources) != len(refs):
        raise QkvError(f"{info.test_src} has {len(sources)} lines but {info.test_ref} has {len(refs)}")
    hyps = load(src.path).translate(sources)
    b, c = bleu(hyps, refs), chrf(hyps, refs)
    return TestScores(Path(info.test_ref).name, len(refs), round(b.score, 2), b.signature, round(c.score, 2),
                      c.signature)


def validation_scores(src: Source) -> dict | None:
    """The run's validation record for this checkpoint: for best/, the one with the lowest validation loss
    (what best/ holds); for last/, the latest; None for anything else or without RUN/metrics.jsonl."""
    log = src.path.parent / "metrics.jsonl"
    if src.path.name not in ("best", "last") or not log.is_file():
        return None
    records = []
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and isinstance(r.get("valid_loss"), (int, float)):
            records.append(r)
    if not records:
        return None
    return min(records, key=lambda r: r["valid_loss"]) if src.path.name == "best" else records[-1]


# --- YAML (a small emitter: block style, scalars quoted as JSON strings, which YAML reads) -----------------

def to_yaml(value, indent: int = 0) -> str:
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:\n{to_yaml(v, indent + 2)}")
            else:
                lines.append(f"{pad}{k}: {_scalar(v)}")
        return "\n".join(lines)
    if isinstance(value, list):
        lines = []
        for v in value:
            if isinstance(v, dict) and v:
                inner = to_yaml(v, indent + 2)
                lines.append(f"{pad}- {inner.lstrip()}")
            else:
                lines.append(f"{pad}- {_scalar(v)}")
        return "\n".join(lines)
    return pad + _scalar(value)


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if v is None:
        return "null"
    if isinstance(v, (dict, list)):
        return "{}" if isinstance(v, dict) else "[]"
    s = str(v)
    return s if re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", s) and s.lower() not in ("true", "false", "null", "yes", "no",
                                                                                "on", "off") else json.dumps(s)


# --- the card ---------------------------------------------------------------------------------------

def front_matter(src: Source, fmt: str, info: CardInfo, test: TestScores | None, valid: dict | None) -> dict:
    s_lang, t_lang = languages(src, info)
    translate = src.task == "translate"
    meta: dict = {}
    langs = [x for x in dict.fromkeys((s_lang, t_lang)) if x]
    if langs:
        meta["language"] = langs
    meta["license"] = info.license
    meta["library_name"] = "transformers" if fmt == "hf" else "ctranslate2"
    encoder = src.task in ("classify", "mlm")
    meta["pipeline_tag"] = "translation" if translate else "feature-extraction" if encoder else "text-generation"
    from qkv.export.hf_families import family_of, pipeline_tag

    own = fmt == "hf" and family_of(src) is not None  # an imported model, written as its own class
    if own:
        meta["pipeline_tag"] = pipeline_tag(src)
    meta["tags"] = ["qkv", "transformer", "attention-is-all-you-need",
                    *(["translation", "marian"] if translate and fmt == "hf" and not own else ["translation"] if translate
                      else ["encoder"] if encoder else ["language-model"]),
                    *(["ctranslate2"] if fmt == "ctranslate2" else [])]
    data = dataset_name(info)
    if data:
        meta["datasets"] = [data]
    exact = valid is not None and own_metric(src, valid) == "exact"
    if translate:
        meta["metrics"] = ["bleu", "chrf"] if test is not None or not exact else []
        meta["metrics"] += ["exact_match"] if exact else []
    results = []
    task = {"type": "translation" if translate else "feature-extraction" if encoder else "text-generation",
            "name": f"Translation {s_lang or '?'}-{t_lang or '?'}" if translate else
            "Encoding" if encoder else "Language modelling"}
    if test is not None:
        results.append({"task": task, "dataset": {"name": test.name, "type": test.name},
                        "metrics": [{"type": "bleu", "value": test.bleu, "name": "BLEU", "args": test.bleu_signature},
                                    {"type": "chrf", "value": test.chrf, "name": "chrF", "args": test.chrf_signature}]})
    if valid is not None:
        metrics = []
        if exact and "valid_exact" in valid:
            metrics.append({"type": "exact_match", "value": round(100 * valid["valid_exact"], 2),
                            "name": "validation exact match % (greedy)"})
        elif "valid_bleu" in valid:
            metrics.append({"type": "bleu", "value": round(valid["valid_bleu"], 2), "name": "validation BLEU (greedy)",
                            "args": VALIDATION_SIGNATURE})
        if "valid_chrf" in valid and not exact:
            metrics.append({"type": "chrf", "value": round(valid["valid_chrf"], 2), "name": "validation chrF (greedy)"})
        if "valid_ppl" in valid:
            metrics.append({"type": "perplexity", "value": round(valid["valid_ppl"], 4), "name": "validation perplexity"})
        if metrics:
            results.append({"task": task, "dataset": {"name": "validation", "type": "validation"}, "metrics": metrics})
    if results:
        meta["model-index"] = [{"name": src.path.parent.name or src.path.name, "results": results}]
    return meta


# what the card's code imports, as pip installs it (the runtime at the version that wrote the export, or later)
INSTALL = {"hf": ("transformers", ["sentencepiece", "torch"]), "ctranslate2": ("ctranslate2", ["sentencepiece"])}


def install_line(fmt: str, export_info: dict) -> str:
    """``pip install ...``: every package the card's code needs; the runtime no older than the one that wrote it."""
    runtime, others = INSTALL[fmt]
    if "tokenizer_json" in export_info:  # a Hugging Face tokenizer (an imported GPT-2's), not SentencePiece
        others = ["tokenizers", *(["torch"] if fmt == "hf" else [])]
    version = export_info.get(f"{runtime}_version")
    return "pip install " + " ".join([f'"{runtime}>={version}"' if version else runtime, *others])


def usage(src: Source, fmt: str, location: str) -> str:
    """The card's code: it runs as written from the folder that holds the export, named ``location``
    (a folder's name, not a path of the exporting machine)."""
    here = (f"model_dir = {json.dumps(location)}  # this export's folder: run from the folder that holds it, "
            "or give its path (uploaded: its name on the Hub)")
    if fmt == "hf":
        from qkv.export.hf_families import family_of, usage as family_usage

        if family_of(src) is not None:  # an imported model, written back as its own class
            return family_usage(src, here)
        dec = src.decode
        return f"""```python
from transformers import MarianMTModel, MarianTokenizer

{here}
tokenizer = MarianTokenizer.from_pretrained(model_dir)
model = MarianMTModel.from_pretrained(model_dir)
batch = tokenizer(["your sentence"], return_tensors="pt", padding=True)
# generation_config.json holds qkv's decoding settings. qkv's length limit is per source,
# {dec.max_len_a:g} * its tokens (with EOS) + {dec.max_len_b}, at most {MAX_OUTPUT_LEN}, then EOS; for this batch's longest:
limit = min(int({dec.max_len_a!r} * batch["input_ids"].shape[1] + {dec.max_len_b}), {MAX_OUTPUT_LEN}) + 1
out = model.generate(**batch, max_new_tokens=limit)
print(tokenizer.batch_decode(out, skip_special_tokens=True))
```"""
    from qkv.export.ct2 import HF_TOKENIZER, affixes, hf_tokenizer, is_encoder, joined, pieces

    if is_encoder(src):
        return encoder_usage(src, here)
    if src.task == "translate" and hf_tokenizer(src):
        before, after = affixes(src)
        return f"""```python
import os
import ctranslate2, tokenizers

{here}
translator = ctranslate2.Translator(model_dir)
tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "{HF_TOKENIZER}"))   # source and target
sources = [{joined(before, "tok.encode(text, add_special_tokens=False).tokens", after)}
           for text in ["your sentence"]]   # no {pieces(src.tokenizer("src"))[EOS]!r}: the model appends it
results = translator.translate_batch(sources, beam_size={src.decode.beam_size}, length_penalty={src.decode.length_penalty:g},
                                     min_decoding_length={src.decode.min_len})
print([tok.decode([tok.token_to_id(p) for p in r.hypotheses[0]], skip_special_tokens=True) for r in results])
```"""
    if src.task == "translate":
        return f"""```python
import os
import ctranslate2, sentencepiece as spm

{here}
translator = ctranslate2.Translator(model_dir)
source = spm.SentencePieceProcessor(model_file=os.path.join(model_dir, "source.spm"))
target = spm.SentencePieceProcessor(model_file=os.path.join(model_dir, "target.spm"))
pieces = source.encode(["your sentence"], out_type=str)        # no </s>: the model appends it
results = translator.translate_batch(pieces, beam_size={src.decode.beam_size}, length_penalty={src.decode.length_penalty:g},
                                     min_decoding_length={src.decode.min_len})
print([target.decode(r.hypotheses[0]) for r in results])
```"""
    # learned positions end: the prompt and what is generated fit the table
    budget = (f"min(100, {src.model.max_positions} - len(prompt))" if src.model.positional == "learned" else "100")
    if hf_tokenizer(src):
        vocab = pieces(src.tokenizer("tgt"))
        return f"""```python
import os
import ctranslate2, tokenizers

{here}
generator = ctranslate2.Generator(model_dir)
tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "{HF_TOKENIZER}"))
prompt = tok.encode("the text to continue", add_special_tokens=False).tokens   # or [{vocab[BOS]!r}] for no prompt
result = generator.generate_batch([prompt], max_length={budget}, sampling_topk=1, include_prompt_in_result=False,
                                  end_token=[])   # {vocab[EOS]!r} is a line break, not the end
print(tok.decode([tok.token_to_id(p) for p in result[0].sequences[0]]))
```"""
    prompt = ("sp.encode('your sentence', out_type=str) + ['</s>', '<sep>', '<s>']" if src.task == "prefix_lm"
              else "sp.encode('the text to continue', out_type=str)   # or ['<s>'] for no prompt")
    ending = ("end_token='</s>')" if src.task == "prefix_lm"
              else "end_token=[])   # '</s>' is a line break, not the end")
    return f"""```python
import os
import ctranslate2, sentencepiece as spm

{here}
generator = ctranslate2.Generator(model_dir)
sp = spm.SentencePieceProcessor(model_file=os.path.join(model_dir, "spm.model"))
prompt = {prompt}
result = generator.generate_batch([prompt], max_length={budget}, sampling_topk=1, include_prompt_in_result=False,
                                  {ending}
print(sp.decode(result[0].sequences[0]))
```"""


def encoder_usage(src: Source, here: str) -> str:
    """An encoder's code: texts to the pieces qkv's encoder reads, ``ctranslate2.Encoder``'s last hidden states,
    and the sentence vectors ``qkv embed`` makes of them (its pooling, its normalisation)."""
    from qkv.config import CLS
    from qkv.export.ct2 import ENCODER_SPM, HF_TOKENIZER, affixes, encoder_embedding, hf_tokenizer, joined, pieces

    emb = encoder_embedding(src)
    cls = pieces(src.tokenizer("src"))[CLS]
    if hf_tokenizer(src, "src"):
        before, after = affixes(src)
        load = f'tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "{HF_TOKENIZER}"))'
        split = joined(before, "tok.encode(text, add_special_tokens=False).tokens", after)
        module = "tokenizers"
    else:
        after = []
        load = f'sp = spm.SentencePieceProcessor(model_file=os.path.join(model_dir, "{ENCODER_SPM}"))'
        split = "sp.encode(text, out_type=str)"
        module = "sentencepiece as spm"
    keep = f"p[:{emb['max_pieces'] - len(after)}] + {after!r}" if after else f"p[:{emb['max_pieces']}]"
    pool, how = (("states[i, 0]", "the first piece's state") if emb["pooling"] == "cls" else
                 ("states[i, : len(p)].mean(axis=0)", "the mean over the text's pieces"))
    norm = ("\nvectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # the model's Normalize"
            if emb["normalize"] else "")
    return f"""```python
import os
import ctranslate2, numpy as np, {module}

{here}
encoder = ctranslate2.Encoder(model_dir)
{load}

def pieces(text):
    p = {split}
    return [{cls!r}] + (p if len(p) <= {emb['max_pieces']} else {keep})   # cut as qkv cuts a text

batch = [pieces(text) for text in ["your sentence", "another one"]]
states = np.array(encoder.forward_batch(batch).last_hidden_state)   # (batch, longest, {src.model.d_model}); padding past each row
vectors = np.stack([{pool} for i, p in enumerate(batch)])   # {how}, as qkv embed pools{norm}
print(vectors.shape)
```"""


def write_card(src: Source, fmt: str, out: Path, info: CardInfo, export_info: dict, location: Path | None = None) -> dict:
    """Write ``out/README.md`` for an export that will be at ``location`` (default: ``out``), the
    directory its code names; returns the front matter."""
    test = score_test_set(src, info)
    valid = validation_scores(src)
    meta = front_matter(src, fmt, info, test, valid)
    cfg = src.model
    kind = {"translate": "an encoder-decoder Transformer for translation",
            "lm": "a decoder-only Transformer language model",
            "prefix_lm": "a decoder-only Transformer translating as a prefix language model",
            "classify": ("an encoder-only Transformer (its encoder stack; the classifier is not exported)"
                         if fmt == "ctranslate2" else "a Transformer encoder classifier"),
            "mlm": ("an encoder-only Transformer (its encoder stack; the masked-LM head is not exported)"
                    if fmt == "ctranslate2" else "a Transformer encoder"),
            }.get(src.task, src.task)
    runtime = export_info.get("runtime", "")
    imported = (src.config.get("imported") or {}).get("architecture") if isinstance(src.config.get("imported"),
                                                                                   dict) else None
    vocab = src.tokenizer("tgt").vocab_size
    from qkv.data.tokenizer import Tokenizer

    spm = isinstance(src.tokenizer("tgt"), Tokenizer)  # qkv's own SentencePiece model (a trained lm's, --format hf)
    tokens = (f"{vocab} ids, the imported tokenizer.json" if "tokenizer_json" in export_info and not spm
              else f"{vocab} pieces, SentencePiece {src.train.tokenizer}"
              + (", written as tokenizer.json" if "tokenizer_json" in export_info else ""))
    lines = [
        "---", to_yaml(meta), "---", "",
        f"# {src.path.parent.name or src.path.name}: {kind}",
        "",
        (f"Imported from a {imported} folder by qkv {src.qkv_version}" if imported else
         f"Trained with qkv {src.qkv_version} (the Transformer of \"Attention Is All You Need\")")
        + f", exported from `{checkpoint_name(src.path)}` for `{runtime}`: {'pre' if cfg.norm_first else 'post'}-norm, "
        f"d_model {cfg.d_model}, {cfg.n_heads} heads, d_ff {cfg.d_ff}, "
        + (f"{cfg.n_encoder_layers} encoder and {cfg.n_decoder_layers} decoder layers" if src.task == "translate"
           else f"{cfg.n_encoder_layers} layers" if src.task in ("mlm", "classify") else f"{cfg.n_decoder_layers} layers")
        + f", {cfg.positional} positions, "
        + ("one vocabulary" if src.task in ("classify", "mlm") else "one shared vocabulary" if src.tokenizers.joint
           else "separate source and target vocabularies")
        + f" ({tokens}).",
        "",
        "## Use",
        "",
        "Install (qkv itself is not needed):",
        "",
        "```bash",
        install_line(fmt, export_info),
        "```",
        "",
        usage(src, fmt, Path(location or out).resolve().name),
        "",
    ]
    if "tokenize" in export_info:
        lines += ["## Tokenization", "",
                  f"- text to tokens: {export_info['tokenize']}",
                  *([f"- tokens to text: {export_info['detokenize']}"] if "detokenize" in export_info else []),
                  "- the vocabulary files list the pieces in the order of qkv's ids (CTranslate2's token ids are qkv's)"
                  + ("; special ids: " + ", ".join(f"{k} {v}" for k, v in export_info["special_ids"].items())
                     if export_info.get("special_ids") else ""),
                  "- qkv_export.json says the same as data" + (", with the decoding settings" if "decode" in export_info
                                                               else ""), ""]
    if test is not None or valid is not None:
        lines += ["## Scores", ""]
        if test is not None:
            lines += [f"- {test.name} ({test.sentences} sentences), decoded by qkv from the checkpoint with its saved "
                      f"settings (beam {src.decode.beam_size}, length penalty {src.decode.length_penalty:g} "
                      f"{src.decode.length_norm}): BLEU {test.bleu} (sacreBLEU signature: {test.bleu_signature}), "
                      f"chrF {test.chrf} ({test.chrf_signature})"]
        if valid is not None:
            exact = own_metric(src, valid) == "exact"
            parts = ([f"exact match {100 * valid['valid_exact']:.2f}%"] if exact and "valid_exact" in valid else
                     [f"{name} {valid[key]:.2f}" for key, name in (("valid_bleu", "BLEU"), ("valid_chrf", "chrF"))
                      if key in valid])
            parts += [f"perplexity {valid['valid_ppl']:.2f}"] if "valid_ppl" in valid else []
            lines += [f"- validation at step {valid.get('step', '?')} (from the run's metrics.jsonl; "
                      f"{'exact match' if exact else 'BLEU and chrF'} on greedy output of the first "
                      f"{src.train.eval_bleu_samples} validation sentences): " + ", ".join(parts)]
        lines.append("")
    diffs = export_info.get("differences") or export_info.get("decode", {}).get("differences") or []
    if diffs:
        lines += ["## Where it may differ from `qkv translate`", "", *[f"- {d}" for d in diffs], ""]
    check = export_info.get("verified", {})
    if check:
        lines += ["## Checked at export", "", "The exported model and the checkpoint's own network were run on the same "
                  f"probe sequences: {json.dumps(check)}.", ""]
    lines += ["## Training configuration", "", "```json",
              json.dumps(public_config(src), indent=2, ensure_ascii=False), "```", ""]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")
    return meta


__all__ = ["CardInfo", "write_card", "to_yaml", "languages", "checkpoint_name", "file_names", "install_line"]
