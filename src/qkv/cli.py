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

from qkv.config import DecodeConfig, ModelConfig, TrainConfig, load_toml, override, preset, PRESETS
from qkv.errors import QkvError
from qkv.files import atomic_output, check_not_input, check_output_dir, check_output_file, os_error_message

HIDDEN_FIELDS = {"src_vocab_size", "tgt_vocab_size", "n_classes"}

FIELD_HELP = {
    "task": "translate | classify (labelled text -> label) | mlm (masked-LM pretraining of an encoder) "
            "| lm | prefix_lm",
    "pooling": "classify: cls (the <cls> token's state) | mean (over non-padding positions) | last (RNN final states)",
    "mask_prob": "mlm: share of tokens chosen for prediction (of those 80%% -> [MASK], 10%% random, 10%% kept)",
    "init_from": "start from this checkpoint's weights where names and shapes match (e.g. a classifier "
                 "from an mlm run's encoder; its tokenizer and architecture are used)",
    "arch": "architecture: transformer | lstm | gru | rnn (a recurrent encoder-decoder, see --attention; "
            "with --task lm a recurrent language model, with --task classify a recurrent classifier)",
    "rnn_nonlinearity": "f of the vanilla RNN h_t = f(V·h_{t-1} + U·x_t + b) (--arch rnn): tanh | relu",
    "bidirectional": "recurrent models: bidirectional encoder, states [h→; h←]",
    "attention": "recurrent models: alignment score of the decoder's attention over the encoder states: "
                 "none (context vector only) | dot | scaled_dot | general | additive | cosine | location",
    "input_feeding": "recurrent models with attention: feed h~_{t-1} into the decoder input (Luong et al.; "
                     "slower training: the decoder then runs step by step)",
    "schedule": "learning-rate schedule: noam (the paper's warmup + inverse sqrt, see --lr-scale) | "
                "constant (--lr) | inverse_sqrt (linear warmup to --lr, then lr·sqrt(warmup/step))",
    "lr": "rate of the constant and inverse_sqrt schedules (0: 1e-3); noam ignores it",
    "tokenizer_from": "reuse the tokenizer of this checkpoint directory (or a SentencePiece .model) "
                      "instead of training one, e.g. to compare models on one subword vocabulary",
    "d_model": "model width d_model (recurrent models: embedding and hidden size)",
    "n_heads": "attention heads h (d_k = d_v = d_model / h)",
    "d_ff": "inner width of the position-wise FFN",
    "n_encoder_layers": "encoder layers N (stacked recurrent layers for lstm/gru/rnn)",
    "n_decoder_layers": "decoder layers N (stacked recurrent layers for lstm/gru/rnn)",
    "dropout": "P_drop on embedding sums and sublayer outputs (recurrent: embeddings, between layers, h~)",
    "attention_dropout": "dropout on attention weights",
    "positional": "sinusoidal | learned",
    "max_positions": "positions in the (learned or initial sinusoidal) table, at most 65536; learned positions "
                     "must cover max_len and the task's special tokens",
    "norm_first": "pre-norm residual blocks instead of the paper's post-norm",
    "share_embeddings": "share source/target/output embeddings (needs a joint vocabulary)",
    "tie_output": "share the target embedding with the pre-softmax projection",
    "tokenizer": "SentencePiece model type: bpe | unigram | char",
    "vocab_size": "SentencePiece vocabulary size (a cap for char)",
    "joint_vocab": "one vocabulary for source and target",
    "max_len": "translate: skip (and count) training pairs longer than this many tokens; classify/mlm: "
               "keep the first max_len tokens of each text",
    "max_tokens": "token budget per batch (padded), as fairseq's --max-tokens",
    "lr_scale": "factor on the warmup schedule d^-0.5·min(step^-0.5, step·warmup^-1.5)",
    "warmup_steps": "linear warmup steps of the schedule",
    "optimizer": "adam (the paper's, with adam_beta1/2 and adam_eps) | nag: SGD with Nesterov momentum, fairseq "
                 "0.9's default optimizer (torch.optim.SGD(nesterov=True); the same update as fairseq's NAG)",
    "momentum": "momentum of nag (fairseq's default 0.99)",
    "adam_beta1": "Adam β1", "adam_beta2": "Adam β2", "adam_eps": "Adam ε",
    "weight_decay": "L2 weight decay (the paper uses none)",
    "label_smoothing": "ε_ls of the label-smoothed cross-entropy",
    "clip_norm": "clip the gradient norm to this (0: off)",
    "nonfinite_limit": "an update whose loss or gradient norm is not finite (NaN/inf) is skipped with a warning; this "
                       "many in a row stop training with exit status 3 (non-finite weights are never saved)",
    "update_freq": "accumulate gradients over this many batches per update",
    "max_steps": "stop after this many updates",
    "max_epochs": "stop after this many epochs (0: no limit)",
    "max_time": "stop after this many seconds of training (0: no limit)",
    "patience": "early stopping: stop once this many validations in a row bring no new best of the selection "
                "metric (translation: validation loss; 0: never)",
    "lr_shrink": "reduce on plateau: when patience runs out, multiply the learning rate by this and go on (fairseq's "
                 "--lr-shrink), up to max_lr_shrinks times; then stop",
    "max_lr_shrinks": "how many times the rate may shrink before patience stops training (0: stop at once)",
    "eval_every": "validate and checkpoint every this many updates",
    "eval_bleu_samples": "validation sentences decoded greedily for BLEU",
    "keep_last": "also keep the newest K numbered step_N/ checkpoints, saved at each validation (for averaging)",
    "seed": "random seed",
    "threads": "torch CPU threads (0: torch's default; at most 1024)",
    "device": "auto (CUDA when available) | cpu | cuda; under torchrun each process takes the GPU of its LOCAL_RANK",
    "amp": "mixed precision of the training forward: none | bf16 | fp16 (CUDA only, with a gradient scaler)",
    "compile": "torch.compile the model for the training forward (slow first steps, faster later ones)",
    "fused_loss": "compute the output projection and the label-smoothed loss together, chunk by chunk, without "
                  "the full (tokens x vocabulary) logits (same values; faster; Transformers and recurrent seq2seq)",
    "beam_size": "beam size (1: greedy)",
    "length_penalty": "α of the length penalty: beam search ranks log P(Y|x) / lp(Y), lp = ((5+|Y|)/6)^α (gnmt) "
                      "or |Y|^α (length)",
    "length_norm": "gnmt: lp = ((5+|Y|)/6)^α (Wu et al., 2016; the paper) | length: lp = |Y|^α (fairseq's "
                   "--lenpen, Hugging Face's length_penalty)",
    "early_stopping": "end a sentence's search as soon as beam_size hypotheses have ended (fairseq's rule; "
                      "favours short outputs) instead of when no live one can beat them",
    "max_len_a": "max output length = a·source length + b (at most 1024 tokens, and what learned positions allow)",
    "max_len_b": "max output length = a·source length + b (at most 1024 tokens, and what learned positions allow)",
    "min_len": "no EOS before this many output tokens",
    "nbest": "hypotheses to output per sentence",
    "batch_size": "sentences per decoding batch",
}


# --- flags from dataclasses --------------------------------------------------------------------------

def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    group = parser.add_argument_group(title)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name in HIDDEN_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        helptext = f"{FIELD_HELP.get(f.name, f.name)} (default: {getattr(defaults, f.name)!r}, or the preset's)"
        if f.type in (bool, "bool"):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
            group.add_argument(flag, dest=f.name, type=kind, default=None, metavar=f.name.upper(), help=helptext)


def flags_for(args: argparse.Namespace, cls: type) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in HIDDEN_FIELDS and getattr(args, f.name, None) is not None}


def resolve_configs(args: argparse.Namespace, default_preset: str = "small") -> tuple[ModelConfig, TrainConfig, DecodeConfig]:
    """preset < --config file < flags."""
    file = load_toml(args.config) if getattr(args, "config", None) else {}
    name = args.preset or file.get("preset") or default_preset
    model_cfg, train_cfg = preset(name)
    decode_cfg = DecodeConfig()
    src = str(args.config) if getattr(args, "config", None) else "config"
    model_cfg = override(model_cfg, file.get("model", {}), src)
    train_cfg = override(train_cfg, file.get("train", {}), src)
    decode_cfg = override(decode_cfg, file.get("decode", {}), src)
    model_cfg = override(model_cfg, flags_for(args, ModelConfig), "flags")
    train_cfg = override(train_cfg, flags_for(args, TrainConfig), "flags")
    decode_cfg = override(decode_cfg, flags_for(args, DecodeConfig), "flags")
    return model_cfg.validate(), train_cfg.validate(), decode_cfg.validate()


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
    from qkv.data import toy
    from qkv.tasks import DataPaths, get_task
    from qkv.training.trainer import ParallelData, train

    data_files = [args.src_train, args.tgt_train]
    if any(data_files) and not all(data_files):
        raise QkvError("give both --src-train and --tgt-train (or neither, for the embedded default task)")
    if bool(args.src_valid) != bool(args.tgt_valid):
        raise QkvError("give both --src-valid and --tgt-valid (or neither)")
    if args.valid and not args.train:
        raise QkvError("--valid needs --train")
    out = Path(args.out)
    has_data = bool(args.src_train or args.train)
    if args.resume:
        model_cfg, train_cfg, decode_cfg = resumed_configs(out / "last", args)
        saved = resumed_data(out / "last")  # None: a checkpoint from before the data was recorded
        if saved not in (None, "toy/train") and not has_data:
            flags = "--src-train and --tgt-train" if model_cfg.task in ("translate", "prefix_lm") else "--train"
            raise QkvError(f"{out} was trained on {saved}: give the same {flags} to resume it")
        if saved == "toy/train" and has_data:
            raise QkvError(f"{out} was trained on the embedded default task: resume it without --src-train")
    elif has_data:
        model_cfg, train_cfg, decode_cfg = resolve_configs(args, default_preset="small")
    else:
        model_cfg, train_cfg, decode_cfg = resolve_configs_toy(args)
        if model_cfg.task not in ("translate", "prefix_lm"):
            raise QkvError(f"--task {model_cfg.task} needs data: --train FILE (and --valid FILE); the embedded "
                           "default task is translation (translate or prefix_lm)")

    task = get_task(model_cfg.task)
    if not (args.resume or train_cfg.init_from):  # else the architecture is a checkpoint's
        task.check_positions(model_cfg, train_cfg)  # before any data are read
    test_pairs = None
    if has_data:
        paths = DataPaths(args.train, args.valid, args.src_train, args.tgt_train, args.src_valid, args.tgt_valid,
                          args.text_field, args.label_field, args.strip_gutenberg, args.valid_fraction)
        if task.data_kind == "parallel" and args.train:
            raise QkvError(f"--task {task.name} reads parallel files: --src-train/--tgt-train (and --src-valid/"
                           f"--tgt-valid); --train/--valid are for one-sided tasks (classify, mlm, lm)")
        train_data, valid_data = task.read_data(paths, log)
    else:
        log("no data given: training on the embedded default task, English number words -> German number words")
        splits = toy.default_splits()
        train_data = ParallelData(*zip(*splits["train"]), name="toy/train")
        train_data.src, train_data.tgt = list(train_data.src), list(train_data.tgt)
        valid_data = ParallelData([s for s, _ in splits["valid"]], [t for _, t in splits["valid"]], name="toy/valid")
        test_pairs = splits["test"]

    result = train(model_cfg, train_cfg, decode_cfg, train_data, valid_data, out, resume=args.resume, log=log)
    if test_pairs is not None and result.is_main:  # under torchrun, rank 0 alone
        show_toy_results(out, test_pairs)
    return 0


def resolve_configs_toy(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, DecodeConfig]:
    from qkv.data import toy

    if args.preset or args.config:
        return resolve_configs(args)
    model_cfg = override(toy.MODEL, flags_for(args, ModelConfig), "flags")
    train_cfg = override(toy.RNN_TRAIN if model_cfg.is_recurrent else toy.TRAIN, flags_for(args, TrainConfig), "flags")
    decode_cfg = override(DecodeConfig(), flags_for(args, DecodeConfig), "flags")
    return model_cfg.validate(), train_cfg.validate(), decode_cfg.validate()


def resumed_configs(last: Path, args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, DecodeConfig]:
    """Resuming keeps the run's own settings; flags may change only limits and evaluation cadence."""
    from qkv.checkpoint import read_checkpoint, read_config
    from qkv.training.rundir import missing_last_message

    if not last.exists():
        raise QkvError(missing_last_message(last.parent))
    ckpt = read_checkpoint(last)
    model_cfg, train_cfg, decode_cfg = (read_config(ckpt, s) for s in ("model", "train", "decode"))
    changeable = {"max_steps", "max_epochs", "max_time", "patience", "lr_shrink", "max_lr_shrinks", "eval_every",
                  "eval_bleu_samples", "keep_last", "threads", "device", "amp", "compile", "fused_loss",
                  "nonfinite_limit"}
    if getattr(args, "config", None):  # an edited config file may raise the limits of a run it started
        file = load_toml(args.config)
        file_train = file.get("train", {})
        file_model = file.get("model", {})
        changed = sorted(f"[train] {k}" for k, v in file_train.items()
                         if k not in changeable and hasattr(train_cfg, k) and v != getattr(train_cfg, k))
        changed += sorted(f"[model] {k}" for k, v in file_model.items()
                          if hasattr(model_cfg, k) and v != getattr(model_cfg, k))
        if changed:
            raise QkvError(f"--resume continues the run as configured; {args.config} changes settings that cannot "
                           f"change now: {', '.join(changed)} (only {', '.join(sorted(changeable))} can)")
        train_cfg = override(train_cfg, {k: v for k, v in file_train.items() if k in changeable}, str(args.config))
    asked = flags_for(args, TrainConfig)
    asked_model = flags_for(args, ModelConfig)
    refused = sorted(k for k, v in asked.items() if k not in changeable and v != getattr(train_cfg, k))
    refused += sorted(k for k, v in asked_model.items() if v != getattr(model_cfg, k))
    if refused:
        raise QkvError(f"--resume continues the run as configured; these flags cannot change now: "
                       f"{', '.join('--' + r.replace('_', '-') for r in refused)}")
    train_cfg = override(train_cfg, asked, "flags")
    decode_cfg = override(decode_cfg, flags_for(args, DecodeConfig), "flags")
    return model_cfg, train_cfg, decode_cfg


def resumed_data(last: Path) -> str | None:
    """What the run in ``last`` was trained on ("toy/train" for the embedded task), if recorded."""
    import json

    try:
        return json.loads((last / "config.json").read_text(encoding="utf-8")).get("data", {}).get("train")
    except (OSError, ValueError, AttributeError):
        return None


def show_toy_results(out: Path, test_pairs: list[tuple[str, str]]) -> None:
    """After training on the embedded default: held-out exact match and a few translations."""
    import qkv
    from qkv.metrics import exact_match

    model = qkv.load(out / "best")
    src = [s for s, _ in test_pairs]
    refs = [t for _, t in test_pairs]
    hyps = model.translate(src)
    em = exact_match(hyps, refs)
    print(f"held-out test: {100 * em:.1f}% exact match on {len(src)} numbers never seen in training "
          f"(beam {model.decode_cfg.beam_size})")
    for s, h, r in list(zip(src, hyps, refs))[:8]:
        mark = "ok " if h == r else "ERR"
        print(f"  {mark} {s:<55} -> {h}" + ("" if h == r else f"   (expected {r})"))
    print(f"try it: qkv translate {out}/best \"four thousand three hundred twenty-one\"")


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
    from qkv.metrics import bleu, bleu_tok_lc, chrf

    check_output(args.output, src=args.src, ref=args.ref, hyp=args.hyp, test=args.test)
    if args.test:
        if args.ensemble:
            raise QkvError("--ensemble is for translation (MODEL with --src and --ref), not for --test")
        if args.model and checkpoint_task(args.model) == "lm":
            return evaluate_lm(args)
        return evaluate_classifier(args)
    if not args.ref:
        raise QkvError("give --ref (references, for a translation) or --test (labelled data for a classifier, "
                       "plain text for a language model)")
    refs = read_lines(args.ref)
    if args.model:
        if not args.src:
            raise QkvError("evaluating a model needs --src (the source sentences to translate)")
        src = read_lines(args.src)
        if len(src) != len(refs):
            raise QkvError(f"{args.src} has {len(src)} lines but {args.ref} has {len(refs)}")
        model = load_translator(args)
        hyps = model.translate(src, **flags_for(args, DecodeConfig))
        if args.output:
            write_lines(args.output, hyps)
    elif args.int8:
        raise QkvError("--int8 quantises a MODEL: give a MODEL with --src (not --hyp)")
    elif args.ensemble:
        raise QkvError("--ensemble decodes with MODEL and more checkpoints: give a MODEL with --src (not --hyp)")
    elif args.hyp:
        hyps = read_lines(args.hyp)
        if len(hyps) != len(refs):
            raise QkvError(f"{args.hyp} has {len(hyps)} lines but {args.ref} has {len(refs)}")
    else:
        raise QkvError("give a MODEL with --src, or --hyp, to evaluate against --ref")
    print("sacreBLEU (cased, detokenized): " + bleu(hyps, refs).text())
    lang = args.lang or language_of(args.ref)
    if lang:
        print(f"Multi30k convention (lowercased, punctuation-normalized, Moses-tokenized -l {lang}): "
              + bleu_tok_lc(hyps, refs, lang).text())
    else:
        print("(give --lang to also report BLEU on lowercased, Moses-tokenized text)")
    print(chrf(hyps, refs).text())
    return 0


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
    import numpy as np

    from qkv.data.corpus import read_lines

    out = Path(args.output)
    if out.suffix not in (".npy", ".tsv"):
        raise QkvError(f"--output {out}: choose a .npy (NumPy array) or .tsv (one vector a line) file")
    check_output(args.output, input=args.input)
    model = open_model(args.model, "embed")
    lines = read_lines(args.input)
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            raise QkvError(f"{args.input}:{i}: empty line (every line is one text to embed)")
    vectors = model.embed(lines, args.pooling).numpy()
    with atomic_output(out, binary=out.suffix == ".npy") as fh:
        if out.suffix == ".npy":
            np.save(fh, vectors)
        else:
            fh.write("".join("\t".join(f"{v:.6g}" for v in row) + "\n" for row in vectors))
    pooling = args.pooling or "the model's"
    log(f"wrote {vectors.shape[0]} x {vectors.shape[1]} embeddings ({pooling} pooling) to {out}")
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


def language_of(path: str) -> str | None:
    """The language code of a file named like ``test.de`` or ``test_2016_flickr.de.gz``."""
    import re

    m = re.search(r"\.([a-z]{2})(\.gz)?$", Path(path).name)  # ISO 639-1, as Moses uses
    return m.group(1) if m else None


def cmd_average(args: argparse.Namespace) -> int:
    from qkv.training.average import average_checkpoints

    used = average_checkpoints(args.inputs, args.out, last=args.last)
    log(f"averaged {len(used)} checkpoints ({used[0].name} .. {used[-1].name}) into {args.out}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from qkv.info import parameter_breakdown, transformer_flops
    from qkv.models import build_model

    if args.model:
        import qkv

        model = qkv.load(args.model).model
        cfg = model.cfg
    else:
        model_cfg, _, _ = resolve_configs(args, default_preset="base")
        v = args.vocab_size or 37000
        cfg = dataclasses.replace(model_cfg, src_vocab_size=v, tgt_vocab_size=v)
        with torch.device("meta"):  # shapes only: no memory, no time
            model = build_model(cfg)
    parts = parameter_breakdown(model)
    if cfg.is_recurrent:
        print(f"{cfg.arch}: hidden={cfg.d_model} layers={cfg.n_encoder_layers}/{cfg.n_decoder_layers} "
              f"vocab={cfg.src_vocab_size}/{cfg.tgt_vocab_size} "
              f"{'bidirectional' if cfg.bidirectional else 'unidirectional'} encoder, attention {cfg.attention}"
              + (", input feeding" if cfg.input_feeding else "")
              + (f", f={cfg.rnn_nonlinearity}" if cfg.arch == "rnn" else ""))
    else:
        print(f"{cfg.arch} ({cfg.task}): d_model={cfg.d_model} h={cfg.n_heads} d_ff={cfg.d_ff} "
              f"N={cfg.n_encoder_layers}/{cfg.n_decoder_layers} vocab={cfg.src_vocab_size}/{cfg.tgt_vocab_size} "
              f"{'post' if not cfg.norm_first else 'pre'}-norm, {cfg.positional} positions")
    width = max(len(k) for k in parts)
    for k, n in parts.items():
        print(f"  {k:<{width}}  {n:>13,}  ({n / 1e6:.1f}M)")
    if cfg.is_recurrent or cfg.task != "translate":
        print(f"(the FLOPs formula is the encoder-decoder Transformer's; not computed for a {cfg.task} "
              f"{cfg.arch} model)")
        return 0
    fl = transformer_flops(cfg, args.src_len, args.tgt_len)
    print(f"FLOPs per target token (matmuls, source {args.src_len} / target {args.tgt_len} tokens): "
          f"forward {fl.forward / 1e6:.1f} MFLOP, training (3x) {fl.training / 1e6:.1f} MFLOP")
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
        prefix = args.out[: -len(Path(args.out).suffix)] if Path(args.out).suffix in (".png", ".html") else args.out
        written = [viz.write_attention_html(data, prefix + ".html"), viz.write_attention_png(data, prefix + ".png")]
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
    if args.what == "layers":
        from qkv.complexity import bench_layers

        if args.quick:
            args.d, args.n_min, args.n_max, args.r, args.repeats = 64, 16, 256, 8, 1
        kinds = [s.strip() for s in args.layers.split(",")] if args.layers else None
        try:
            text, written = bench_layers(args.out, args.d, args.n_min, args.n_max, args.r, args.k, args.heads,
                                         args.batch, args.repeats, kinds, log=log)
        except ValueError as e:
            raise QkvError(str(e)) from None
    else:
        from qkv.long_range import bench_long_range

        try:
            distances = [int(s) for s in args.distances.split(",")]
        except ValueError:
            raise QkvError(f"--distances: give comma-separated whole numbers, got {args.distances!r}") from None
        try:
            text, written = bench_long_range(args.out, distances, args.models.split(","), args.steps, args.hidden,
                                             args.symbols, args.batch, args.lr, args.seed, args.quick, log=log)
        except ValueError as e:
            raise QkvError(str(e)) from None
    print(text)
    for path in written:
        print(f"wrote {path}")
    return 0


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
