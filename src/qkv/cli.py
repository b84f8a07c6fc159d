"""The ``qkv`` command: a thin layer over the public functions.

    qkv train      train a model (on the embedded default task when no data is given)
    qkv translate  translate arguments, a file or stdin with a trained model
    qkv generate   continue a text with a language model (sampling, streamed)
    qkv evaluate   sacreBLEU and chrF of a hypothesis file, or of a model's output, against references;
                   accuracy, macro-F1 and the confusion matrix of a classifier (--test)
    qkv classify   label texts with a classifier (--task classify)
    qkv fill       the top predictions for [MASK] of a masked language model (--task mlm)
    qkv embed      sentence embeddings (mean or <cls> pooling) to .npy or .tsv
    qkv search     rank a corpus by cosine similarity to a query
    qkv average    average the parameters of several checkpoints
    qkv info       parameter count by component and training FLOPs per token
    qkv viz        attention maps (PNG + HTML), the positional encoding, the schedule, a run's curves
    qkv bench      Table 1 measured (layers), long-range dependency (long-range)

Model, training and decoding flags are generated from the fields of ``ModelConfig``,
``TrainConfig`` and ``DecodeConfig``. Settings are taken, later winning, from: the preset, the
``--config`` TOML file, the flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
from pathlib import Path

from qkv.config import SECTIONS, DecodeConfig, ModelConfig, TrainConfig, layered, load_toml, override, preset, PRESETS
from qkv.errors import QkvError
from qkv.files import atomic_output, check_not_input, check_output_dir, check_output_file, os_error_message

# --- flags from dataclasses --------------------------------------------------------------------------

def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    group = parser.add_argument_group(title)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.metadata.get("hidden"):
            continue
        flag = "--" + f.name.replace("_", "-")
        helptext = f"{f.metadata.get('help', f.name)} (default: {getattr(defaults, f.name)!r}, or the preset's)"
        helptext = helptext.replace("%", "%%")  # argparse formats help with %
        if f.type in (bool, "bool"):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
            group.add_argument(flag, dest=f.name, type=kind, default=None, metavar=f.name.upper(), help=helptext)


def flags_for(args: argparse.Namespace, cls: type) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if not f.metadata.get("hidden") and getattr(args, f.name, None) is not None}


def resolve_configs(args: argparse.Namespace, default_preset: str = "small", resume_from: Path | None = None,
                    embedded: bool = False) -> tuple[ModelConfig, TrainConfig, DecodeConfig]:
    """The preset (``embedded``: the embedded task's recipe; ``resume_from``: the run's own settings)
    < the --config file < flags (:func:`qkv.config.layered`)."""
    flags = {s: flags_for(args, cls) for s, cls in zip(SECTIONS, (ModelConfig, TrainConfig, DecodeConfig))}
    config = getattr(args, "config", None)
    file = load_toml(config) if config else {}
    if resume_from is not None:
        return layered(saved_configs(resume_from), file, str(config), flags, resumed=True)
    if embedded and not (args.preset or config):
        from qkv.data import toy

        model = override(toy.MODEL, flags["model"], "flags")
        base = (toy.MODEL, toy.RNN_TRAIN if model.is_recurrent else toy.TRAIN, DecodeConfig())
    else:
        base = (*preset(args.preset or file.get("preset") or default_preset), DecodeConfig())
    return layered(base, file, str(config or "config"), flags)


def saved_configs(last: Path) -> tuple[ModelConfig, TrainConfig, DecodeConfig]:
    """The settings of the run whose commit point is ``last``."""
    from qkv.checkpoint import read_config
    from qkv.training.rundir import missing_last_message

    if not last.exists():
        raise QkvError(missing_last_message(last.parent))
    return tuple(read_config(last, section) for section in SECTIONS)  # type: ignore[return-value]


# --- commands ----------------------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace) -> int:
    import os

    from qkv.training.rundir import RunLock, recover

    check_output_dir(args.out, "--out")  # a file or an unwritable place is named before anything is locked or read
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 alone locks the run directory
        return train_command(args)
    with RunLock(args.out):  # before any data is read: a second process on this --out stops at once
        recover(args.out, log)  # a save cut short by a crash: finished or rolled back before last/ is read
        return train_command(args)


def train_command(args: argparse.Namespace) -> int:
    from qkv.tasks import DataPaths
    from qkv.training.run import check_paths, run_training

    paths = DataPaths(args.train, args.valid, args.src_train, args.tgt_train, args.src_valid, args.tgt_valid,
                      args.text_field, args.label_field, args.strip_gutenberg, args.valid_fraction)
    check_paths(paths)
    out = Path(args.out)
    embedded = not (args.src_train or args.train)
    configs = resolve_configs(args, resume_from=out / "last" if args.resume else None, embedded=embedded)
    result = run_training(*configs, paths, out, args.resume, log)
    if embedded and result.is_main:  # under torchrun, rank 0 alone
        from qkv.data.toy import held_out_report
        from qkv.frontends import load

        print(held_out_report(load(out / "best"), out))
    return 0


@contextlib.contextmanager
def output_stream(path: str | None):
    """``--output FILE`` written all or nothing (:func:`qkv.files.atomic_output`), or stdout."""
    if not path:
        yield sys.stdout
        return
    with atomic_output(path) as fh:
        yield fh


def open_model(path: str, command: str, **kwargs):
    """:func:`qkv.frontends.open_model`, imported when a command needs it (``--help`` stays fast)."""
    from qkv.frontends import open_model as open_

    return open_(path, command, **kwargs)


def load_ensemble(paths: list[str], **kwargs):
    from qkv.frontends import load_ensemble as load_

    return load_(paths, **kwargs)


def checkpoint_task(path: str) -> str | None:
    from qkv.frontends import checkpoint_task as task_of

    return task_of(path)


def check_output(output: str | None, **inputs: str | None) -> None:
    """Before anything is loaded: ``--output`` can be written and is none of the input files
    (``inputs``: flag name -> path, e.g. ``input=args.input``)."""
    if not output:
        return
    for name, path in inputs.items():
        check_not_input(output, path, ("--output", "--" + name.replace("_", "-")))
    check_output_file(output)


def cmd_translate(args: argparse.Namespace) -> int:
    check_output(args.output, input=args.input)
    model = load_translator(args)
    overrides = flags_for(args, DecodeConfig)
    nbest = dataclasses.replace(model.decode_cfg, **overrides).validate().nbest  # a bad flag fails first
    lines = read_inputs(args)
    warn = truncation_warning("translate", args, "translated")
    with output_stream(args.output) as out_fh:
        for k, hyps in enumerate(model.translate_lines(lines, warn, **overrides)):
            out_fh.write("".join(f"{k}\t{score:.4f}\t{text}\n" for text, score in hyps) if nbest > 1
                         else hyps[0][0] + "\n")
            out_fh.flush()
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from qkv.data.corpus import read_lines
    from qkv.metrics import language_of, translation_report

    check_output(args.output, src=args.src, ref=args.ref, hyp=args.hyp, test=args.test)
    if args.test and args.ensemble:
        raise QkvError("--ensemble is for translation (MODEL with --src and --ref), not for --test")
    if args.test:
        return evaluate_lm(args) if args.model and checkpoint_task(args.model) == "lm" else evaluate_classifier(args)
    if not args.ref:
        raise QkvError("give --ref (references, for a translation) or --test (labelled data for a classifier, "
                       "plain text for a language model)")
    refs = read_lines(args.ref)
    hyps = translate_for_evaluation(args, len(refs)) if args.model else read_hypotheses(args, len(refs))
    print(translation_report(hyps, refs, args.lang or language_of(args.ref)))
    return 0


def translate_for_evaluation(args: argparse.Namespace, n_refs: int) -> list[str]:
    """MODEL's translations of --src (also written to --output when given)."""
    from qkv.data.corpus import read_lines

    if not args.src:
        raise QkvError("evaluating a model needs --src (the source sentences to translate)")
    src = read_lines(args.src)
    if len(src) != n_refs:
        raise QkvError(f"{args.src} has {len(src)} lines but {args.ref} has {n_refs}")
    hyps = load_translator(args).translate(src, **flags_for(args, DecodeConfig))
    if args.output:
        write_lines(args.output, hyps)
    return hyps


def read_hypotheses(args: argparse.Namespace, n_refs: int) -> list[str]:
    """The --hyp file, with the options that need a MODEL refused by name."""
    from qkv.data.corpus import read_lines

    if args.int8 or args.ensemble:
        what = "--int8 quantises a MODEL" if args.int8 else "--ensemble decodes with MODEL and more checkpoints"
        raise QkvError(f"{what}: give a MODEL with --src (not --hyp)")
    if not args.hyp:
        raise QkvError("give a MODEL with --src, or --hyp, to evaluate against --ref")
    hyps = read_lines(args.hyp)
    if len(hyps) != n_refs:
        raise QkvError(f"{args.hyp} has {len(hyps)} lines but {args.ref} has {n_refs}")
    return hyps


def write_lines(path: str, lines: list[str]) -> None:
    """One line per item, all or nothing."""
    with atomic_output(path) as fh:
        fh.write("".join(line + "\n" for line in lines))


def evaluate_lm(args: argparse.Namespace) -> int:
    """Perplexity per token and bits per character of a language model on plain --test text."""
    from qkv.data.text import holdout_split, read_text, strip_gutenberg

    lines = read_text(args.test)
    if args.strip_gutenberg:
        lines = strip_gutenberg(lines, args.test)
    what = args.test
    if args.last_fraction:
        _, lines = holdout_split(lines, args.last_fraction)
        what = f"{args.test} (the last {args.last_fraction:g} of the text, as --valid-fraction holds out)"
    r = open_model(args.model, "evaluate").score(lines)
    print(f"{what}: perplexity {r.ppl:.4f} per token ({r.tokens} tokens), "
          f"{r.bpc:.4f} bits per character ({r.characters} characters, newlines counted)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    check_option_bounds(seed=args.seed, temperature=args.temperature, top_p=args.top_p)
    model = open_model(args.model, "generate")
    temperature = 0.0 if args.greedy else args.temperature
    out = sys.stdout
    out.write(args.prefix)
    out.flush()
    for piece in model.generate(args.prefix, args.max_new_tokens, temperature, args.top_k, args.top_p, args.seed):
        out.write(piece)
        out.flush()  # streamed: each piece as it is produced
    out.write("\n")
    return 0


def check_option_bounds(seed: int | None = None, threads: int = 0, **floats: float) -> None:
    """The bounds TrainConfig.validate sets, for commands that take --seed, --threads or float
    options as plain flags: torch overflows on a seed beyond 64 bits and crashes on thousands of
    threads; inf and nan are refused by name."""
    from qkv.config import MAX_SEED, MAX_THREADS

    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise QkvError(f"--seed must be in [0, 2**63 - 1], got {seed}")
    if not 0 <= threads <= MAX_THREADS:
        raise QkvError(f"--threads must be in [0, {MAX_THREADS}] (0: torch's default), got {threads}")
    for name, value in floats.items():
        if not math.isfinite(value):
            raise QkvError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


def load_translator(args: argparse.Namespace):
    """MODEL, or MODEL with the --ensemble checkpoints as one ensemble; a clear error if not a translator."""
    quantize = "int8" if args.int8 else None
    if getattr(args, "ensemble", None):
        return load_ensemble([args.model, *args.ensemble], quantize=quantize)
    return open_model(args.model, "translate", quantize=quantize)


def evaluate_classifier(args: argparse.Namespace) -> int:
    """Accuracy, macro-F1 and the confusion matrix of a classifier on labelled --test data."""
    from qkv.data.labelled import read_labelled

    if not args.model:
        raise QkvError("--test needs a MODEL (a classifier checkpoint)")
    if checkpoint_task(args.model) not in (None, "classify"):
        raise QkvError(f"{args.model} is not a classifier: --test evaluates --task classify and --task lm models "
                       "(score translations with --src and --ref)")
    model = open_model(args.model, "classify")
    data = read_labelled(args.test, args.text_field, args.label_field)
    report = model.evaluate(data.texts, data.labels, lambda i: f"{args.test}:{data.line(i)}")
    if args.output:
        write_lines(args.output, [model.labels[p] for p in report.preds])
    print(report.text(args.test))
    return 0


def truncation_warning(command: str, args: argparse.Namespace, done: str):
    """A handler for the inputs a model cuts to its length (``indices`` into the input lines): one
    warning on stderr naming the file and lines, and the length kept."""
    source = "<arguments>" if args.text else args.input if args.input and args.input != "-" else "<stdin>"

    def warn(indices: list[int], kept: int) -> None:
        numbers = [i + 1 for i in indices]
        where = f"{source}:{numbers[0]}" if len(numbers) == 1 else f"{source}: lines " + ", ".join(
            map(str, numbers[:10])) + (f" and {len(numbers) - 10} more" if len(numbers) > 10 else "")
        log(f"qkv {command}: warning: {where}: longer than the {kept} tokens the model reads; "
            f"{done} from the first {kept}")
    return warn


def read_inputs(args: argparse.Namespace) -> list[str]:
    """Texts from the arguments, --input FILE or stdin, one a line."""
    from qkv.data.corpus import decode_lines, read_lines

    if args.text:
        return list(args.text)
    if args.input and args.input != "-":
        return read_lines(args.input)
    return decode_lines(sys.stdin.buffer.read(), "<stdin>")


def cmd_classify(args: argparse.Namespace) -> int:
    check_output(args.output, input=args.input)
    model = open_model(args.model, "classify")
    warn = truncation_warning("classify", args, "classified")
    with output_stream(args.output) as out_fh:
        for p in model.classify_lines(read_inputs(args), warn):
            if p is None:  # an empty input line stays an empty output line
                out_fh.write("\n")
                continue
            c = int(p.argmax())
            extra = "\t" + " ".join(f"{lab}={float(v):.4f}" for lab, v in zip(model.labels, p)) if args.all else ""
            out_fh.write(f"{model.labels[c]}\t{float(p[c]):.4f}{extra}\n")
            out_fh.flush()
    return 0


def cmd_fill(args: argparse.Namespace) -> int:
    model = open_model(args.model, "fill")
    for text in args.text:
        print(text)
        for m, preds in enumerate(model.fill(text, args.top_k)):
            for piece, p in preds:
                print(f"  [MASK]{m + 1 if len(preds) and text.count('[MASK]') > 1 else ''}  {p:.4f}  {piece}")
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    from qkv.data.corpus import read_lines
    from qkv.frontends.encoder import write_vectors

    if Path(args.output).suffix not in (".npy", ".tsv"):
        raise QkvError(f"--output {args.output}: choose a .npy (NumPy array) or .tsv (one vector a line) file")
    check_output(args.output, input=args.input)
    model = open_model(args.model, "embed")
    lines = read_lines(args.input)
    empty = next((i for i, line in enumerate(lines, start=1) if not line.strip()), None)
    if empty:
        raise QkvError(f"{args.input}:{empty}: empty line (every line is one text to embed)")
    vectors = model.embed(lines, args.pooling)
    write_vectors(vectors, args.output)
    pooling = args.pooling or "the model's"
    log(f"wrote {vectors.shape[0]} x {vectors.shape[1]} embeddings ({pooling} pooling) to {args.output}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from qkv.data.corpus import read_lines

    model = open_model(args.model, "search")
    corpus = read_lines(args.corpus)
    rows = [i for i, line in enumerate(corpus) if line.strip()]
    if not rows:
        raise QkvError(f"{args.corpus}: no text to search")
    vectors = model.embed([corpus[i] for i in rows], args.pooling)
    for query in args.query:
        if not query.strip():
            raise QkvError("empty query")
        print(f"query: {query}")
        for score, j in model.search(query, None, args.top_k, args.pooling, corpus_vectors=vectors):
            print(f"  {score:.4f}  {rows[j] + 1}: {corpus[rows[j]]}")
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from qkv.training.average import average_checkpoints

    used = average_checkpoints(args.inputs, args.out, last=args.last)
    log(f"averaged {len(used)} checkpoints ({used[0].name} .. {used[-1].name}) into {args.out}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from qkv.info import describe
    from qkv.models import build_model

    if args.model:
        from qkv.frontends import load

        model = load(args.model).model
    else:
        model_cfg, _, _ = resolve_configs(args, default_preset="base")
        v = args.vocab_size or 37000
        with torch.device("meta"):  # shapes only: no memory, no time
            model = build_model(dataclasses.replace(model_cfg, src_vocab_size=v, tgt_vocab_size=v))
    print(describe(model, args.src_len, args.tgt_len))
    return 0


ATTENTION_HELP = """\
Every attention layer and head of MODEL for one input, tokens on the axes, from one forward pass.
Writes OUT.png and OUT.html (a self-contained page: choose the attention, layer and head; hover
over a cell for its weight). Each row (a query) sums to 1 over the keys it may see.

  translate, Transformer       encoder self-, decoder masked self- and cross-attention
  translate, rnn/lstm/gru      the alignment matrix a_t(s) (with --attention other than none)
  classify, mlm (Transformer)  encoder self-attention over <cls> + TEXT
  lm (Transformer)             masked self-attention over TEXT (query i sees keys j <= i)
  prefix_lm                    masked self-attention over 'source </s> <sep> <s> target'
  recurrent lm / classifier    no attention: an error, nothing written

A translation model (translate, prefix_lm) reads --target, or without it its own greedy translation.

examples:
  qkv viz attention runs/default/best "three hundred twenty-one" --target dreihunderteinundzwanzig
  qkv viz attention runs/imdb/best "a great film" --out imdb      # imdb.png, imdb.html
"""


def cmd_viz(args: argparse.Namespace) -> int:
    from qkv import viz

    if args.what == "attention":
        data = viz.attention_data(open_model(args.model, "viz"), args.text, args.target)
        if data["target_from"] == "greedy":
            print(f"target: the model's own greedy translation (give --target to choose): {data['target']}")
        written = viz.write_attention(data, args.out)
    elif args.what == "positional":
        written = [viz.positional_png(args.positions, args.dim, args.out)]
    elif args.what == "schedule":
        written = [viz.schedule_png(args.d_model, args.warmup, args.steps, args.scale, args.out)]
    else:
        written = [viz.training_png(args.run, args.out)]
    for path in written:
        print(f"wrote {path}")
    return 0


# --- parser ------------------------------------------------------------------------------------------

ENSEMBLE_HELP = ("decode with MODEL and this checkpoint as an ensemble: the mean of their next-token "
                 "distributions at every step (repeat for more members; they must share MODEL's tokenizer)")
INT8_HELP = ("dynamic int8 quantisation of the model's linear layers for faster CPU decoding "
             "(a small BLEU cost: see docs/results.md)")


def log(msg: str) -> None:
    import os

    if os.environ.get("WORLD_SIZE", "1") not in ("", "1") and os.environ.get("RANK", "0") != "0":
        return  # under torchrun only rank 0 speaks
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help only where it tells something: not for options whose
    default is None (their help says what happens without them, e.g. "the preset's"), and not where the
    help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or "(default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qkv",
        description="The Transformer of 'Attention Is All You Need', trained and used end to end.",
        epilog="Run 'qkv COMMAND --help' for a command's options. With no data, 'qkv train' learns the "
               "embedded default task (English number words -> German) in a few minutes on a CPU.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train a model", formatter_class=DefaultsHelpFormatter,
                       description="Train a model for a task (--task): translate (the default: an encoder-decoder "
                                   "Transformer, or with --arch lstm|gru|rnn a recurrent encoder-decoder with or "
                                   "without attention, on parallel text, --src-train/--tgt-train, one sentence a line, plain or gzip), "
                                   "classify (labelled text, --train/--valid JSONL or TSV), mlm (masked-LM "
                                   "pretraining of an encoder on plain text, --train/--valid), lm (a language model on plain "
                                   "text, --train with --valid or --valid-fraction: decoder-only Transformer or "
                                   "--arch rnn/lstm/gru with truncated BPTT over --max-len steps), prefix_lm (a "
                                   "decoder-only translator on 'source <sep> target', parallel files). With no data, "
                                   "trains on the embedded default translation task. Checkpoints go to OUT/last "
                                   "and OUT/best, metrics to OUT/metrics.jsonl.",
                       epilog="examples:\n  qkv train --task classify --train train.jsonl --valid valid.jsonl "
                              "--pooling mean --out runs/clf\n  qkv train --task mlm --train texts.txt --out runs/mlm\n"
                              "  qkv train --task classify --init-from runs/mlm/best --train train.jsonl --out runs/clf2\n"
                              "  qkv train --task lm --arch lstm --tokenizer char --train book.txt --strip-gutenberg "
                              "--valid-fraction 0.1 --out runs/lm\n"
                              "  qkv train --task prefix_lm --out runs/prefix   (the embedded default task)")
    t.add_argument("--train", help="one-sided tasks (classify, mlm, lm): training file; classify: JSONL "
                                   "({\"text\": ..., \"label\": ...} a line) or TSV with a header; mlm/lm: plain "
                                   "text, one text a line (or JSONL/TSV); plain or gzip")
    t.add_argument("--valid", help="one-sided tasks: validation file, same format as --train")
    t.add_argument("--valid-fraction", type=float, default=0.0, metavar="F",
                   help="lm: no --valid file; hold out the last F of the --train text (e.g. 0.1)")
    t.add_argument("--strip-gutenberg", action="store_true",
                   help="lm: keep only the book between the '*** START' and '*** END' lines of a Project "
                        "Gutenberg text (an error if they are missing)")
    t.add_argument("--text-field", default="text", help="JSONL key / TSV column of the text")
    t.add_argument("--label-field", default="label", help="JSONL key / TSV column of the label (classify)")
    t.add_argument("--src-train", help="training source file")
    t.add_argument("--tgt-train", help="training target file (same number of lines)")
    t.add_argument("--src-valid", help="validation source file")
    t.add_argument("--tgt-valid", help="validation target file")
    t.add_argument("--out", default="runs/default", help="run directory")
    t.add_argument("--resume", action="store_true", help="continue the run in OUT from OUT/last exactly where it stopped")
    t.add_argument("--preset", choices=PRESETS, help="model and training preset (default: small, or the "
                                                      "embedded task's own recipe when no data is given)")
    t.add_argument("--config", help="TOML file with [model], [train], [decode] tables (and 'preset')")
    add_config_flags(t, ModelConfig, "model (ModelConfig)")
    add_config_flags(t, TrainConfig, "training (TrainConfig)")
    add_config_flags(t, DecodeConfig, "decoding for validation and the saved model (DecodeConfig)")
    t.set_defaults(func=cmd_train)

    tr = sub.add_parser("translate", help="translate with a trained model",
                        description="Translate sentences given as arguments, a file (--input) or stdin, one "
                                    "per line, to stdout (or --output). Empty lines stay empty. With --nbest N "
                                    "each line is 'index<TAB>score<TAB>translation'.")
    tr.add_argument("model", help="checkpoint directory, e.g. runs/default/best")
    tr.add_argument("text", nargs="*", help="sentences to translate (else --input or stdin)")
    tr.add_argument("--input", "-i", help="file to translate, plain or gzip ('-' = stdin)")
    tr.add_argument("--output", "-o", help="write translations here instead of stdout (all or nothing: the file is "
                                           "replaced only when every line is translated)")
    tr.add_argument("--int8", action="store_true", help=INT8_HELP)
    tr.add_argument("--ensemble", action="append", metavar="CHECKPOINT", help=ENSEMBLE_HELP)
    add_config_flags(tr, DecodeConfig, "decoding (default: the model's saved settings)")
    tr.set_defaults(func=cmd_translate)

    ev = sub.add_parser("evaluate", help="BLEU and chrF of translations; accuracy, macro-F1 of a classifier",
                        description="Translation: score detokenized output against raw references with sacreBLEU "
                                    "(BLEU, cased, 13a tokenization; chrF) and print the signatures. Either score "
                                    "a hypothesis file (--hyp) or translate --src with MODEL first. "
                                    "Classification: 'qkv evaluate MODEL --test FILE' (labelled JSONL or TSV) "
                                    "prints accuracy, macro-F1 (the mean of the per-class F1) and the confusion "
                                    "matrix.")
    ev.add_argument("model", nargs="?", help="checkpoint directory (translate --src, then score)")
    ev.add_argument("--src", help="source file to translate with MODEL")
    ev.add_argument("--hyp", help="hypothesis file (instead of MODEL)")
    ev.add_argument("--ref", help="reference file (raw text, one line per sentence)")
    ev.add_argument("--test", help="classifier: labelled test file (JSONL or TSV, as for training); language "
                                  "model: plain text, scored as perplexity and bits per character")
    ev.add_argument("--strip-gutenberg", action="store_true",
                    help="language model: score only the book between the '*** START' and '*** END' lines")
    ev.add_argument("--last-fraction", type=float, default=0.0,
                    help="language model: score only the last F of the text (what --valid-fraction F held out)")
    ev.add_argument("--text-field", default="text", help="classifier: JSONL key / TSV column of the text")
    ev.add_argument("--label-field", default="label", help="classifier: JSONL key / TSV column of the label")
    ev.add_argument("--output", "-o", help="also save MODEL's translations (or predicted labels) here")
    ev.add_argument("--int8", action="store_true", help=INT8_HELP)
    ev.add_argument("--ensemble", action="append", metavar="CHECKPOINT", help=ENSEMBLE_HELP)
    ev.add_argument("--lang", help="target language for the Moses tokenizer of the lowercased BLEU "
                                   "(default: from the --ref file name, e.g. test.de)")
    add_config_flags(ev, DecodeConfig, "decoding (default: the model's saved settings)")
    ev.set_defaults(func=cmd_evaluate)

    g = sub.add_parser("generate", help="continue a text with a language model (streamed)",
                       formatter_class=DefaultsHelpFormatter,
                       description="Continue --prefix with a language model trained with --task lm, printing "
                                   "the text as it is produced (each token flushed). Tokens are drawn from the "
                                   "model's next-token distribution reshaped by --temperature (T<1 sharper, "
                                   "T>1 flatter), --top-k (keep the k most probable) and --top-p (keep the "
                                   "smallest set with probability mass >= p); --greedy takes the most probable "
                                   "token every time. --seed makes a draw repeatable. The Transformer keeps a "
                                   "key/value cache, the RNNs their state: each new token costs one step.",
                       epilog='example: qkv generate runs/timemachine/lstm/best --prefix "the time traveller" '
                              "--temperature 0.8 --top-p 0.95 --seed 1")
    g.add_argument("model", help="checkpoint directory of a --task lm run, e.g. runs/tm/best")
    g.add_argument("--prefix", default="", help="the text to continue (may be empty)")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=1.0, help="divide the logits by T (> 0)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the nucleus of mass p (1: all)")
    g.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh draw each run)")
    g.add_argument("--greedy", action="store_true", help="always the most probable token (temperature 0)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("classify", help="label texts with a trained classifier",
                       description="Print the most probable label and its probability ('label<TAB>prob') for "
                                   "each text given as an argument, in a file (--input) or on stdin, one per "
                                   "line. An empty input line gives an empty output line. Texts are cleaned as "
                                   "in training (<br /> -> space) and truncated to the model's max_len tokens.",
                       epilog='example: qkv classify runs/imdb/best "this movie is so great"')
    c.add_argument("model", help="checkpoint directory of a --task classify run, e.g. runs/imdb/best")
    c.add_argument("text", nargs="*", help="texts to classify (else --input or stdin)")
    c.add_argument("--input", "-i", help="file with one text a line, plain or gzip ('-' = stdin)")
    c.add_argument("--output", "-o", help="write the labels here instead of stdout")
    c.add_argument("--all", action="store_true", help="also print every label's probability")
    c.set_defaults(func=cmd_classify)

    fl = sub.add_parser("fill", help="fill in [MASK] with a masked language model",
                        description="Show the most probable pieces for each [MASK] in the text, with their "
                                    "probabilities, from a --task mlm model.",
                        epilog='example: qkv fill runs/mlm/best "the movie was [MASK]" --top-k 5')
    fl.add_argument("model", help="checkpoint directory of a --task mlm run")
    fl.add_argument("text", nargs="+", help="texts with one or more [MASK]")
    fl.add_argument("--top-k", type=int, default=5, dest="top_k", help="predictions per mask (default: %(default)s)")
    fl.set_defaults(func=cmd_fill)

    em = sub.add_parser("embed", help="sentence embeddings from an encoder",
                        description="Embed every line of --input with a classify or mlm model: the encoder's "
                                    "states pooled into one vector (mean over the tokens, or the <cls> state). "
                                    "Writes an N x d_model array: .npy (NumPy) or .tsv (one vector a line).",
                        epilog="example: qkv embed runs/mlm/best --input sentences.txt --output vectors.npy")
    em.add_argument("model", help="checkpoint directory of a --task classify or mlm run")
    em.add_argument("--input", "-i", required=True, help="one text a line (plain or gzip)")
    em.add_argument("--output", "-o", required=True, help="FILE.npy or FILE.tsv")
    em.add_argument("--pooling", choices=["mean", "cls"],
                    help="mean over the tokens or the <cls> state (default: a classifier's own, mean for mlm)")
    em.set_defaults(func=cmd_embed)

    se = sub.add_parser("search", help="rank the lines of a corpus by similarity to a query",
                        description="Embed every line of --corpus and each query (as qkv embed), and print the "
                                    "top-k lines by cosine similarity q.d / (|q| |d|), with their line numbers.",
                        epilog='example: qkv search runs/mlm/best --corpus reviews.txt "a funny film" --top-k 5')
    se.add_argument("model", help="checkpoint directory of a --task classify or mlm run")
    se.add_argument("query", nargs="+", help="query texts")
    se.add_argument("--corpus", required=True, help="one text a line (plain or gzip)")
    se.add_argument("--top-k", type=int, default=5, dest="top_k", help="results per query (default: %(default)s)")
    se.add_argument("--pooling", choices=["mean", "cls"], help="as for qkv embed")
    se.set_defaults(func=cmd_search)

    a = sub.add_parser("average", help="average checkpoints (the paper averages the last 5 or 20)",
                       description="Average the parameters of several checkpoints of one run into a new "
                                   "checkpoint for decoding: either list checkpoint directories, or give one run "
                                   "directory and --last N to take its newest N step_N/ checkpoints (saved during "
                                   "training with --keep-last N).")
    a.add_argument("inputs", nargs="+", help="checkpoint directories, or one run directory with --last")
    a.add_argument("--last", type=int, help="average the newest N step_N/ checkpoints of the run directory")
    a.add_argument("--out", required=True, help="where to write the averaged checkpoint: a new directory, not one "
                                                "of the checkpoints averaged nor the run's last/, best/, step_N/")
    a.set_defaults(func=cmd_average)

    i = sub.add_parser("info", help="parameter count and training FLOPs",
                       description="Print the parameter count by component and the training FLOPs per target "
                                   "token, for a preset (no weights are allocated) or a trained MODEL.")
    i.add_argument("model", nargs="?", help="checkpoint directory (instead of a preset)")
    i.add_argument("--preset", choices=PRESETS, help="model preset (default: base)")
    i.add_argument("--config", help="TOML file with a [model] table")
    i.add_argument("--vocab-size", type=int, dest="vocab_size", help="shared vocabulary size (default: 37000)")
    i.add_argument("--src-len", type=int, default=25, help="source tokens per sentence for the FLOPs")
    i.add_argument("--tgt-len", type=int, default=25, help="target tokens per sentence for the FLOPs")
    add_config_flags(i, ModelConfig, "model (ModelConfig)")
    i.set_defaults(func=cmd_info)

    v = sub.add_parser("viz", help="draw attention maps, the positional encoding, the schedule, a run's curves",
                       description="Pictures of what the model does and how it trained (needs matplotlib: "
                                   "pip install 'qkv[viz]').")
    v.set_defaults(func=cmd_viz)
    vs = v.add_subparsers(dest="what", required=True, metavar="WHAT")
    va = vs.add_parser("attention", help="every layer's and head's attention weights for one input",
                       description=ATTENTION_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    va.add_argument("model", help="checkpoint directory, e.g. runs/default/best")
    va.add_argument("text", help="the source sentence (translate, prefix_lm) or the text (classify, mlm, lm)")
    va.add_argument("--target", help="translate, prefix_lm: the target sentence the decoder reads "
                                     "(default: the model's greedy translation)")
    va.add_argument("--out", default="attention", help="output prefix: writes OUT.png and OUT.html (default: %(default)s)")
    vp = vs.add_parser("positional", help="the sinusoidal positional encoding as a heatmap",
                       description="PE(pos, 2i) = sin(pos/10000^(2i/d)), PE(pos, 2i+1) = cos(...) as a heatmap: "
                                   "positions down, dimensions across; the low dimensions change fastest.")
    vp.add_argument("--positions", type=int, default=60, help="positions (rows) (default: %(default)s)")
    vp.add_argument("--dim", type=int, default=32, help="d_model, even (columns) (default: %(default)s)")
    vp.add_argument("--out", default="positional.png", help="PNG file to write (default: %(default)s)")
    vsch = vs.add_parser("schedule", help="the warmup learning-rate schedule",
                         description="lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) "
                                     "(section 5.3), its peak at step = warmup marked.")
    vsch.add_argument("--d-model", type=int, default=512, dest="d_model", help="d_model (default: %(default)s)")
    vsch.add_argument("--warmup", type=int, default=4000, help="warmup steps (default: %(default)s)")
    vsch.add_argument("--steps", type=int, default=20000, help="steps to plot (default: %(default)s)")
    vsch.add_argument("--scale", type=float, default=1.0, help="factor on the rate, as --lr-scale (default: %(default)s)")
    vsch.add_argument("--out", default="schedule.png", help="PNG file to write (default: %(default)s)")
    vt = vs.add_parser("training", help="a run's loss, validation scores and learning rate",
                       description="Training and validation loss, validation BLEU / chrF / exact match "
                                   "(translate, prefix_lm) or accuracy / macro-F1 (classify), "
                                   "validation perplexity and the learning rate against the step, from "
                                   "RUN/metrics.jsonl (written by qkv train; a run still training is fine).")
    vt.add_argument("run", help="run directory (the --out of qkv train), e.g. runs/default")
    vt.add_argument("--out", default="training.png", help="PNG file to write (default: %(default)s)")
    add_bench_parser(sub)
    return p


# --- qkv bench (issue 6): Table 1 and the long-range task, measured ----------------------------------

def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    check_option_bounds(threads=args.threads, seed=getattr(args, "seed", None))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        text, written = bench_layers(args) if args.what == "layers" else bench_long_range(args)
    except ValueError as e:
        raise QkvError(str(e)) from None
    print(text)
    for path in written:
        print(f"wrote {path}")
    return 0


def bench_layers(args: argparse.Namespace) -> tuple[str, list[str]]:
    from qkv.complexity import bench_layers as bench

    if args.quick:
        args.d, args.n_min, args.n_max, args.r, args.repeats = 64, 16, 256, 8, 1
    kinds = [s.strip() for s in args.layers.split(",")] if args.layers else None
    return bench(args.out, args.d, args.n_min, args.n_max, args.r, args.k, args.heads, args.batch, args.repeats,
                 kinds, log=log)


def bench_long_range(args: argparse.Namespace) -> tuple[str, list[str]]:
    from qkv.long_range import bench_long_range as bench

    try:
        distances = [int(s) for s in args.distances.split(",")]
    except ValueError:
        raise QkvError(f"--distances: give comma-separated whole numbers, got {args.distances!r}") from None
    return bench(args.out, distances, args.models.split(","), args.steps, args.hidden, args.symbols, args.batch,
                 args.lr, args.seed, args.quick, log=log)


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="Table 1 and the long-range argument of section 4, measured",
                       description="Measure what section 4 ('Why Self-Attention') argues: the cost of one layer "
                                   "of each type as n grows (layers), and how far back each model can learn "
                                   "to look (long-range). Writes JSON + PNG (needs matplotlib).")
    b.set_defaults(func=cmd_bench)
    bs = b.add_subparsers(dest="what", required=True, metavar="WHAT")
    bl = bs.add_parser("layers", formatter_class=DefaultsHelpFormatter,
                       help="FLOPs, time, memory, sequential steps, path length of each layer type against n",
                       description="One layer each of self-attention, restricted self-attention (window ±r, "
                                   "blocked and as a dense band mask), LSTM, vanilla RNN, causal convolution "
                                   "(kernel k) and dilated convolution, forward + backward, at n = n-min, "
                                   "2·n-min, ..., n-max. Reports counted FLOPs, wall time, peak tensor memory, "
                                   "sequential steps (the critical path of dependent kernels) and the maximum "
                                   "path length (fewest stacked layers after which output n depends on input "
                                   "1, from gradients), fits each one's growth exponent in n beside Table 1 and "
                                   "locates where attention costs more than recurrence (the paper: n ≈ d). "
                                   "Writes OUT/complexity.{json,md,png}. The full default run took 18 minutes "
                                   "on one thread of a busy 2-core machine.")
    bl.add_argument("--d", type=int, default=512, help="representation dimension d")
    bl.add_argument("--n-min", type=int, default=16, dest="n_min", help="shortest sequence length")
    bl.add_argument("--n-max", type=int, default=4096, dest="n_max", help="longest sequence length")
    bl.add_argument("--r", type=int, default=64, help="radius of restricted attention: i sees j with |i-j| <= r")
    bl.add_argument("--k", type=int, default=3, help="convolution kernel width (dilation k^i in layer i)")
    bl.add_argument("--heads", type=int, default=8, help="attention heads h")
    bl.add_argument("--batch", type=int, default=1, help="sequences per batch")
    bl.add_argument("--repeats", type=int, default=3, help="timed runs per point (median), after a warm-up")
    bl.add_argument("--layers", default="self-attention,attention-core,restricted,restricted-dense,lstm,rnn,conv,"
                                         "conv-dilated", help="comma-separated layer types to measure")
    bl.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    bl.add_argument("--out", default="runs/bench", help="output directory")
    bl.add_argument("--quick", action="store_true",
                    help="a smoke run in seconds: d=64, n=16..256, r=8, one timed repeat")
    blr = bs.add_parser("long-range", formatter_class=DefaultsHelpFormatter,
                        help="accuracy and gradient norm against the distance t to the token that decides the label",
                        description="A synthetic task: a sequence of random symbols whose label is the symbol t "
                                    "positions before the end. For each t, train a vanilla RNN, an LSTM and a "
                                    "Transformer encoder (read at the last position) for a fixed number of steps; "
                                    "report held-out accuracy (chance = 1/symbols) and the norm of the gradient of "
                                    "the loss with respect to the input embedding at the deciding position, at "
                                    "initialisation and after training. Writes OUT/long-range.{json,md} and "
                                    "OUT/long-range-{accuracy,gradnorm}.png.")
    blr.add_argument("--distances", default="2,5,10,20,50,100,200,500,1000", help="comma-separated distances t")
    blr.add_argument("--models", default="rnn,lstm,transformer", help="comma-separated subset of rnn, lstm, transformer")
    blr.add_argument("--steps", type=int, default=300, help="training steps per model and distance")
    blr.add_argument("--hidden", type=int, default=64, help="hidden size (RNN, LSTM) and d_model (Transformer)")
    blr.add_argument("--symbols", type=int, default=8, help="alphabet size K (chance accuracy 1/K)")
    blr.add_argument("--batch", type=int, default=32, help="sequences per training step")
    blr.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    blr.add_argument("--seed", type=int, default=0, help="random seed")
    blr.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    blr.add_argument("--out", default="runs/bench", help="output directory")
    blr.add_argument("--quick", action="store_true", help="a smoke run in seconds: t = 3, 5; 60 steps")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse matches `MODEL TEXT...` in one go, so texts after an option (`qkv translate M
        # --beam-size 5 "a b"`) come back unparsed: they are texts all the same
        if isinstance(getattr(args, "text", None), list) and not any(e.startswith("-") for e in extra):
            args.text += extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except QkvError as e:
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `qkv translate ... | head`
        return 0
    except OSError as e:  # the last resort: a file the command did not expect to fail (disk full, ...)
        print(f"qkv {args.command}: error: {os_error_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
