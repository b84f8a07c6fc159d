"""The lab's runs: the tasks it offers, the architecture presets, and :class:`Lab`, which starts each
run as an ordinary ``qkv train`` in a child process and reads back what it writes.

A run named NAME is the run directory ``ROOT/NAME`` (``lab-runs/NAME`` by default): ``last/``,
``best/``, ``metrics.jsonl`` as ``qkv train --out`` leaves them, plus ``lab.json`` (what was asked
for) and ``train.log`` (the child's output). The generated tasks' text files lie in ``ROOT/.data``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from qkv.bounds import whole
from qkv.config import (ACTIVATIONS, ARCHS, ATTENTION_SCORES, NORMS, POSITIONALS, SCHEDULES, ModelConfig, TrainConfig,
                        override)
from qkv.data import synthetic, toy
from qkv.errors import ConfigError, QkvError
from qkv.serve.limits import Limits, bound


@dataclass(frozen=True)
class LabLimits(Limits):
    """The bounds of ``qkv serve`` (request size, Host header, timeouts) and those of the lab's runs."""

    max_runs: int = bound(3, "runs training at once (another start is refused until one ends)", high=64)
    run_threads: int = bound(1, "torch threads of each run", high=1024)
    max_time: float = bound(600.0, "seconds of training a run may take at most (its --max-time)", high=7 * 86400)
    run_queue: int = bound(4, "requests looking inside one run at once (one computing, the rest waiting; more "
                              "are refused with 429)", high=1024)


class LabError(QkvError):
    """A request the lab refuses, with its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# --- tasks -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """A task the page offers: its name, what it is, its tokenizer, and how its pairs are made."""

    name: str
    title: str
    example: str  # an input to type
    tokenizer: str = "char"  # one symbol one token
    vocab_size: int = 64
    files: tuple[str, str, str, str] | None = None  # given on the command line: src/tgt train, src/tgt valid
    kind: str = "translate"  # qkv's task (ModelConfig.task): translate (encoder-decoder), classify, mlm
    # (encoder-only), lm (decoder-only)

    @property
    def metrics(self) -> tuple[str, ...]:
        """The validation scores that mean something here besides the loss: BLEU only on your own
        sentences (the generated tasks' outputs are one word each, where BLEU's 4-grams of words find
        nothing: it stays 0); a classifier's accuracy; a language model's perplexity."""
        if self.kind == "classify":
            return ("valid_accuracy",)
        if self.kind in ("mlm", "lm"):
            return ("valid_ppl",)
        return ("valid_exact", "valid_bleu") if self.files else ("valid_exact",)

    @property
    def solved_by(self) -> str | None:
        """The score whose 99% is "solved": exact match, or a classifier's accuracy; None for a language model."""
        return {"translate": "valid_exact", "classify": "valid_accuracy"}.get(self.kind)

    def describe(self) -> dict:
        return {"name": self.name, "title": self.title, "example": self.example, "kind": self.kind,
                "metrics": list(self.metrics), "solved_by": self.solved_by}


TASKS = {t.name: t for t in (
    Task("copy", "copy: a string of 1-12 letters (a-j) back as it is", "abcdefgh"),
    Task("reverse", "reverse: the letters in reverse order", "abcdefgh"),
    Task("sort", "sort: the letters in alphabetical order", "hgbdacfe"),
    Task("long_range", f"long range: 21 letters -> the one 16 places before the last (qkv bench long-range's "
                       f"task)", "abcdefghijabcdefghija"),
    Task("numbers", "number words: English -> German (the embedded default task)", "three hundred twenty-one",
         tokenizer="bpe", vocab_size=300),
    Task("long_range_label", "encoder-only: 21 letters -> the one 16 places before the last, as a class label "
                             "(qkv train --task classify)", "abcdefghijabcdefghija", kind="classify"),
    Task("mirror_mlm", "encoder-only: masked letters of 'abcd dcba', a string and its reversal; a masked "
                       "letter is the one mirrored across the middle (qkv train --task mlm)", "abcd dcba", kind="mlm"),
    Task("mirror_lm", "decoder-only: next letter of 'abcd dcba'; after the space each letter is the one "
                      "mirrored before it (qkv train --task lm)", "abcd dcba", kind="lm"),
)}


def pairs_of(task: str) -> dict[str, list[tuple[str, str]]]:
    """The training and validation pairs of a built-in task: (source, target), (text, label), or for a
    language model and a masked one (text, "")."""
    if task == "numbers":
        splits = toy.default_splits()
        return {"train": splits["train"], "valid": splits["valid"]}
    if task == "long_range_label":
        return synthetic.splits("long_range")  # (the letters, the letter 16 places before the last)
    if task in ("mirror_mlm", "mirror_lm"):
        return {k: [(f"{s} {t}", "") for s, t in pairs] for k, pairs in synthetic.splits("reverse").items()}
    return synthetic.splits(task)


def files_task(src_train: str, tgt_train: str, src_valid: str | None = None, tgt_valid: str | None = None) -> Task:
    """The task of text files named on the command line (one sentence a line, plain or gzip); without
    validation files the lab holds out the last lines of the training files (see :meth:`Lab.data`)."""
    for flag, path in (("--src-train", src_train), ("--tgt-train", tgt_train), ("--src-valid", src_valid),
                       ("--tgt-valid", tgt_valid)):
        if path and not Path(path).is_file():
            raise QkvError(f"{flag} {path}: no such file")
    if bool(src_valid) != bool(tgt_valid):
        raise QkvError("give both --src-valid and --tgt-valid (or neither: the lab holds out the last lines)")
    files = tuple(str(Path(p).absolute()) if p else "" for p in (src_train, tgt_train, src_valid, tgt_valid))
    return Task("files", f"your files: {Path(src_train).name} -> {Path(tgt_train).name}", "", tokenizer="bpe",
                vocab_size=2000, files=files)  # type: ignore[arg-type]


# --- architectures -----------------------------------------------------------------------------------

# What every lab run shares: small batches, validation (and a checkpoint) at update 25, then every 100
# (the first curve point within seconds of the first update), exact match on 200 validation sentences,
# no label smoothing (the tasks have one right answer).
TRAIN = dict(max_len=64, max_tokens=1024, label_smoothing=0.0, eval_every=100, first_eval=25,
             eval_bleu_samples=200, max_steps=100_000, schedule="inverse_sqrt", warmup_steps=100, device="cpu", seed=1)
RECURRENT = dict(d_model=128, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, bidirectional=True)
PRESETS: dict[str, tuple[dict, dict]] = {  # name -> (ModelConfig fields, TrainConfig fields)
    "transformer": (dict(arch="transformer", d_model=64, n_heads=4, d_ff=256, n_encoder_layers=2, n_decoder_layers=2,
                         dropout=0.0, attention_dropout=0.0, positional="sinusoidal", max_positions=256,
                         norm_first=False),
                    # 1e-3: on reverse, 99% exact at update 700-1,100 (2e-3: 1,400, its exact match swinging
                    # 61-96% on the way), so that the tour's four runs at once solve it in the time limit
                    dict(lr=1e-3)),
    # the decoders people run today (Llama, Qwen2, Mistral) are the paper's stack with switches: rotary
    # positions, pre-norm RMSNorm without bias, a SwiGLU FFN, grouped-query attention, no biases
    "llama-style": (dict(arch="transformer", d_model=64, n_heads=4, d_ff=256, n_encoder_layers=2, n_decoder_layers=2,
                         dropout=0.0, attention_dropout=0.0, positional="rotary", max_positions=256,
                         norm_first=True, norm="rmsnorm", norm_bias=False, ffn_gated=True, activation="silu",
                         n_kv_heads=2, qkv_bias=False, out_bias=False, ffn_bias=False),
                    dict(lr=2e-3)),
    "lstm+attention": (dict(arch="lstm", attention="additive", **RECURRENT), dict(lr=3e-3)),
    "lstm": (dict(arch="lstm", attention="none", **RECURRENT), dict(lr=3e-3)),
    "gru+attention": (dict(arch="gru", attention="additive", **RECURRENT), dict(lr=3e-3)),
    "gru": (dict(arch="gru", attention="none", **RECURRENT), dict(lr=3e-3)),
    "rnn+attention": (dict(arch="rnn", attention="additive", **RECURRENT), dict(lr=1e-3)),
    "rnn": (dict(arch="rnn", attention="none", **RECURRENT), dict(lr=1e-3)),
}
# the fields the page may set by hand, over the preset's
MODEL_FIELDS = ("arch", "attention", "d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers",
                "positional", "norm_first", "norm", "ffn_gated", "activation", "n_kv_heads", "dropout", "bidirectional")
TRAIN_FIELDS = ("schedule", "lr", "lr_scale", "warmup_steps", "max_steps", "max_time", "seed", "eval_every")
# the fields chosen from a list: qkv's own lists of legal values (norm_first: post-norm, the paper's, or pre-norm)
CHOICES: dict[str, tuple] = {"arch": ARCHS, "attention": ATTENTION_SCORES, "positional": POSITIONALS,
                             "schedule": SCHEDULES, "norm_first": (False, True), "norm": NORMS,
                             "ffn_gated": (False, True), "activation": ACTIVATIONS}
# The lab's bounds on a model's size, tighter than qkv's own (qkv.bounds): a run must fit beside the lab on
# a laptop. d_model = 10**9 passes qkv's checks only to die allocating tens of GB in the child.
SIZE_BOUNDS = {"d_model": whole(2, 1024), "n_heads": whole(1, 16), "d_ff": whole(1, 4096),
               "n_encoder_layers": whole(1, 8), "n_decoder_layers": whole(1, 8)}
MAX_PARAMETERS = 20_000_000  # about 320 MB with Adam's two moments, in float32
SOLVED = 0.99  # validation exact match at which a run that stops once solved stops


def settings(preset: str, model: dict | None = None, train: dict | None = None,
             kind: str = "translate") -> tuple[dict, dict]:
    """The model and training fields of a run of a ``kind`` of task (translate, classify, mlm, lm):
    ``preset``'s, then those set by hand, checked by the configs' own validation (a ConfigError names
    the field)."""
    if preset not in PRESETS:
        raise ConfigError(f"preset: unknown {preset!r}; choose one of {', '.join(PRESETS)}")
    model, train = dict(model or {}), dict(train or {})
    for given, allowed, what in ((model, MODEL_FIELDS, "model"), (train, TRAIN_FIELDS, "train")):
        wrong = sorted(set(given) - set(allowed))
        if wrong:
            raise ConfigError(f"{what}: {', '.join(wrong)} cannot be set here; the lab sets {', '.join(allowed)}")
    m, t = {**PRESETS[preset][0], **model}, {**TRAIN, **PRESETS[preset][1], **train}
    if kind != "translate":
        m["task"] = kind
        if kind == "classify" and m.get("arch", "transformer") != "transformer":
            m["pooling"] = "mean"  # a recurrent classifier has no <cls> state: the mean over the positions
    if t.get("schedule") == "noam" and "lr" not in train:
        t["lr"] = 0.0  # noam sets its own rate (d_model^-0.5 ... times lr_scale): not the preset's lr
    mc = override(ModelConfig(), m, "model")
    tc = override(TrainConfig(), t, "train")
    # the values as the configs read them ("64" -> 64, 1e9 -> 1000000000): what the run gets
    m = {k: getattr(mc, k) for k in m}
    t = {k: getattr(tc, k) for k in t}
    for name, bound in SIZE_BOUNDS.items():
        value = getattr(mc, name)
        if bound.problem(value):
            raise ConfigError(f"model.{name}: this lab takes {bound.text()} (so that a run fits this machine), "
                              f"got {value:,}")
    mc.validate()
    tc.validate()
    return m, t


def parameters(model: dict, vocab_size: int, n_classes: int = 0) -> int:
    """The parameters of the model of ``model``'s fields with a vocabulary of ``vocab_size`` (and a
    classifier's ``n_classes``), counted on the meta device: nothing is allocated."""
    import torch

    from qkv.info import parameter_breakdown
    from qkv.models import build_model

    cfg = dataclasses.replace(override(ModelConfig(), model, "model"), src_vocab_size=vocab_size,
                              tgt_vocab_size=vocab_size, n_classes=n_classes)
    with torch.device("meta"):
        return parameter_breakdown(build_model(cfg))["total"]


def counted(checkpoint: Path) -> int:
    """The parameters of the model a checkpoint holds (its config.json's, with the vocabularies its run
    built), counted on the meta device: what the run trains, where :func:`parameters` estimated it from
    the task's vocabulary bound before the run started."""
    import torch

    from qkv.checkpoint import read_config
    from qkv.info import parameter_breakdown
    from qkv.models import build_model

    cfg = read_config(checkpoint, "model")
    with torch.device("meta"):
        return parameter_breakdown(build_model(cfg))["total"]


def flags(fields: dict) -> list[str]:
    """``{"d_model": 64, "bidirectional": False}`` -> ``["--d-model", "64", "--no-bidirectional"]``."""
    out = []
    for name, value in fields.items():
        flag = name.replace("_", "-")
        out += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return out


# --- the runs ----------------------------------------------------------------------------------------

def write_whole(folder: Path, path: str, lines: list[str]) -> None:
    """``lines`` to ``path`` through a temporary file of its own in ``folder`` (another start, or another
    lab on the same root, may be writing the same file), renamed into place: never half a file."""
    fd, tmp = tempfile.mkstemp(prefix=Path(path).name + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def name_hue(name: str) -> int:
    """A hue (0-359) from a run's name alone (32-bit FNV-1a of its UTF-8 bytes): the colour of a run whose
    ``lab.json`` records none (the page computes the same)."""
    h = 0x811C9DC5
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h % 360


def pick_hue(name: str, taken: list[int]) -> int:
    """A new run's hue: the one farthest from every hue ``taken`` (ties: the lowest); the first run's from
    its name. Recorded in its ``lab.json``, so a run keeps its colour across reloads, restarts of the lab
    and the deletion of other runs."""
    if not taken:
        return name_hue(name)
    def gap(h: int) -> int:
        return min(min(abs(h - t) % 360, 360 - abs(h - t) % 360) for t in taken)
    return max(range(360), key=lambda h: (gap(h), -h))


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")
ENDED = "ended.json"  # in a run's directory: how it ended ({"status", "reason", "returncode", "ended"})


class Lab:
    """The runs under ``root``: started, stopped and read back. At most ``limits.max_runs`` train at once."""

    def __init__(self, root: str | Path = "lab-runs", limits: LabLimits | None = None, files: Task | None = None):
        self.root = Path(root)
        self.limits = (limits or LabLimits()).validate()
        self.tasks = {**TASKS, **({"files": files} if files else {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping: set[str] = set()
        # one lock around "is there room, is the name free" and the spawn: concurrent starts cannot
        # both pass the check, nor write the same data files
        self.lock = threading.Lock()
        # the lifeline: every run holds the read end of this pipe; the lab alone holds the write end,
        # which the kernel closes when the lab's process ends however it ends (kill -9 included), and
        # the run then stops (qkv.lab.child). No thread of the lab owns it, so none can end a run.
        self._lifeline: tuple[int, int] | None = None
        self.to_solve: dict[str, str] = {}  # runs to stop at their first validation score >= SOLVED: the score
        self.solved: dict[str, str] = {}  # runs so stopped -> what solved them ("valid_exact 99.5% at update 1200")
        self.ended: dict[str, dict] = {}  # runs of this lab that have ended -> their end record (ENDED)
        self.deleting: set[str] = set()
        self._settling = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._steps: dict[str, tuple[int, int]] = {}  # run -> (trainer_state.pt's mtime, its step)
        self._counted: dict[str, tuple[int, int]] = {}  # run -> (last/config.json's mtime, its parameters)
        self.zygote = None  # qkv.lab.zygote.Zygote once warm() is called: runs forked with torch imported

    def warm(self) -> None:
        """Start the zygote (:mod:`qkv.lab.zygote`) now, so that runs start with torch and the trainer
        imported already; its imports go on in the background. A dead one is replaced."""
        from qkv.lab.zygote import Zygote

        if self.zygote is None or not self.zygote.alive():
            self.zygote = Zygote(self.lifeline())
            # and this process's own first import of torch._dynamo (seconds), which counting a new run's
            # parameters on the meta device would otherwise pay at the first Start
            threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="lab-preload",
                             daemon=True).start()

    # --- data --------------------------------------------------------------------------------------

    def data(self, task: Task) -> list[str]:
        """``qkv train``'s data flags for ``task``: its files, written once under ``root/.data``."""
        folder = self.root / ".data" / task.name
        if task.kind != "translate":
            return self._one_sided(task, folder)
        names = ["src.train", "tgt.train", "src.valid", "tgt.valid"]
        if task.files and task.files[2]:
            paths = list(task.files)
        else:
            paths = [str((folder / n).absolute()) for n in names]
            if not all(Path(p).is_file() for p in paths):
                splits = self._split_files(task) if task.files else pairs_of(task.name)
                folder.mkdir(parents=True, exist_ok=True)
                for n, path in zip(names, paths):
                    side, split = n.split(".")
                    lines = [s if side == "src" else t for s, t in splits[split]]
                    # a temporary file of its own (another lab may share the root), renamed into place
                    write_whole(folder, path, lines)
        return [x for flag, p in zip(("--src-train", "--tgt-train", "--src-valid", "--tgt-valid"), paths)
                for x in (flag, p)]

    def _one_sided(self, task: Task, folder: Path) -> list[str]:
        """An encoder-only or decoder-only task's files: JSONL ``{"text", "label"}`` for a classifier,
        one text a line for a (masked) language model."""
        ext = "jsonl" if task.kind == "classify" else "txt"
        paths = [str((folder / f"{split}.{ext}").absolute()) for split in ("train", "valid")]
        if not all(Path(p).is_file() for p in paths):
            splits = pairs_of(task.name)
            folder.mkdir(parents=True, exist_ok=True)
            for split, path in zip(("train", "valid"), paths):
                lines = [json.dumps({"text": s, "label": t}) if task.kind == "classify" else s
                         for s, t in splits[split]]
                write_whole(folder, path, lines)
        return ["--train", paths[0], "--valid", paths[1]]

    @staticmethod
    def _split_files(task: Task) -> dict[str, list[tuple[str, str]]]:
        """Training files without validation ones: the last 5% of the pairs (1 to 500) held out."""
        from qkv.data.corpus import read_parallel

        text = read_parallel(*task.files[:2])  # a CorpusError names the file at fault
        pairs = list(zip(text.src, text.tgt))
        if len(pairs) < 2:
            raise LabError(422, f"{task.files[0]}: need at least 2 pairs (one held out for validation)")
        n = min(500, max(1, len(pairs) // 20))
        return {"train": pairs[:-n], "valid": pairs[-n:]}

    # --- starting and stopping ------------------------------------------------------------------------

    def running(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is None]

    def lifeline(self) -> int:
        """The read end of the lab's lifeline pipe, which each run inherits (see ``__init__``)."""
        if self._lifeline is None:
            self._lifeline = os.pipe()  # neither end inheritable: a run gets the read end by pass_fds only
        return self._lifeline[0]

    def close(self) -> None:
        """Close the lifeline: every run still holding it stops (SIGTERM), the zygote too."""
        if self._lifeline is not None:
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    def start(self, name: str, task: str, preset: str, model: dict | None = None, train: dict | None = None,
              threads: int | None = None, stop_when_solved: bool = True) -> dict:
        """Start ``qkv train`` for a new run ``name``; what :meth:`describe` says of it. Every field is
        checked before the lab's room (a 429 means the request was valid). ``stop_when_solved``: the lab
        stops the run at its first validation with an exact match of :data:`SOLVED` or more."""
        if not NAME.fullmatch(name or ""):
            raise LabError(422, f"name: {name!r} is not a run name (letters, digits, '.', '_', '-'; at most 40, "
                                f"not beginning with '.' or '-')")
        if task not in self.tasks:
            raise LabError(422, f"task: unknown {task!r}; this lab has {', '.join(self.tasks)}")
        threads = threads or self.limits.run_threads
        if not 1 <= threads <= self.limits.run_threads:
            raise LabError(422, f"threads must be in [1, {self.limits.run_threads}] (--run-threads), got {threads}")
        spec = self.tasks[task]
        try:
            m, t = settings(preset, model, train, spec.kind)
        except ConfigError as e:
            raise LabError(422, str(e)) from None
        if t.get("max_time", 0) > self.limits.max_time:
            raise LabError(422, f"train.max_time {t['max_time']:g} is more than this lab allows (--max-time "
                                f"{self.limits.max_time:g})")
        t["max_time"] = t.get("max_time") or self.limits.max_time
        labels = len({label for _, label in pairs_of(task)["train"]}) if spec.kind == "classify" else 0
        try:
            n = parameters(m, spec.vocab_size, labels)
        except ConfigError as e:  # no such model for the task (e.g. a recurrent masked LM)
            raise LabError(422, str(e)) from None
        if n > MAX_PARAMETERS:
            raise LabError(422, f"model: {n:,} parameters; this lab trains at most {MAX_PARAMETERS:,} (so that a "
                                f"run fits this machine): make d_model, d_ff or the layers smaller")
        t.update(tokenizer=spec.tokenizer, vocab_size=spec.vocab_size, threads=threads)
        out = self.root / name
        with self.lock:  # the check and the spawn as one: concurrent starts see each other
            if out.exists():
                raise LabError(409, f"a run named {name!r} exists already ({out}); choose another name")
            if len(self.running()) >= self.limits.max_runs:
                raise LabError(429, f"{self.limits.max_runs} runs are training already (the lab's bound, "
                                    f"--max-runs); stop one or wait for one to end")
            fd = self.lifeline()
            argv = [sys.executable, "-m", "qkv.lab.child", str(fd), "train", *self.data(spec), "--out", str(out),
                    "--preset", "tiny", *flags(m), *flags(t)]
            hue = pick_hue(name, [self.hue(other) for other in self.names()])
            out.mkdir(parents=True)
            record = {"name": name, "task": task, "preset": preset, "model": m, "train": t, "parameters": n,
                      "stop_when_solved": bool(stop_when_solved), "hue": hue, "started": time.time()}
            (out / "lab.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                   "PYTHONUNBUFFERED": "1"}
            src = str(Path(__file__).resolve().parents[2])  # this qkv, wherever the child's path would find another
            env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
            proc = None
            if self.zygote is not None:  # warm: forked from the zygote, torch imported already
                proc = self.zygote.spawn(argv[4:], env, out / "train.log")
                if proc is None:  # it could not: this run starts cold, and the next gets a new zygote
                    self.zygote.close()
                    self.warm()
            if proc is None:
                with open(out / "train.log", "wb") as log:
                    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(fd,))
            self.procs[name] = proc
            if stop_when_solved and spec.solved_by:
                self.to_solve[name] = spec.solved_by
            self._watch()
        return self.describe(name)

    def _watch(self) -> None:
        """The thread that stops runs once solved and records how each run ended (one, started with the
        first run)."""
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(target=self._watch_loop, name="lab-runs", daemon=True)
            self._watcher.start()

    def _watch_loop(self, every: float = 0.5) -> None:
        while True:
            time.sleep(every)
            for name, key in list(self.to_solve.items()):
                proc = self.procs.get(name)
                if proc is None or proc.poll() is not None:
                    self.to_solve.pop(name, None)
                    continue
                records = [r for r in self.metrics(name)["records"] if key in r]
                if records and records[-1][key] >= SOLVED:
                    last = records[-1]
                    self.to_solve.pop(name, None)
                    self.solved[name] = (f"{key.removeprefix('valid_')} {last[key]:.1%} at update {last.get('step', '?')}"
                                         f" (the lab stops a run at {SOLVED:.0%})")
                    self.stopping.add(name)
                    proc.send_signal(signal.SIGTERM)
            for name, proc in list(self.procs.items()):
                if proc.poll() is not None and name not in self.ended:
                    self._settle(name)

    # --- how a run ended ----------------------------------------------------------------------------

    def _end_of(self, name: str, rc: int) -> dict:
        """How the run ``name`` that exited with ``rc`` ended: solved, time limit, finished (its max_steps),
        stopped, or failed (a signal, or the error its log ends with), with the reason in words."""
        if name in self.solved:
            return {"status": "solved", "reason": self.solved[name]}
        if rc < 0:
            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = f"signal {-rc}"
            if name in self.stopping and -rc in (signal.SIGTERM, signal.SIGKILL):  # the lab's own signal
                return {"status": "stopped", "reason": f"stopped ({sig}) at update {self._last_step(name)}"}
            return {"status": "failed", "reason": f"killed by {sig} (signal {-rc})", "signal": sig}
        if name in self.stopping:
            return {"status": "stopped", "reason": f"stopped at update {self._last_step(name)}"}
        said = [line for line in self.log_tail(name, 40).splitlines() if line.strip()]
        end = next((line for line in reversed(said) if line.startswith("stopped: ")), None)
        if rc == 0 and end and "reached max_time=" in end:
            limit = end.split("reached max_time=", 1)[1].split(";", 1)[0]
            return {"status": "time limit", "reason": f"reached its time limit ({limit}) at update "
                                                      f"{self._last_step(name)}"}
        if rc == 0:
            return {"status": "finished", "reason": end.split(";", 1)[0].removeprefix("stopped: ") if end
                    else "exited"}
        error = next((line for line in reversed(said) if line.startswith("qkv ")), said[-1] if said else "")
        return {"status": "failed", "reason": f"exit status {rc}" + (f": {error}" if error else "")}

    def _last_step(self, name: str) -> int:
        steps = [r["step"] for r in self.metrics(name)["records"] if isinstance(r.get("step"), int)]
        return max(steps, default=0)

    def _settle(self, name: str) -> dict:
        """Record once how the ended run ``name`` ended: ``ENDED`` in its directory (what a later lab
        reads) and the same words as ``train.log``'s last line."""
        with self._settling:
            if name in self.ended:
                return self.ended[name]
            return self._record_end(name)

    def _record_end(self, name: str) -> dict:
        rc = self.procs[name].poll()
        record = {**self._end_of(name, rc), "returncode": rc, "ended": time.time()}
        self.ended[name] = record
        out = self.root / name
        if name in self.deleting or not out.is_dir():
            return record
        try:
            write_whole(out, str(out / ENDED), [json.dumps(record)])
            with open(out / "train.log", "a", encoding="utf-8") as log:
                log.write(f"qkv lab: {record['status']}: {record['reason']}\n")
        except OSError:
            pass
        return record

    def stop(self, name: str) -> dict:
        """Ask a training run to stop (SIGTERM: it commits ``last/`` at the next update and exits)."""
        self.run_dir(name)
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            raise LabError(409, f"run {name!r} is not training")
        self.stopping.add(name)
        proc.send_signal(signal.SIGTERM)
        return self.describe(name)

    def stop_all(self, timeout: float = 60) -> None:
        """Stop every run and wait for them (``timeout`` seconds, then kill what is left)."""
        for name in self.running():
            self.stopping.add(name)
            self.procs[name].send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for name in list(self.procs):
            if name not in self.ended:
                self._settle(name)
        self.close()

    def delete(self, name: str) -> dict:
        """Delete the run ``name``'s directory; refused (409) while it trains: stop it first."""
        out = self.run_dir(name)
        with self.lock:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                raise LabError(409, f"run {name!r} is training: stop it first, then delete it")
            self.deleting.add(name)
            try:
                shutil.rmtree(out)
            except OSError as e:
                raise LabError(500, f"could not delete {out}: {e.strerror or e}") from None
            finally:
                self.deleting.discard(name)
            for table in (self.procs, self.ended, self.solved, self.to_solve, self._steps, self._counted):
                table.pop(name, None)
            self.stopping.discard(name)
        return {"deleted": name}

    # --- reading back ----------------------------------------------------------------------------------

    def run_dir(self, name: str) -> Path:
        """The directory of run ``name``; a LabError (404) where there is no such run."""
        out = self.root / name
        if not NAME.fullmatch(name or "") or not (out / "lab.json").is_file():
            raise LabError(404, f"no run named {name!r} in {self.root}")
        return out

    def names(self) -> list[str]:
        """Every run of ``root`` (those an earlier lab started too), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if NAME.fullmatch(p.name) and (p / "lab.json").is_file()]
        return [p.name for p in sorted(found, key=lambda p: (p / "lab.json").stat().st_mtime)]

    def end(self, name: str) -> dict | None:
        """How the run ended (:meth:`_end_of`'s record), None while it trains; a run an earlier lab
        started: the record it left (``ENDED``), else what its log says."""
        proc = self.procs.get(name)
        if proc is not None:
            rc = proc.poll()
            if rc is None:
                return None
            return self.ended.get(name) or self._settle(name)
        try:
            return json.loads((self.root / name / ENDED).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
        said = self.log_tail(name, 40)
        if "reached max_time=" in said:
            return {"status": "time limit", "reason": "reached its time limit"}
        if "interrupted" in said:
            return {"status": "stopped", "reason": "stopped (the lab that ran it recorded no more)"}
        has = (self.root / name / "last").is_dir()
        return {"status": "saved" if has else "empty",
                "reason": "a checkpoint, no record of how it ended" if has else "no checkpoint"}

    def status(self, name: str) -> str:
        """training | stopping (runs training now); solved | time limit | finished | stopped | failed (how a
        run ended, kept in its directory across restarts of the lab); saved | empty (a run without that
        record). solved: stopped by the lab at a validation score of SOLVED or more; time limit: its
        max_time ended it; finished: its max_steps; failed: a signal or an error."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            return "stopping" if name in self.stopping else "training"
        return self.end(name)["status"]

    def describe(self, name: str) -> dict:
        out = self.run_dir(name)
        record = json.loads((out / "lab.json").read_text(encoding="utf-8"))
        status = self.status(name)
        record.update(status=status, dir=str(out), checkpoint=(out / "last").is_dir(), hue=self.hue(name))
        real = self.parameters(name) if record["checkpoint"] else None
        if real is not None:  # the model as built, with the vocabulary its run made (the start's was a bound)
            record.update(parameters=real, parameters_counted=True)
        end = None if status in ("training", "stopping") else self.end(name)
        if end:
            record["reason"] = end.get("reason", "")
        if status == "failed":
            record["error"] = self.log_tail(name)
        return record

    def parameters(self, name: str) -> int | None:
        """The run's model's parameters as its checkpoint has it (None before its first checkpoint)."""
        config = self.root / name / "last" / "config.json"
        try:
            stamp = config.stat().st_mtime_ns
        except OSError:
            return None
        cached = self._counted.get(name)
        if cached and cached[0] == stamp:
            return cached[1]
        try:
            n = counted(config.parent)
        except Exception:  # noqa: BLE001 - being replaced, or unreadable: the estimate stands
            return None
        self._counted[name] = (stamp, n)
        return n

    def hue(self, name: str) -> int:
        """The run's hue: its ``lab.json``'s, else :func:`name_hue`."""
        try:
            hue = json.loads((self.root / name / "lab.json").read_text(encoding="utf-8")).get("hue")
        except (OSError, ValueError, AttributeError):
            hue = None
        return hue if isinstance(hue, int) and not isinstance(hue, bool) and 0 <= hue < 360 else name_hue(name)

    def checkpoint_step(self, name: str) -> int | None:
        """The update at which the run's newest checkpoint (``last/``) was saved: a validation's, or the one
        at which a stop committed it (read from its trainer state; None where it has none)."""
        import torch

        path = self.run_dir(name) / "last" / "trainer_state.pt"
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            return None
        cached = self._steps.get(name)
        if cached and cached[0] == stamp:
            return cached[1]
        try:
            step = int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])  # tensors unread
        except Exception:  # noqa: BLE001 - being replaced as we read, or unreadable: say nothing
            return None
        self._steps[name] = (stamp, step)
        return step

    def log_tail(self, name: str, lines: int = 5) -> str:
        try:
            text = (self.run_dir(name) / "train.log").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def metrics(self, name: str, since: int = 0) -> dict:
        """The records of ``metrics.jsonl`` from the ``since``-th on (complete lines only) and the count so far."""
        path = self.run_dir(name) / "metrics.jsonl"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {"records": [], "next": 0}
        lines = text.split("\n")[:-1]  # a last line without its newline is still being written
        records = []
        for line in lines[since:]:
            try:
                records.append(json.loads(line))
            except ValueError:
                records.append({})  # keep the count: a line the page skips
        return {"records": records, "next": max(since, len(lines))}


def limits_from(args) -> LabLimits:
    return LabLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LabLimits)
                        if hasattr(args, f.name)}).validate()


__all__ = ["Lab", "LabLimits", "LabError", "Task", "TASKS", "PRESETS", "CHOICES", "SIZE_BOUNDS", "MAX_PARAMETERS",
           "SOLVED", "files_task", "settings", "parameters", "flags", "pairs_of", "name_hue", "pick_hue", "ENDED"]
