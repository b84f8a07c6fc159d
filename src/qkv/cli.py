"""The ``qkv`` command: a thin layer over the public functions.

    qkv train      train a model (on the embedded default task when no data is given)
    qkv preprocess binarize a parallel corpus (memory-mapped token ids) for qkv train --data
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
    qkv export     a trained model for CTranslate2 or Hugging Face transformers
    qkv serve      checkpoints over HTTP: a JSON API with dynamic batching, and a web page
    qkv lab        train, watch and compare Transformers and RNNs in the browser

Model, training and decoding flags are generated from the fields of ``ModelConfig``,
``TrainConfig`` and ``DecodeConfig``. Settings are taken, later winning, from: the preset, the
``--config`` TOML file, the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from qkv.cli_options import build_parser, command_parser
from qkv.config import (DEFAULT_PRESET, SECTIONS, DecodeConfig, ModelConfig, TrainConfig, layered, load_toml,
                        preset)
from qkv.errors import QkvError
from qkv.config import check_option_bounds
from qkv.data.corpus import count_lines, input_chunks, read_inputs
from qkv.files import check_not_input, check_output_dir, check_output_file, os_error_message, output_stream, write_lines
from qkv.startup import interrupted, interrupts, report_interrupted

# --- configs: preset < --config < flags -------------------------------------------------------------

def flags_for(args: argparse.Namespace, cls: type) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if not f.metadata.get("hidden") and getattr(args, f.name, None) is not None}


def resolve_configs(args: argparse.Namespace, default_preset: str = DEFAULT_PRESET, resume_from: Path | None = None,
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

        return layered((toy.MODEL, toy.TRAIN, DecodeConfig()), file, "config", flags, recurrent=toy.RNN_SCHEDULE)
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

    paths = DataPaths(train=args.train, valid=args.valid, src_train=args.src_train, tgt_train=args.tgt_train,
                      src_valid=args.src_valid, tgt_valid=args.tgt_valid, text_field=args.text_field,
                      label_field=args.label_field, strip_gutenberg=args.strip_gutenberg,
                      valid_fraction=args.valid_fraction, data=args.data)
    check_paths(paths)
    out = Path(args.out)
    embedded = not (args.src_train or args.train or args.data)
    configs = resolve_configs(args, resume_from=out / "last" if args.resume else None, embedded=embedded)
    result = run_training(*configs, paths, out, args.resume, log, tensorboard=args.tensorboard)
    if embedded and result.is_main:  # under torchrun, rank 0 alone
        from qkv.data.toy import held_out_report
        from qkv.frontends import load

        print(held_out_report(load(out / "best"), out))
    return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    from qkv.data.binarized import Filters, preprocess

    check_output_dir(args.out, "--out")
    filters = Filters(max_len=args.max_len, max_ratio=args.max_ratio, drop_identical=not args.keep_identical)
    preprocess(args.src_train, args.tgt_train, args.out, args.src_valid, args.tgt_valid,
               tokenizer_from=args.tokenizer_from, vocab_size=args.vocab_size, model_type=args.tokenizer,
               joint=not args.separate_vocab, sample=args.sample, filters=filters, workers=args.workers, log=log)
    return 0


def progress(total: int, what: str):
    """A progress bar on stderr for long inputs, when stderr is a terminal (never in logs or pipes)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit="line", file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=not sys.stderr.isatty() or total < 64)


def open_model(path: str, command: str, args: argparse.Namespace | None = None, **kwargs):
    """:func:`qkv.frontends.open_model`, imported when a command needs it (``--help`` stays fast); with
    ``args``, the command's --threads (torch's CPU threads) and --batch-size (texts a forward pass) set."""
    from qkv.frontends import open_model as open_

    threads = getattr(args, "threads", 0)
    if threads:
        check_option_bounds(threads=threads)
    if getattr(args, "int8", False):
        kwargs["quantize"] = "int8"
    if getattr(args, "engine", "qkv") == "ctranslate2":
        from qkv.engines import load
        from qkv.frontends import check_serves

        check_serves(path, command)
        model = load(path, kwargs.get("device", "cpu"), kwargs.get("quantize"), threads, log=log)
    else:
        if threads:
            import torch

            torch.set_num_threads(threads)
        model = open_(path, command, **kwargs)
    if getattr(args, "batch_size", None) and hasattr(model, "batch_size"):
        model.batch_size = args.batch_size
    return model


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


def streamed_input(args: argparse.Namespace, lines_per_chunk: int):
    """The texts, ``--input`` file or stdin in lists of lines, read as they are translated (a big file
    is never held whole), and the number of lines for the progress bar (0: unknown, stdin)."""
    total = len(args.text) if args.text else count_lines(args.input) if args.input and args.input != "-" else 0
    return input_chunks(args.text, args.input, lines_per_chunk), total


def cmd_translate(args: argparse.Namespace) -> int:
    check_output(args.output, input=args.input)
    check_option_bounds(threads=args.threads)
    model = load_translator(args)
    overrides = flags_for(args, DecodeConfig)
    nbest = dataclasses.replace(model.decode_cfg, **overrides).validate().nbest  # a bad flag fails first
    chunks, total = streamed_input(args, 8 * overrides.get("batch_size", model.decode_cfg.batch_size))
    warn = truncation_warning("translate", args, "translated")
    rich = args.output_format == "jsonl"
    empty = lines = 0
    with output_stream(args.output) as out_fh, progress(total, "translate") as bar:
        for k, hyps in enumerate(model.translate_stream(unknown_word_warnings("translate", args, model, chunks), warn,
                                                        rich=rich, target_prefix=args.target_prefix,
                                                        scores=nbest > 1, **overrides)):  # printed with --nbest
            bar.update(1)
            lines += 1
            empty += all(not (h["text"] if rich else h[0]).strip() for h in hyps)
            out_fh.write(json.dumps({"line": k + 1, "hypotheses": hyps}, ensure_ascii=False) + "\n" if rich else
                         "".join(f"{k}\t{score:.4f}\t{text}\n" for text, score in hyps) if nbest > 1
                         else hyps[0][0] + "\n")
            out_fh.flush()
    if empty and empty == lines:
        log(f"qkv translate: warning: every output is empty ({empty} input{'s' * (empty > 1)}): the model ends each "
            f"translation at once, as an untrained or barely trained one does; check how many updates "
            f"{args.model} was trained for")
    return 0


def unknown_word_warnings(command: str, args: argparse.Namespace, model, chunks):
    """``chunks`` passed on, with one warning on stderr for each chunk holding words the model's vocabulary
    cannot read (:meth:`qkv.frontends.base.Frontend.unknown_words`), naming them and their lines."""
    source = "<arguments>" if getattr(args, "text", None) else \
        args.input if getattr(args, "input", None) and args.input != "-" else "<stdin>"
    done = 0
    for lines in chunks:
        lines = list(lines)
        unknown = model.unknown_words(lines) if hasattr(model, "unknown_words") else []
        found = [(done + i + 1, words) for i, words in enumerate(unknown) if words]
        if found:
            named = "; ".join(f"{source}:{line}: " + ", ".join(repr(w) for w in words[:5]) for line, words in found[:5])
            more = f" (and {len(found) - 5} more lines)" if len(found) > 5 else ""
            log(f"qkv {command}: warning: unknown to the model's vocabulary, read as <unk>, so the output is a guess: "
                f"{named}{more}")
        done += len(lines)
        yield lines


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
    model = open_model(args.model, "generate", args)
    temperature = 0.0 if args.greedy else args.temperature
    unknown = model.unknown_words([args.prefix])[0] if args.prefix else []
    if unknown:
        log(f"qkv generate: warning: unknown to the model's vocabulary, read as <unk>: "
            f"{', '.join(repr(w) for w in unknown[:10])} (in --prefix)")
    out = sys.stdout
    out.write(args.prefix)
    out.flush()
    text = ""
    for piece in model.generate(args.prefix, args.max_new_tokens, temperature, args.top_k, args.top_p, args.seed):
        out.write(piece)
        out.flush()  # streamed: each piece as it is produced
        text += piece
    out.write("\n")
    if not text.strip():
        log(f"qkv generate: warning: generated nothing{' but white space' if text else ''}: the model ends (emits "
            f"EOS, a line break) at once, as an untrained or barely trained one does; check how many updates "
            f"{args.model} was trained for")
    return 0


def load_translator(args: argparse.Namespace):
    """MODEL, or MODEL with the --ensemble checkpoints as one ensemble, decoded by --engine; a clear error
    if not a translator."""
    quantize = "int8" if args.int8 else None
    engine, threads = getattr(args, "engine", "qkv"), getattr(args, "threads", 0)
    compile = getattr(args, "compile", False)
    if compile and getattr(args, "ensemble", None):
        raise QkvError("--compile compiles one Transformer's step: leave out --ensemble, or --compile")
    if engine == "ctranslate2":
        if compile:
            raise QkvError("--compile compiles qkv's own decoding step: leave out --engine ctranslate2, or --compile")
        if getattr(args, "ensemble", None):
            raise QkvError("--ensemble averages the distributions of several qkv models: leave out --engine ctranslate2")
        from qkv.engines.options import check_options

        # the decoding settings first, before torch is imported: refused in a moment, not after the conversion
        check_options(args.model, flags_for(args, DecodeConfig), bool(getattr(args, "target_prefix", None)))
        from qkv.engines.translator import check_timeout, load
        from qkv.frontends import check_serves

        check_serves(args.model, "translate")
        timeout = check_timeout(getattr(args, "engine_timeout", None))
        return load(args.model, args.device, quantize, threads, log=log, timeout=timeout)
    if getattr(args, "engine_timeout", None) is not None:
        raise QkvError("--engine-timeout bounds a call of the CTranslate2 engine's worker: give --engine ctranslate2")
    if threads:
        import torch

        torch.set_num_threads(threads)
    if getattr(args, "ensemble", None):
        return load_ensemble([args.model, *args.ensemble], quantize=quantize, device=args.device)
    return open_model(args.model, "translate", quantize=quantize, device=args.device, compile=compile)


def evaluate_classifier(args: argparse.Namespace) -> int:
    """Accuracy, macro-F1 and the confusion matrix of a classifier on labelled --test data."""
    from qkv.data.labelled import read_labelled

    if not args.model:
        raise QkvError("--test needs a MODEL (a classifier checkpoint)")
    if checkpoint_task(args.model) not in (None, "classify"):
        raise QkvError(f"{args.model} is not a classifier: --test evaluates --task classify and --task lm models "
                       "(score translations with --src and --ref)")
    model = open_model(args.model, "classify", args)
    data = read_labelled(args.test, args.text_field, args.label_field)
    with progress(len(data.texts), "evaluate") as bar:
        report = model.evaluate(data.texts, data.labels, lambda i: f"{args.test}:{data.line(i)}", bar.update)
    if args.output:
        write_lines(args.output, [model.labels[p] for p in report.preds])
    print(report.text(args.test))
    return 0


def truncation_warning(command: str, args: argparse.Namespace, done: str, source: str | None = None):
    """A handler for the inputs a model cuts to its length (``indices`` into the input lines): one
    warning on stderr naming the file (``source``, else the command's input) and lines, and the length kept."""
    source = source or ("<arguments>" if args.text else args.input if args.input and args.input != "-" else "<stdin>")

    def warn(indices: list[int], kept: int) -> None:
        numbers = [i + 1 for i in indices]
        where = f"{source}:{numbers[0]}" if len(numbers) == 1 else f"{source}: lines " + ", ".join(
            map(str, numbers[:10])) + (f" and {len(numbers) - 10} more" if len(numbers) > 10 else "")
        log(f"qkv {command}: warning: {where}: longer than the {kept} tokens the model reads; "
            f"{done} from the first {kept}")
    return warn


def cmd_score(args: argparse.Namespace) -> int:
    from qkv.data.corpus import read_lines

    check_output(args.output, src=args.src, tgt=args.tgt)
    model = open_model(args.model, "score", args, device=args.device)
    src, tgt = read_lines(args.src), read_lines(args.tgt)
    if len(src) != len(tgt):
        raise QkvError(f"{args.src} has {len(src)} lines but {args.tgt} has {len(tgt)}")
    if args.tgt_format != "text":  # pieces, scored as given: (source line, pieces) per target
        pairs = list(target_pieces(tgt, args.tgt, args.tgt_format, model.tokenizers.tgt))
        src, tgt = [src[i] for i, _ in pairs], [pieces for _, pieces in pairs]
    scores = model.score(src, tgt, truncation_warning("score", args, "scored", source=args.src))
    with output_stream(args.output) as out_fh:
        out_fh.write("".join(f"{sum(lp):.6f}\t" + " ".join(f"{v:.6f}" for v in lp) + "\n" for lp in scores))
    n = sum(len(lp) for lp in scores)
    log(f"scored {len(scores)} pairs, {n} target tokens (EOS included): mean log-probability "
        f"{sum(map(sum, scores)) / max(n, 1):.4f} per token")
    return 0


def target_pieces(lines: list[str], path: str, fmt: str, tokenizer):
    """``(line index, pieces)`` of each target in ``lines``: ``pieces``, one target a line, its pieces
    separated by spaces; ``jsonl``, the lines of ``qkv translate --output-format jsonl``, every
    hypothesis's ``tokens`` in turn (an empty source line has none). Errors name the file and line."""
    for i, line in enumerate(lines):
        where = f"{path}:{i + 1}"
        if fmt == "pieces":
            hyps = [line.split()]
        else:
            try:
                hyps = [h["tokens"] for h in json.loads(line)["hypotheses"]]
            except (ValueError, TypeError, KeyError) as e:
                raise QkvError(f"{where}: not a line of qkv translate --output-format jsonl "
                               f"(an object with 'hypotheses', each with 'tokens'): {e}") from None
        for pieces in hyps:
            if not isinstance(pieces, list):
                raise QkvError(f"{where}: 'tokens' is not a list of pieces")
            tokenizer.piece_ids(pieces, where)  # a piece the model lacks is named here, with its line
            yield i, pieces


def cmd_classify(args: argparse.Namespace) -> int:
    check_output(args.output, input=args.input)
    model = open_model(args.model, "classify", args)
    warn = truncation_warning("classify", args, "classified")
    with output_stream(args.output) as out_fh:
        for p in model.classify_lines(read_inputs(args.text, args.input), warn):
            if p is None:  # an empty input line stays an empty output line
                out_fh.write("\n")
                continue
            c = int(p.argmax())
            extra = "\t" + " ".join(f"{lab}={float(v):.4f}" for lab, v in zip(model.labels, p)) if args.all else ""
            out_fh.write(f"{model.labels[c]}\t{float(p[c]):.4f}{extra}\n")
            out_fh.flush()
    return 0


def cmd_fill(args: argparse.Namespace) -> int:
    model = open_model(args.model, "fill", args)
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
    model = open_model(args.model, "embed", args)
    lines = read_lines(args.input)  # a blank line is a text too: embedded as the model reads an empty text
    vectors = model.embed(lines, args.pooling)
    write_vectors(vectors, args.output)
    pooling = args.pooling or "the model's"
    log(f"wrote {vectors.shape[0]} x {vectors.shape[1]} embeddings ({pooling} pooling) to {args.output}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from qkv.data.corpus import read_lines

    model = open_model(args.model, "search", args)
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

    from qkv.info import describe, describe_preset
    from qkv.models import build_model

    if args.model:
        from qkv.frontends import load

        model = load(args.model).model
    else:
        model_cfg, train_cfg, _ = resolve_configs(args)
        v = args.vocab_size or train_cfg.vocab_size
        with torch.device("meta"):  # shapes only: no memory, no time
            model = build_model(dataclasses.replace(model_cfg, src_vocab_size=v, tgt_vocab_size=v))
    print(describe(model, args.src_len, args.tgt_len))
    if not args.model and (args.preset or not args.config):  # the preset's training values and time
        print(describe_preset(args.preset or DEFAULT_PRESET, model_cfg, v))
    return 0


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


def log(msg: str) -> None:
    import os

    if os.environ.get("WORLD_SIZE", "1") not in ("", "1") and os.environ.get("RANK", "0") != "0":
        return  # under torchrun only rank 0 speaks
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


def cmd_export(args: argparse.Namespace) -> int:
    from qkv.export import CardInfo, export, summary

    card = CardInfo(args.source_lang, args.target_lang, args.license, args.dataset, args.src, args.ref)
    log(summary(export(args.model, args.format, args.out, args.quantization, card), args.out))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from qkv.importers import import_model

    import_model(args.folder, args.out, log=log)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from qkv.serve import Limits, serve

    check_option_bounds(threads=args.threads)
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)}).validate()
    decode = flags_for(args, DecodeConfig)
    for flag, bound in (("beam_size", "max_beam"), ("nbest", "max_nbest")):  # each model's own: when loaded
        if decode.get(flag, 0) > getattr(limits, bound):
            raise QkvError(f"--{flag.replace('_', '-')} {decode[flag]} is more than --{bound.replace('_', '-')} "
                           f"{getattr(limits, bound)}: every request without its own would be refused; lower the "
                           f"one or raise the other")
    serve(args.models, args.host, args.port, limits, device=args.device, threads=args.threads, log=log,
          allowed_hosts=args.allowed_hosts, engine=args.engine, quantize="int8" if args.int8 else None,
          engine_timeout=args.engine_timeout,
          decode=decode, compile=args.compile)
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    from qkv.lab.runs import files_task, limits_from
    from qkv.lab.server import lab

    if bool(args.src_train) != bool(args.tgt_train) or (args.src_valid and not args.src_train):
        raise QkvError("give both --src-train and --tgt-train (and --src-valid/--tgt-valid only with them)")
    files = files_task(args.src_train, args.tgt_train, args.src_valid, args.tgt_valid) if args.src_train else None
    lab(args.root, args.port, limits_from(args), files, log=log)
    return 0


# --- qkv bench: Table 1 and the long-range task, measured --------------------------------------------

def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    check_option_bounds(threads=args.threads, seed=getattr(args, "seed", None))
    if args.what == "layers" and args.quick and not args.threads:
        args.threads = 1  # tiny sizes gain nothing from more; on a busy machine waiting threads cost 3x (--help)
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
    if max(distances) > 16384:  # a sequence that long per training example could only be a mistake
        raise QkvError(f"--distances: each distance must be at most 16384, got {max(distances)}")
    return bench(args.out, distances, args.models.split(","), args.steps, args.hidden, args.symbols, args.batch,
                 args.lr, args.seed, args.quick, log=log)


COMMANDS = ("train", "preprocess", "translate", "score", "evaluate", "generate", "classify", "fill", "embed", "search",
            "average", "info", "viz", "bench", "export", "import", "serve", "lab")


def parse(parser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; an unknown flag is reported by its command's parser (its usage, the nearest flag)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse matches `MODEL TEXT...` in one go, so texts after an option (`qkv translate M
        # --beam-size 5 "a b"`) come back unparsed: they are texts all the same
        if isinstance(getattr(args, "text", None), list) and not any(e.startswith("-") for e in extra):
            args.text += extra
        else:
            command_parser(parser, args).unrecognized(extra)
    return args


def report(command: str, message, status: int = 2) -> int:
    """``qkv COMMAND: error: MESSAGE`` on stderr; the exit status."""
    print(f"qkv {command}: error: {message}" if command else f"qkv: error: {message}", file=sys.stderr)
    return status


def invalid_utf8(argv: list[str]) -> str | None:
    """Why an argument is not valid UTF-8 (Python hands undecodable bytes on as lone surrogates), as a
    file's invalid byte is refused: the argument's place, the byte and where it is; None if all are."""
    for k, arg in enumerate(argv, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            raw = arg.encode("utf-8", "surrogateescape") if all(
                0xDC80 <= ord(c) <= 0xDCFF for c in arg[e.start:e.end]) else None
            shown = repr(raw)[1:] if raw is not None else ascii(arg)
            byte = f"byte 0x{raw[len(arg[:e.start].encode('utf-8')):][0]:02x}" if raw is not None else "a lone surrogate"
            return f"argument {k} ({shown}): invalid UTF-8 ({byte} at character {e.start + 1}): give arguments in UTF-8"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bad = invalid_utf8(argv)
    if bad:
        return report(argv[0] if argv and not invalid_utf8(argv[:1]) else "", bad)
    parser = build_parser({name: globals()[f"cmd_{name}"] for name in COMMANDS})  # looked up now: patchable
    if not argv:  # as git: the commands, a line each, and exit status 1
        parser.print_help()
        return 1
    try:
        args = parse(parser, argv)
    except QkvError as e:  # a value checked as it is read (--preset): one line, not the command's usage
        return report(argv[0], e, e.exit_code)
    status = None
    try:
        with interrupts():  # Ctrl-C, kill, timeout: at any stage, status 130 (qkv.startup)
            status = args.func(args)
    except QkvError as e:
        status = None if interrupted() else report(args.command, e, e.exit_code)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # e.g. `qkv translate ... | head`
        status = 0
    except OSError as e:  # the last resort: a file the command did not expect to fail (disk full, ...)
        status = None if interrupted() else report(args.command, os_error_message(e))
    # interrupted: also where a library swallowed the KeyboardInterrupt or turned it into an error of its own
    return report_interrupted([args.command]) if status is None or interrupted() else status


if __name__ == "__main__":
    sys.exit(main())
