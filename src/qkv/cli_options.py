"""The options of the ``qkv`` command, declared: every command's flags and help text.

The commands themselves are in :mod:`qkv.cli`. Model, training and decoding flags are generated
from the fields of ``ModelConfig``, ``TrainConfig`` and ``DecodeConfig`` (their help is each
field's metadata in :mod:`qkv.config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable
from typing import NoReturn

from qkv.bounds import MAX_SEED, MAX_STEPS, MAX_THREADS, MAX_VOCAB, MAX_WIDTH, Bound, real, whole
from qkv.config import DEFAULT_PRESET, DecodeConfig, ModelConfig, PRESETS, TrainConfig, did_you_mean
from qkv.errors import ConfigError


class Number:
    """An argparse ``type``: a number within its :class:`~qkv.bounds.Bound`. A value that is no number
    or is out of bounds is refused as it is read, before any work, in one line naming the flag
    (a ConfigError, which the CLI reports with exit status 2, not argparse's usage). :func:`build_parser`
    gives each its flag's name and says the bound in the flag's help."""

    def __init__(self, bound: Bound, flag: str = "the value"):
        self.bound, self.flag = bound, flag

    def __call__(self, text: str):
        return self.bound.parse(text, self.flag)

    def __repr__(self) -> str:  # argparse names a type in some messages
        return self.bound.kind.__name__


def count(low: int, high: int, zero: bool = False) -> Number:
    """A whole number from ``low`` to ``high`` (``zero``: or 0)."""
    return Number(whole(low, high, zero))


def amount(low: float, high: float, zero: bool = False) -> Number:
    """A real number from ``low`` to ``high`` (``zero``: or 0)."""
    return Number(real(low, high, zero))


def name_bounded_options(parser: argparse.ArgumentParser) -> None:
    """Give every bounded option of ``parser`` and its subcommands its flag's name, and say its bound in
    its help. A numeric option without a bound is an error here: every number is bounded."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                name_bounded_options(sub)
            continue
        if action.type in (int, float):
            raise TypeError(f"{parser.prog} {action.option_strings or action.dest}: a number without a bound "
                            "(use count() or amount())")
        if isinstance(action.type, Number):
            action.type.flag = max(action.option_strings, key=len) if action.option_strings else action.dest
            if action.help and "(allowed:" not in action.help:
                action.help += f" (allowed: {action.type.bound.text()})"


def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str,
                     defaults_from: list[tuple[str, object]] | None = None) -> None:
    """A flag for each field of the config class ``cls``. Its help names the default: the class's, "or the
    preset's"; with ``defaults_from`` ((where, config) pairs, e.g. the default preset's and the embedded
    task's), the value each of those gives, once if they agree."""
    group = parser.add_argument_group(title)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.metadata.get("hidden"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if defaults_from:
            values = [(where, getattr(config, f.name)) for where, config in defaults_from]
            shown = (f"{values[0][1]!r}" if len({repr(v) for _, v in values}) == 1 else
                     ", ".join(f"{v!r} {where}" for where, v in values))
            helptext = f"{f.metadata.get('help', f.name)} (default: {shown})"
        else:
            helptext = f"{f.metadata.get('help', f.name)} (default: {getattr(defaults, f.name)!r}, or the preset's)"
        helptext = helptext.replace("%", "%%")  # argparse formats help with %
        if f.type in (bool, "bool"):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
            if kind is not str:  # every number has its bound (qkv.config.setting)
                kind = Number(f.metadata["bound"])
            group.add_argument(flag, dest=f.name, type=kind, default=None, metavar=f.name.upper(), help=helptext)


ENSEMBLE_HELP = ("decode with MODEL and this checkpoint as an ensemble: the mean of their next-token "
                 "distributions at every step (repeat for more members; they must share MODEL's tokenizer)")
DEVICE_HELP = "where the model runs: cpu, cuda (or cuda:N), or auto (the GPU when torch sees one) (default: cpu)"
INT8_HELP = ("dynamic int8 quantisation of the model's linear layers for faster CPU decoding "
             "(a small BLEU cost: see docs/results.md); with --engine ctranslate2, its int8 compute type")
COMPILE_HELP = ("search with the Transformer's decoding step compiled by torch.compile, static shapes (CUDA graphs "
                "on a GPU): the same outputs; the first batch of each shape compiles, for seconds to a minute; "
                "faster on a GPU, not on the CPUs measured (docs/results.md; on a CPU it warns); translation Transformers, --engine "
                "qkv, without --int8; needs a C++ compiler on the CPU")
ENGINE_TIMEOUT_HELP = ("--engine ctranslate2: seconds one call of a model's CTranslate2 worker may go unanswered "
                       "before the worker is killed and another started (the call fails; qkv serve answers 503); "
                       "a worker that ends is replaced too (default: 600, well above a batch's time)")
ENGINE_HELP = ("what decodes: qkv (its own modules; every option) or ctranslate2 (Transformers: translation, and "
               "with qkv serve also encoders and language models; "
               "converted once and cached beside the checkpoint, faster on CPU; greedy outputs equal qkv's; beam "
               "search only with --length-norm length --early-stopping; options it cannot honour exactly are "
               "refused by name; needs the export extra) (default: qkv)")


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


class KeepLinesFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that a description or epilog written with line breaks (a list of
    examples, one command a line) keeps them; one without is filled to the terminal's width as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text:
            return super()._fill_text(text, width, indent)
        return "".join(indent + line for line in text.splitlines(keepends=True))


class DefaultsHelpFormatter(KeepLinesFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help only where it tells something: not for options whose
    default is None (their help says what happens without them, e.g. "the preset's"), and not where the
    help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or "(default" in text:
            return text
        said, allowed, bound = text.partition(" (allowed: ")  # the default before the bound
        return super()._get_help_string(action) if not allowed else f"{said} (default: %(default)s){allowed}{bound}"


class CommandListFormatter(argparse.HelpFormatter):
    """``qkv --help`` (and ``qkv bench --help``, ``qkv viz --help``): each command and its help on one
    line. (argparse measures the commands' names without their indent, so the help of the longer ones
    would start on the next line.)"""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            longest = self._current_indent + self._indent_increment + max(map(len, action.choices))
            self._action_max_length = max(self._action_max_length, longest)


def nearest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to a mistyped ``word``, if one is close (difflib's ratio of at least 0.6)."""
    match = difflib.get_close_matches(word, list(candidates), n=1)
    return match[0] if match else None


class Parser(argparse.ArgumentParser):
    """argparse as git and pip behave: an abbreviated flag is refused (``--max-step`` is not taken for
    ``--max-steps``), and a mistyped command, choice or flag is answered with the nearest one. Every
    command's parser is one (argparse gives subparsers their parent's class)."""

    # what argparse takes for a negative number (a value) rather than a flag: also -1e300, -inf, -nan,
    # so that such a value reaches its option's bound and is refused by it (no option looks like one)
    NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", KeepLinesFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = self.NEGATIVE_NUMBER

    def _check_value(self, action: argparse.Action, value) -> None:  # argparse checks each choice here
        if action.choices is not None and value not in action.choices:
            near = nearest(value, action.choices) if isinstance(value, str) else None
            rest = f"did you mean {near!r}?" if near else "choose from " + ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} ({rest})")

    def unrecognized(self, extra: list[str]) -> NoReturn:
        """argparse's "unrecognized arguments" error, with this command's usage and the nearest flag
        to each unknown one."""
        flags = [s for s in self._option_string_actions if s.startswith("--")]
        hints = [near for e in extra if e.startswith("--") and (near := nearest(e.split("=", 1)[0], flags))]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command (or subcommand, as ``qkv bench layers``) that read ``args``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return command_parser(action.choices[getattr(args, action.dest)], args)
    return parser


def preset_name(name: str) -> str:
    """``--preset``'s type. An unknown name is a one-line error: a ConfigError, which argparse does not
    turn into the command's usage (it does for a ValueError or a ``choices`` miss)."""
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {name!r}{did_you_mean(name, PRESETS)} (choose from "
                          f"{', '.join(PRESETS)})")
    return name


PRESET_METAVAR = "{" + ",".join(PRESETS) + "}"


def package_version() -> str:
    """qkv's version from the installed package's metadata (``qkv.__version__`` in a tree not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qkv")
    except PackageNotFoundError:
        from qkv import __version__

        return __version__


def build_parser(handlers: dict[str, Callable[[argparse.Namespace], int]]) -> Parser:
    """The ``qkv`` parser; ``handlers`` maps each command to the function that runs it."""
    p = Parser(
        prog="qkv", formatter_class=CommandListFormatter,
        description="The Transformer of 'Attention Is All You Need', trained and used end to end.",
        epilog="Run 'qkv COMMAND --help' for a command's options. With no data, 'qkv train' learns the "
               "embedded default task (English number words -> German) in a few minutes on a CPU.",
    )
    p.add_argument("--version", action="version", version=f"qkv {package_version()}", help="print the version and exit")
    sub = p.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    for add in (add_train_parser, add_preprocess_parser, add_translate_parser, add_score_parser,
                add_evaluate_parser, add_generate_parser, add_classify_parser, add_fill_parser, add_embed_parser,
                add_search_parser, add_average_parser, add_info_parser, add_viz_parser, add_bench_parser,
                add_export_parser, add_import_parser, add_serve_parser, add_lab_parser):
        add(sub, handlers)
    name_bounded_options(p)
    return p


def add_train_parser(sub, handlers: dict) -> None:
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
    t.add_argument("--valid-fraction", type=amount(0, 1), default=0.0, metavar="F",
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
    t.add_argument("--data", metavar="DIR", help="translate: a directory written by qkv preprocess (token ids "
                                                "memory-mapped, its tokenizer), instead of --src-train/--tgt-train")
    t.add_argument("--out", default="runs/default", help="run directory")
    t.add_argument("--tensorboard", metavar="DIR", help="also log the scalars of OUT/metrics.jsonl to TensorBoard "
                                                        "event files in DIR (pip install 'qkv[tensorboard]')")
    t.add_argument("--resume", action="store_true", help="continue the run in OUT from OUT/last exactly where it stopped")
    t.add_argument("--preset", type=preset_name, metavar=PRESET_METAVAR,
                   help=f"model and training preset (default: {DEFAULT_PRESET}, or the embedded task's own recipe when no "
                        "data is given; the values of both are shown below)")
    t.add_argument("--config", help="TOML file with [model], [train], [decode] tables (and 'preset')")
    from qkv.config import preset
    from qkv.data import toy

    given, embedded = f"on given data (preset {DEFAULT_PRESET})", "on the embedded task"
    model_preset, train_preset = preset(DEFAULT_PRESET)
    add_config_flags(t, ModelConfig, "model (ModelConfig)", [(given, model_preset), (embedded, toy.MODEL)])
    add_config_flags(t, TrainConfig, "training (TrainConfig)", [(given, train_preset), (embedded, toy.TRAIN)])
    add_config_flags(t, DecodeConfig, "decoding for validation and the saved model (DecodeConfig)")
    t.set_defaults(func=handlers["train"])


def add_translate_parser(sub, handlers: dict) -> None:
    tr = sub.add_parser("translate", help="translate with a trained model",
                        description="Translate sentences given as arguments, a file (--input) or stdin, one "
                                    "per line, to stdout (or --output). Empty lines stay empty. With --nbest N "
                                    "each line is 'index<TAB>score<TAB>translation'.")
    tr.add_argument("model", help="checkpoint directory, e.g. runs/default/best")
    tr.add_argument("text", nargs="*", help="sentences to translate (else --input or stdin)")
    tr.add_argument("--input", "-i", help="file to translate, plain or gzip ('-' = stdin)")
    tr.add_argument("--output", "-o", help="write translations here instead of stdout (all or nothing: the file is "
                                           "replaced only when every line is translated)")
    tr.add_argument("--engine", choices=["qkv", "ctranslate2"], default="qkv", help=ENGINE_HELP)
    tr.add_argument("--engine-timeout", type=amount(0.1, 86400), default=None, metavar="SECONDS",
                    help=ENGINE_TIMEOUT_HELP)
    tr.add_argument("--int8", action="store_true", help=INT8_HELP)
    tr.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    tr.add_argument("--device", default="cpu", help=DEVICE_HELP)
    tr.add_argument("--threads", type=count(0, MAX_THREADS), default=0,
                    help="CPU threads: torch's (qkv) or CTranslate2's intra_threads (ctranslate2) (default: 0, the "
                         "engine's default)")
    tr.add_argument("--target-prefix", metavar="TEXT",
                    help="every translation starts with TEXT (forced); the search continues after it")
    tr.add_argument("--output-format", choices=["text", "jsonl"], default="text",
                    help="text: one translation a line (with --nbest: index<TAB>score<TAB>translation); jsonl: a JSON "
                         "object a line, {'line', 'hypotheses': [{'text', 'score', 'logprob', 'tokens', "
                         "'token_logprobs', 'alignment'}]}, the alignment in Pharaoh i-j form (source piece i, target "
                         "piece j) from the last decoder layer's cross-attention")
    tr.add_argument("--ensemble", action="append", metavar="CHECKPOINT", help=ENSEMBLE_HELP)
    add_config_flags(tr, DecodeConfig, "decoding (default: the model's saved settings)")
    tr.set_defaults(func=handlers["translate"])


def add_score_parser(sub, handlers: dict) -> None:
    sc = sub.add_parser("score", help="log-probabilities of given translations (forced decoding)",
                        description="Score each target line as a translation of its source line: the model's "
                                    "log-probability of every target token given the source and the tokens before "
                                    "it, EOS last (fairseq's --score-reference, CTranslate2's score_batch). Each "
                                    "output line is 'total<TAB>per-token log-probabilities'; the total is "
                                    "log p(target | source), what beam search ranks before its length penalty. "
                                    "Use it to rerank n-best lists or filter a corpus.",
                        epilog="example:\n  qkv score runs/ende/best --src test.en --tgt test.hyp > test.scores")
    sc.add_argument("model", help="checkpoint directory of a translate or prefix_lm run")
    sc.add_argument("--src", required=True, help="source sentences, one a line (plain or gzip)")
    sc.add_argument("--tgt", required=True, help="target sentences to score, as many lines as --src")
    sc.add_argument("--tgt-format", choices=["text", "pieces", "jsonl"], default="text",
                    help="text: tokenized by the model; pieces: target pieces separated by spaces, scored as given; "
                         "jsonl: qkv translate --output-format jsonl output, every hypothesis scored by its own "
                         "pieces (an output line per hypothesis), so a beam output scores its beam log-probability")
    sc.add_argument("--output", "-o", help="write the scores here instead of stdout (all or nothing)")
    sc.add_argument("--device", default="cpu", help=DEVICE_HELP)
    add_run_flags(sc, batch=False, engine=False)
    sc.set_defaults(func=handlers["score"])


def add_evaluate_parser(sub, handlers: dict) -> None:
    ev = sub.add_parser("evaluate", help="BLEU, chrF and TER of translations; accuracy, macro-F1 of a classifier",
                        description="Translation: score detokenized output against raw references and print these "
                                    "scores, each with its sacreBLEU signature: (1) sacreBLEU's BLEU (cased, 13a "
                                    "tokenization); with --lang (or a --ref name such as test.de) BLEU on "
                                    "Moses-tokenized text (2) the Multi30k way (lowercased) and (3) the WMT way "
                                    "(compounds split, the paper's); (4) chrF; (5) TER (edits per reference word, "
                                    "lower is better). "
                                    "Either score a hypothesis file (--hyp) or translate --src with MODEL first. "
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
    ev.add_argument("--last-fraction", type=amount(0, 1), default=0.0,
                    help="language model: score only the last F of the text (what --valid-fraction F held out)")
    ev.add_argument("--text-field", default="text", help="classifier: JSONL key / TSV column of the text")
    ev.add_argument("--label-field", default="label", help="classifier: JSONL key / TSV column of the label")
    ev.add_argument("--output", "-o", help="also save MODEL's translations (or predicted labels) here")
    ev.add_argument("--int8", action="store_true", help=INT8_HELP)
    ev.add_argument("--device", default="cpu", help=DEVICE_HELP)
    ev.add_argument("--threads", type=count(0, MAX_THREADS), default=0, help=THREADS_HELP)
    ev.add_argument("--ensemble", action="append", metavar="CHECKPOINT", help=ENSEMBLE_HELP)
    ev.add_argument("--lang", help="target language for the Moses tokenizer of the lowercased BLEU "
                                   "(default: from the --ref file name, e.g. test.de)")
    add_config_flags(ev, DecodeConfig, "decoding (default: the model's saved settings)")
    ev.set_defaults(func=handlers["evaluate"])


THREADS_HELP = "torch CPU threads (default: 0, torch's default: one per core)"
BATCH_HELP = "texts per forward pass, similar lengths batched together (default: 64)"


RUN_ENGINE_HELP = ("what runs the model: qkv's own modules, or CTranslate2 (Transformers: its Encoder, with the "
                   "pooling and heads in torch, or its Generator; converted once and cached beside the checkpoint; "
                   "docs/inference.md#engines)")
RUN_INT8_HELP = ("int8: qkv's dynamic quantisation of the linear layers (--engine qkv) or CTranslate2's int8 compute "
                 "type (--engine ctranslate2); the agreement with the float model is in docs/pretrained.md")


def add_run_flags(parser: argparse.ArgumentParser, batch: bool = True, engine: bool = True) -> None:
    """--engine and --int8 (``engine``), --threads (and --batch-size, for the commands that run many texts
    at once) of an inference command."""
    if engine:
        parser.add_argument("--engine", choices=["qkv", "ctranslate2"], default="qkv", help=RUN_ENGINE_HELP)
        parser.add_argument("--int8", action="store_true", help=RUN_INT8_HELP)
    parser.add_argument("--threads", type=count(0, MAX_THREADS), default=0,
                        help=THREADS_HELP + "; with --engine ctranslate2, its intra_threads")
    if batch:
        parser.add_argument("--batch-size", type=count(1, MAX_WIDTH), default=64, dest="batch_size", help=BATCH_HELP)


def add_generate_parser(sub, handlers: dict) -> None:
    g = sub.add_parser("generate", help="continue a text with a language model (streamed)",
                       formatter_class=DefaultsHelpFormatter,
                       description="Continue --prefix with a language model trained with --task lm, printing "
                                   "the text as it is produced (each token flushed). Tokens are drawn from the "
                                   "model's next-token distribution reshaped by --temperature (T<1 sharper, "
                                   "T>1 flatter), --top-k (keep the k most probable) and --top-p (keep the "
                                   "smallest set with probability mass >= p); --greedy takes the most probable "
                                   "token every time. --seed makes a draw repeatable. The Transformer keeps a "
                                   "key/value cache, the RNNs their state: each new token costs one step.",
                       epilog='example:\n  qkv generate runs/timemachine/lstm/best --prefix "the time traveller" '
                              "--temperature 0.8 --top-p 0.95 --seed 1")
    g.add_argument("model", help="checkpoint directory of a --task lm run, e.g. runs/tm/best")
    g.add_argument("--prefix", default="", help="the text to continue (may be empty)")
    g.add_argument("--max-new-tokens", type=count(0, 10**6), default=200, help="tokens to generate")
    g.add_argument("--temperature", type=amount(1e-6, 100, zero=True), default=1.0, help="divide the logits by T (> 0)")
    g.add_argument("--top-k", type=count(0, MAX_VOCAB), default=0, help="sample among the k most probable tokens (0: all)")
    g.add_argument("--top-p", type=amount(0, 1), default=1.0, help="sample from the nucleus of mass p (1: all)")
    g.add_argument("--seed", type=count(0, MAX_SEED), default=None, help="random seed (default: a fresh draw each run)")
    g.add_argument("--greedy", action="store_true", help="always the most probable token (temperature 0)")
    add_run_flags(g, batch=False)  # one prefix, one token a step
    g.set_defaults(func=handlers["generate"])


def add_classify_parser(sub, handlers: dict) -> None:
    c = sub.add_parser("classify", help="label texts with a trained classifier",
                       description="Print the most probable label and its probability ('label<TAB>prob') for "
                                   "each text given as an argument, in a file (--input) or on stdin, one per "
                                   "line. An empty input line gives an empty output line. Texts are cleaned as "
                                   "in training (<br /> -> space) and truncated to the model's max_len tokens.",
                       epilog='example:\n  qkv classify runs/imdb/best "this movie is so great"')
    c.add_argument("model", help="checkpoint directory of a --task classify run, e.g. runs/imdb/best")
    c.add_argument("text", nargs="*", help="texts to classify (else --input or stdin)")
    c.add_argument("--input", "-i", help="file with one text a line, plain or gzip ('-' = stdin)")
    c.add_argument("--output", "-o", help="write the labels here instead of stdout")
    c.add_argument("--all", action="store_true", help="also print every label's probability")
    add_run_flags(c)
    c.set_defaults(func=handlers["classify"])


def add_fill_parser(sub, handlers: dict) -> None:
    fl = sub.add_parser("fill", help="fill in [MASK] with a masked language model",
                        description="Show the most probable pieces for each [MASK] in the text, with their "
                                    "probabilities, from a --task mlm model.",
                        epilog='example:\n  qkv fill runs/mlm/best "the movie was [MASK]" --top-k 5')
    fl.add_argument("model", help="checkpoint directory of a --task mlm run")
    fl.add_argument("text", nargs="+", help="texts with one or more [MASK]")
    fl.add_argument("--top-k", type=count(1, MAX_VOCAB), default=5, dest="top_k", help="predictions per mask (default: %(default)s)")
    add_run_flags(fl, batch=False)  # one text a forward pass
    fl.set_defaults(func=handlers["fill"])


def add_embed_parser(sub, handlers: dict) -> None:
    em = sub.add_parser("embed", help="sentence embeddings from an encoder",
                        description="Embed every line of --input with a classify or mlm model: the encoder's "
                                    "states pooled into one vector (mean over the tokens, or the <cls> state). "
                                    "Writes an N x d_model array: .npy (NumPy) or .tsv (one vector a line). A blank line is "
                                    "embedded as the model reads an empty text (<cls> and the tokenizer's own "
                                    "markers, as sentence-transformers embeds it).",
                        epilog="example:\n  qkv embed runs/mlm/best --input sentences.txt --output vectors.npy")
    em.add_argument("model", help="checkpoint directory of a --task classify or mlm run")
    em.add_argument("--input", "-i", required=True, help="one text a line (plain or gzip)")
    em.add_argument("--output", "-o", required=True, help="FILE.npy or FILE.tsv")
    em.add_argument("--pooling", choices=["mean", "cls"],
                    help="mean over the tokens or the <cls> state (default: a classifier's own, mean for mlm)")
    add_run_flags(em)
    em.set_defaults(func=handlers["embed"])


def add_search_parser(sub, handlers: dict) -> None:
    se = sub.add_parser("search", help="rank the lines of a corpus by similarity to a query",
                        description="Embed every line of --corpus and each query (as qkv embed), and print the "
                                    "top-k lines by cosine similarity q.d / (|q| |d|), with their line numbers.",
                        epilog='example:\n  qkv search runs/mlm/best --corpus reviews.txt "a funny film" --top-k 5')
    se.add_argument("model", help="checkpoint directory of a --task classify or mlm run")
    se.add_argument("query", nargs="+", help="query texts")
    se.add_argument("--corpus", required=True, help="one text a line (plain or gzip)")
    se.add_argument("--top-k", type=count(1, 10**9), default=5, dest="top_k", help="results per query (default: %(default)s)")
    se.add_argument("--pooling", choices=["mean", "cls"], help="as for qkv embed")
    add_run_flags(se)
    se.set_defaults(func=handlers["search"])


def add_average_parser(sub, handlers: dict) -> None:
    a = sub.add_parser("average", help="average checkpoints (the paper averages the last 5 or 20)",
                       description="Average the parameters of several checkpoints of one run into a new "
                                   "checkpoint for decoding: either list checkpoint directories, or give one run "
                                   "directory and --last N to take its newest N step_N/ checkpoints (saved during "
                                   "training with --keep-last N).")
    a.add_argument("inputs", nargs="+", help="checkpoint directories, or one run directory with --last")
    a.add_argument("--last", type=count(1, 10**4), help="average the newest N step_N/ checkpoints of the run directory")
    a.add_argument("--out", required=True, help="where to write the averaged checkpoint: a new directory, not one "
                                                "of the checkpoints averaged nor the run's last/, best/, step_N/")
    a.set_defaults(func=handlers["average"])


def add_info_parser(sub, handlers: dict) -> None:
    i = sub.add_parser("info", help="parameter count and training FLOPs",
                       description="Print the parameter count by component and the training FLOPs per target "
                                   "token, for a preset (no weights are allocated) or a trained MODEL; for a "
                                   "preset also its training values and its measured time per 1,000 updates.")
    i.add_argument("model", nargs="?", help="checkpoint directory (instead of a preset)")
    i.add_argument("--preset", type=preset_name, metavar=PRESET_METAVAR, help=f"model preset (default: {DEFAULT_PRESET}, as qkv train's on given data)")
    i.add_argument("--config", help="TOML file with a [model] table")
    i.add_argument("--vocab-size", type=count(1, MAX_VOCAB), dest="vocab_size", help="shared vocabulary size (default: the preset's, e.g. base 37000)")
    i.add_argument("--src-len", type=count(1, MAX_WIDTH), default=25, help="source tokens per sentence for the FLOPs")
    i.add_argument("--tgt-len", type=count(1, MAX_WIDTH), default=25, help="target tokens per sentence for the FLOPs")
    add_config_flags(i, ModelConfig, "model (ModelConfig)")
    i.set_defaults(func=handlers["info"])


def add_viz_parser(sub, handlers: dict) -> None:
    v = sub.add_parser("viz", help="draw attention maps, the positional encoding, the schedule, a run's curves",
                       description="Pictures of what the model does and how it trained (needs matplotlib: "
                                   "pip install 'qkv[viz]').", formatter_class=CommandListFormatter)
    v.set_defaults(func=handlers["viz"])
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
    vp.add_argument("--positions", type=count(1, 4096), default=60, help="positions (rows) (default: %(default)s)")
    vp.add_argument("--dim", type=count(2, 4096), default=32, help="d_model, even (columns) (default: %(default)s)")
    vp.add_argument("--out", default="positional.png", help="PNG file to write (default: %(default)s)")
    vsch = vs.add_parser("schedule", help="the warmup learning-rate schedule",
                         description="lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) "
                                     "(section 5.3), its peak at step = warmup marked.")
    vsch.add_argument("--d-model", type=count(1, MAX_WIDTH), default=512, dest="d_model", help="d_model (default: %(default)s)")
    vsch.add_argument("--warmup", type=count(1, MAX_STEPS), default=4000, help="warmup steps (default: %(default)s)")
    vsch.add_argument("--steps", type=count(1, 10**7), default=20000, help="steps to plot (default: %(default)s)")
    vsch.add_argument("--scale", type=amount(0, 100), default=1.0, help="factor on the rate, as --lr-scale (default: %(default)s)")
    vsch.add_argument("--out", default="schedule.png", help="PNG file to write (default: %(default)s)")
    vt = vs.add_parser("training", help="a run's loss, validation scores and learning rate",
                       description="Training and validation loss, validation BLEU / chrF / exact match "
                                   "(translate, prefix_lm) or accuracy / macro-F1 (classify), "
                                   "validation perplexity and the learning rate against the step, from "
                                   "RUN/metrics.jsonl (written by qkv train; a run still training is fine).")
    vt.add_argument("run", help="run directory (the --out of qkv train), e.g. runs/default")
    vt.add_argument("--out", default="training.png", help="PNG file to write (default: %(default)s)")


EXPORT_EPILOG = """\
formats:
  ctranslate2  a CTranslate2 model directory (ctranslate2.Translator for translate, ctranslate2.Generator
               for lm and prefix_lm, ctranslate2.Encoder for classify and mlm: the encoder stack, whose
               last hidden states the card pools as qkv embed does; the heads are not written):
               model.bin, config.json, the vocabularies in qkv's id order, the tokenizer (SentencePiece
               models, or an imported model's tokenizer.json); --quantization int8 | int8_float32 |
               float16 (default: float32). Imports that convert: BERT, RoBERTa, XLM-R, DistilBERT,
               ELECTRA with embeddings as wide as its layers, GPT-2, Llama, Qwen2, Mistral, Marian,
               BART, T5. Refused, naming the field: ALBERT and ELECTRA-small (embedding_dim: narrow
               embeddings and their projection; ALBERT's layer_groups), rotary positions or grouped-query
               attention in a translation model, relative buckets in a decoder-only model, RMSNorm with a
               bias, and in an encoder-only model every switch BERT's layers lack (rotary or relative
               positions, RMSNorm, a gated FFN, attention_scale false, grouped-query attention)
  hf           a Hugging Face MarianMTModel directory (translate, post-norm, sinusoidal positions):
               config.json, model.safetensors, generation_config.json, MarianTokenizer files
               (source.spm, target.spm, vocab.json); a checkpoint of qkv import goes back as its own
               class (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, GPT2LMHeadModel, the
               Bert/Roberta/XLMRoberta/Camembert/DistilBert/Albert Model, ForMaskedLM and
               ForSequenceClassification, ElectraModel, ElectraForSequenceClassification,
               BartForConditionalGeneration, T5ForConditionalGeneration) with its tokenizer.json and
               tokenizer_config.json

Both also write README.md (a model card with YAML front matter) and qkv_export.json (how to
tokenize and decode, where the runtime differs from qkv, what was checked). Every export runs a
few probe sequences through the exported model and the checkpoint and stops with an error if
they disagree. Needs: pip install -c constraints.txt -e ".[export]"

examples:
  qkv export runs/ende/best --format ctranslate2 --out exported/ende-ct2 --quantization int8
  qkv export runs/ende/best --format hf --out exported/ende-hf --src test.en --ref test.de --license cc-by-4.0
  qkv export runs/tm/best --format ctranslate2 --out exported/tm-ct2     # a language model
  qkv export runs/minilm --format ctranslate2 --out exported/minilm-ct2  # an imported encoder
"""


def add_preprocess_parser(sub, handlers: dict) -> None:
    pp = sub.add_parser("preprocess", help="binarize a parallel corpus for qkv train --data",
                        formatter_class=DefaultsHelpFormatter,
                        description="Tokenize a parallel corpus once, in worker processes and one streaming pass, "
                                    "into memory-mapped token arrays that 'qkv train --data OUT' reads on demand "
                                    "(fairseq-preprocess's role). Trains a SentencePiece tokenizer on a random "
                                    "sample of the training text (with byte fallback: no character becomes "
                                    "<unk>) or reuses one (--tokenizer-from). Filters the training pairs (empty, "
                                    "identical sides, over --max-len tokens, length ratio over --max-ratio) and "
                                    "counts each in OUT/manifest.json, with the sha256 of every file. Writes a "
                                    "temporary directory renamed to OUT at the end.",
                        epilog="examples:\n  qkv preprocess --src-train train.en --tgt-train train.de --src-valid "
                               "val.en --tgt-valid val.de --vocab-size 10000 --workers 4 --out data/en-de\n"
                               "  qkv train --data data/en-de --preset base --out runs/en-de")
    pp.add_argument("--src-train", required=True, help="training source file (plain or gzip)")
    pp.add_argument("--tgt-train", required=True, help="training target file (same number of lines)")
    pp.add_argument("--src-valid", help="validation source file")
    pp.add_argument("--tgt-valid", help="validation target file")
    pp.add_argument("--out", required=True, help="the directory to write (must not exist, or be empty)")
    pp.add_argument("--tokenizer-from", help="reuse this tokenizer: a preprocessed or checkpoint directory, or a "
                                             "SentencePiece .model (else one is trained)")
    pp.add_argument("--tokenizer", choices=["bpe", "unigram", "char"], default="bpe",
                    help="SentencePiece model type (char reads the whole training text into memory)")
    pp.add_argument("--vocab-size", type=count(1, MAX_VOCAB), default=8000, help="SentencePiece vocabulary size")
    pp.add_argument("--separate-vocab", action="store_true", help="one vocabulary per side instead of a joint one")
    pp.add_argument("--sample", type=count(1, 10**9), default=1_000_000,
                    help="sentences SentencePiece learns from, drawn at random from the training text")
    pp.add_argument("--max-len", type=count(1, MAX_WIDTH), default=256, help="skip training pairs with a side over this many tokens")
    pp.add_argument("--max-ratio", type=amount(1, 10**6, zero=True), default=9.0,
                    help="skip training pairs whose longer side has more than this many times the tokens of the "
                         "shorter (0: no such filter)")
    pp.add_argument("--keep-identical", action="store_true", help="keep training pairs whose sides are identical")
    pp.add_argument("--workers", type=count(1, MAX_THREADS), default=1,
                    help="encoding processes (no more than the cores this process may use, nor than the chunks of "
                         "20,000 lines the training text makes: a cap is said on stderr)")
    pp.set_defaults(func=handlers["preprocess"])


def add_export_parser(sub, handlers: dict) -> None:
    e = sub.add_parser("export", help="a trained model for CTranslate2 or Hugging Face transformers",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Convert a checkpoint for another runtime: CTranslate2 (Transformer translation\n"
                                   "models, language models and encoders) or Hugging Face transformers' MarianMTModel\n"
                                   "(translation models). The directory --out is written whole or not at all.",
                       epilog=EXPORT_EPILOG)
    e.add_argument("model", help="checkpoint directory, e.g. runs/ende/best")
    e.add_argument("--format", required=True, choices=["ctranslate2", "hf"], help="what to write")
    e.add_argument("--out", required=True, help="a new (or empty) directory to write")
    e.add_argument("--quantization", choices=["int8", "int8_float32", "float16"],
                   help="ctranslate2: weight type of the saved model (default: float32)")
    e.add_argument("--src", help="model card: a test source file to translate with MODEL (its saved decoding "
                                 "settings) and score ...")
    e.add_argument("--ref", help="... against these references (sacreBLEU BLEU and chrF, with signatures)")
    e.add_argument("--source-lang", help="model card: the source language code (default: from the training "
                                         "files' names, e.g. train.en)")
    e.add_argument("--target-lang", help="model card: the target language code (default: as --source-lang)")
    e.add_argument("--license", default="unknown", help="model card: the weights' license, e.g. cc-by-4.0 "
                                                        "(default: unknown)")
    e.add_argument("--dataset", help="model card: the training data's name (default: what training recorded)")
    e.set_defaults(func=handlers["export"])


class ImportHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``qkv import --help``: the families it converts, read from the importers' registry
    (:func:`qkv.importers.families`) when the help is shown, so that the list stays true as families are
    added and the other commands' parsers never import the converters."""

    def add_text(self, text):
        if text and "{families}" in text:
            import textwrap

            from qkv.importers import SENTENCE_TRANSFORMERS, families

            rows = families()
            width = max(len(model_type) for model_type, _ in rows)
            listing = "\n".join(f"  {model_type:<{width}}  {', '.join(archs)}" for model_type, archs in rows)
            text = text.replace("{families}", f"{listing}\n" + textwrap.fill(f"and {SENTENCE_TRANSFORMERS}.", 80))
        super().add_text(text)


def add_import_parser(sub, handlers: dict) -> None:
    m = sub.add_parser("import", help="a pretrained model from a local Hugging Face folder, as a qkv checkpoint",
                       formatter_class=ImportHelpFormatter,
                       description="Convert a pretrained model saved by transformers (config.json, model.safetensors\n"
                                   "or pytorch_model.bin, tokenizer.json) or a sentence-transformers folder into a\n"
                                   "qkv checkpoint directory that every command takes (embed, search, classify,\n"
                                   "fill, translate, generate, serve, viz, train --init-from, ...; what the model\n"
                                   "offers). It converts these families (config.json's model_type: its\n"
                                   "architectures):\n{families}\n"
                                   "An architecture or option qkv cannot convert exactly is refused by name; a\n"
                                   "malformed folder (a config.json field, a tensor that is not floating point,\n"
                                   "finite and of the config's shape, a pickle holding more than tensors, a broken\n"
                                   "tokenizer.json) is refused in one line naming the file and the field. Either\n"
                                   "way: exit status 2, nothing written. docs/pretrained.md says what each command\n"
                                   "does with an imported model.")
    m.add_argument("folder", metavar="HF_DIR", help="the model's folder, e.g. models/all-MiniLM-L6-v2")
    m.add_argument("--out", required=True, help="a new (or empty) checkpoint directory to write")
    m.set_defaults(func=handlers["import"])


def add_bench_parser(sub, handlers: dict) -> None:
    b = sub.add_parser("bench", help="Table 1 and the long-range argument of section 4, measured",
                       description="Measure what section 4 ('Why Self-Attention') argues: the cost of one layer "
                                   "of each type as n grows (layers), and how far back each model can learn "
                                   "to look (long-range). Writes JSON + PNG (needs matplotlib).",
                       formatter_class=CommandListFormatter)
    b.set_defaults(func=handlers["bench"])
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
    bl.add_argument("--d", type=count(1, 16384), default=512, help="representation dimension d")
    bl.add_argument("--n-min", type=count(1, 16384), default=16, dest="n_min", help="shortest sequence length")
    bl.add_argument("--n-max", type=count(1, 16384), default=4096, dest="n_max", help="longest sequence length")
    bl.add_argument("--r", type=count(1, 16384), default=64, help="radius of restricted attention: i sees j with |i-j| <= r")
    bl.add_argument("--k", type=count(1, 64), default=3, help="convolution kernel width (dilation k^i in layer i)")
    bl.add_argument("--heads", type=count(1, 1024), default=8, help="attention heads h")
    bl.add_argument("--batch", type=count(1, 4096), default=1, help="sequences per batch")
    bl.add_argument("--repeats", type=count(1, 1000), default=3, help="timed runs per point (median), after a warm-up")
    bl.add_argument("--layers", default="self-attention,attention-core,restricted,restricted-dense,lstm,rnn,conv,"
                                         "conv-dilated", help="comma-separated layer types to measure")
    bl.add_argument("--threads", type=count(0, MAX_THREADS), default=0, help="torch CPU threads (0: torch's default)")
    bl.add_argument("--out", default="runs/bench", help="output directory")
    bl.add_argument("--quick", action="store_true",
                    help="a smoke run: d=64, n=16..256, r=8, one timed repeat, one thread unless --threads; 45 s "
                         "(13 s of CPU) on a 2-core AMD EPYC at load 10, where torch's default 2 threads took 234 s "
                         "(docs/seeing-inside.md)")
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
    blr.add_argument("--steps", type=count(1, 10**6), default=300, help="training steps per model and distance")
    blr.add_argument("--hidden", type=count(1, 16384), default=64, help="hidden size (RNN, LSTM) and d_model (Transformer)")
    blr.add_argument("--symbols", type=count(2, 10**4), default=8, help="alphabet size K (chance accuracy 1/K)")
    blr.add_argument("--batch", type=count(1, 10**5), default=32, help="sequences per training step")
    blr.add_argument("--lr", type=amount(0, 10), default=3e-3, help="Adam learning rate")
    blr.add_argument("--seed", type=count(0, MAX_SEED), default=0, help="random seed")
    blr.add_argument("--threads", type=count(0, MAX_THREADS), default=0, help="torch CPU threads (0: torch's default)")
    blr.add_argument("--out", default="runs/bench", help="output directory")
    blr.add_argument("--quick", action="store_true", help="a smoke run in seconds: t = 3, 5; 60 steps")


SERVE_EPILOG = """\
endpoints (JSON; OpenAPI at /docs and /redoc, from local files; the page at /):
  POST /translate  {"texts": [...], "beam_size", "n_best", "target_prefix", "alignments", "attention"}
  POST /score      {"sources": [...], "targets": [...]}      log-probabilities per sentence and token
  POST /classify   {"texts": [...]}                          POST /fill {"texts": [...], "k"}
  POST /generate   {"prefix", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stream"}
  GET  /models     GET /health
Concurrent requests to a model are decoded together (up to --max-batch-tokens source tokens,
waiting at most --batch-wait-ms for more). Needs: pip install -c constraints.txt -e ".[serve]"

examples:
  qkv serve runs/default/best                       # http://127.0.0.1:8000/
  qkv serve ende=runs/ende/best tm=runs/tm/best --port 8080 --threads 2
  qkv serve runs/ende/best --engine ctranslate2 --length-norm length --early-stopping   # CTranslate2 decodes
"""


def add_serve_parser(sub, handlers: dict) -> None:
    from qkv.serve.limits import Limits

    s = sub.add_parser("serve", help="serve checkpoints over HTTP (JSON API, web page, dynamic batching)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SERVE_EPILOG,
                       description="Serve one or more checkpoints (any task) over HTTP: a JSON API with\n"
                                   "request bounds, a web page at / and the OpenAPI docs at /docs and /redoc.")
    s.add_argument("models", nargs="+", metavar="MODEL",
                   help="checkpoint directory, e.g. runs/default/best (named after its run: default), or NAME=DIR")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine "
                                                       "only; 0.0.0.0 opens it to the network, with no "
                                                       "authentication)")
    s.add_argument("--allowed-hosts", action="append", default=[], metavar="NAMES",
                   help="host names the server answers (the Host header, any port) besides localhost, 127.x.x.x "
                        "and [::1]: comma-separated or the flag repeated; * for any (default: only those on a "
                        "loopback --host, any on another); other names get 400, against DNS rebinding")
    s.add_argument("--port", type=count(0, 65535), default=8000, help="port (default: 8000; 0: any free port)")
    s.add_argument("--engine", choices=["qkv", "ctranslate2"], default="qkv", help=ENGINE_HELP)
    s.add_argument("--engine-timeout", type=amount(0.1, 86400), default=None, metavar="SECONDS",
                   help=ENGINE_TIMEOUT_HELP)
    s.add_argument("--device", default="cpu", help=DEVICE_HELP)
    s.add_argument("--threads", type=count(0, MAX_THREADS), default=0, help="CPU threads: torch's (qkv) or CTranslate2's "
                                                          "intra_threads (ctranslate2) (default: 0, the engine's default)")
    s.add_argument("--int8", action="store_true", help=INT8_HELP)
    s.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    add_config_flags(s, DecodeConfig, "decoding of translation models (default: each model's saved settings)")
    group = s.add_argument_group("bounds and batching")
    defaults = Limits()
    for f in dataclasses.fields(Limits):
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                           type=Number(Bound(type(getattr(defaults, f.name)), f.metadata["low"], f.metadata["high"])),
                           default=getattr(defaults, f.name), metavar="N",
                           help=f"{f.metadata['help']} (default: {getattr(defaults, f.name)})")
    s.set_defaults(func=handlers["serve"])


LAB_EPILOG = """\
In the page: pick a task (copy, reverse, sort, long_range, numbers, or the files given here) and an
architecture (a Transformer, or an RNN, LSTM or GRU with or without attention; a preset or by hand),
start it, and watch its loss, exact match (or BLEU), learning rate and gradient norm as it trains;
draw several runs on one chart; type an input to see the newest checkpoint's output, attention
(per layer and head) and, for a recurrent model, the hidden state's norm. Each run is an ordinary
'qkv train' run directory (ROOT/NAME), so 'qkv translate ROOT/NAME/best' works on it.
Needs: pip install -c constraints.txt -e ".[serve]"

examples:
  qkv lab                                            # http://127.0.0.1:8001/
  qkv lab --src-train train.en --tgt-train train.de --max-runs 3 --run-threads 2
"""


def add_lab_parser(sub, handlers: dict) -> None:
    from qkv.lab.runs import LabLimits
    from qkv.serve.limits import Limits

    s = sub.add_parser("lab", help="train, watch and compare Transformers and RNNs in the browser",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=LAB_EPILOG,
                       description="A web page on 127.0.0.1 (this machine only) that starts training runs,\n"
                                   "draws their curves as they come and shows what the models attend to.")
    s.add_argument("--root", default="lab-runs", help="where the runs go, one directory each (default: lab-runs)")
    s.add_argument("--port", type=count(0, 65535), default=8001, help="port on 127.0.0.1 (default: 8001; 0: any free port)")
    s.add_argument("--src-train", help="your own task: training source file (one sentence a line)")
    s.add_argument("--tgt-train", help="your own task: training target file (same number of lines)")
    s.add_argument("--src-valid", help="validation source file (default: the last 5%% of the training lines)")
    s.add_argument("--tgt-valid", help="validation target file")
    group = s.add_argument_group("bounds")
    defaults = LabLimits()
    for f in dataclasses.fields(LabLimits):
        if f.name in ("max_texts", "max_beam", "max_nbest", "max_new_tokens", "max_attention", "max_queue",
                      "batch_wait_ms", "max_batch_tokens", "max_tokens") or not hasattr(defaults, f.name):
            continue  # serve's decoding bounds: the lab decodes one text at a time
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                           type=Number(Bound(type(getattr(defaults, f.name)), f.metadata["low"], f.metadata["high"])),
                           default=getattr(defaults, f.name), metavar="N",
                           help=f"{f.metadata['help']} (default: {getattr(defaults, f.name)})".replace("%", "%%"))
    s.set_defaults(func=handlers["lab"])
