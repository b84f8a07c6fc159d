"""The ``qkv`` command end to end: train, translate, evaluate, info, and every bad input's message.

One tiny model is trained once per module (``run``) on a word-reversal task written to temporary
files; the other tests read its checkpoints (copies, where a test damages or extends a run).
The CLI runs in-process through ``qkv.cli.main`` (it returns the exit code), except where a
process of its own is the point: ``--help``, and signals (SIGTERM of a training run, Ctrl-C and
SIGTERM of ``qkv serve``).

A bad input must give exit status 2, one message on stderr naming the file (and line) or the
config field at fault, no traceback, and must not damage anything already written.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import random
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import qkv
from qkv.cli import main

WORDS = ["red", "blue", "cat", "dog", "sun", "tree"]
N_TRAIN = 200
EMPTY_LINES = (5, 17)  # 1-based lines of the training files with an empty side (skipped and reported)
MAX_STEPS = 30
FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"

TRAIN_FLAGS = [
    "--preset", "tiny", "--max-steps", str(MAX_STEPS), "--eval-every", str(MAX_STEPS), "--vocab-size", "60",
    "--tokenizer", "char", "--max-tokens", "512", "--eval-bleu-samples", "10",
]


# --- helpers -----------------------------------------------------------------------------------------

def reversal_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
        pairs.append((" ".join(words), " ".join(reversed(words))))
    return pairs


def write_lines(path: Path, lines: list[str], gz: bool = False) -> Path:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``qkv ARGV`` in-process; return (exit code, stdout, stderr)."""
    capsys.readouterr()  # drop anything printed before
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc: int, err: str, command: str, *needles: str) -> None:
    """Exit 2, one 'qkv COMMAND: error: ...' message naming each needle, no traceback."""
    assert rc == 2, err
    assert "Traceback" not in err
    assert f"qkv {command}: error:" in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``directory`` with its bytes and mtime, to show that nothing changed (the run
    directory's lock file, which each start takes, aside)."""
    return {p.relative_to(directory).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != ".lock"}


# --- the trained run ---------------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Train one tiny model (src plain, tgt gzip, with two empty lines) and keep what it printed."""
    d = tmp_path_factory.mktemp("cli")
    pairs = reversal_pairs(N_TRAIN, seed=0)
    src, tgt = [s for s, _ in pairs], [t for _, t in pairs]
    src[EMPTY_LINES[0] - 1] = ""  # an empty source line
    tgt[EMPTY_LINES[1] - 1] = "   "  # a blank target line
    valid = reversal_pairs(20, seed=1)
    files = types.SimpleNamespace(
        src_train=write_lines(d / "train.src", src),
        tgt_train=write_lines(d / "train.tgt.gz", tgt, gz=True),
        src_valid=write_lines(d / "valid.src", [s for s, _ in valid]),
        tgt_valid=write_lines(d / "valid.tgt", [t for _, t in valid]),
    )
    out = d / "run"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["train", "--src-train", str(files.src_train), "--tgt-train", str(files.tgt_train),
                   "--src-valid", str(files.src_valid), "--tgt-valid", str(files.tgt_valid),
                   *TRAIN_FLAGS, "--out", str(out)])
    return types.SimpleNamespace(dir=d, out=out, best=out / "best", files=files, rc=rc,
                                 stdout=stdout.getvalue(), stderr=stderr.getvalue(), valid=valid)


def data_argv(files, out: Path, *extra: str) -> list[str]:
    """``qkv train`` on the module's files into ``out``, with only the flags in ``extra``."""
    return ["train", "--src-train", files.src_train, "--tgt-train", files.tgt_train,
            "--src-valid", files.src_valid, "--tgt-valid", files.tgt_valid, "--out", out, *extra]


def train_argv(files, out: Path, *extra: str) -> list[str]:
    """The fixture's own training command line, plus ``extra``."""
    return data_argv(files, out, *TRAIN_FLAGS, *extra)


# --- round trips -------------------------------------------------------------------------------------

def test_train_writes_checkpoints_and_metrics(run):
    assert run.rc == 0, run.stderr
    assert "Traceback" not in run.stderr
    for name in ("best", "last"):
        assert (run.out / name / "manifest.json").is_file()
        assert (run.out / name / "model.safetensors").is_file()
    steps = [json.loads(line)["step"] for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == MAX_STEPS
    assert f"reached max_steps={MAX_STEPS}" in run.stderr


def test_train_skips_and_reports_empty_lines(run):
    assert run.rc == 0
    n_kept = N_TRAIN - len(EMPTY_LINES)
    assert (f"train.src/train.tgt.gz: {n_kept} pairs, skipped 2 empty "
            f"(lines {EMPTY_LINES[0]}, {EMPTY_LINES[1]})") in run.stderr


def test_translate_arguments(run, capsys):
    rc, out, err = cli(capsys, "translate", run.best, "red cat", "dog sun tree")
    assert rc == 0, err
    assert len(out.splitlines()) == 2
    assert out.endswith("\n")


def test_translate_texts_after_options_and_search_options(run, capsys):
    rc, expected, _ = cli(capsys, "translate", run.best, "red cat", "dog sun tree", "--beam-size", "3")
    assert rc == 0 and len(expected.splitlines()) == 2
    rc, out, err = cli(capsys, "translate", run.best, "--beam-size", "3", "red cat", "dog sun tree")
    assert rc == 0, err
    assert out == expected
    # fairseq's search: |Y|^alpha and early stopping are accepted; a wrong norm names the field
    rc, out, err = cli(capsys, "translate", run.best, "red cat", "--length-norm", "length", "--early-stopping")
    assert rc == 0 and len(out.splitlines()) == 1, err
    rc, _, err = cli(capsys, "translate", run.best, "red cat", "--length-norm", "fairseq")
    assert_user_error(rc, err, "translate", "length_norm", "gnmt or length")
    with pytest.raises(SystemExit):  # an unknown option is still an error
        cli(capsys, "translate", run.best, "red cat", "--beam-sise", "3")


def test_translate_file_keeps_line_count_and_empty_lines(run, capsys, tmp_path):
    lines = ["red cat", "", "dog", "   ", "sun tree blue", ""]
    inp = write_lines(tmp_path / "in.txt", lines)
    dst = tmp_path / "out.txt"
    rc, out, err = cli(capsys, "translate", run.best, "--input", inp, "--output", dst)
    assert rc == 0, err
    assert out == ""  # everything went to --output
    got = dst.read_text(encoding="utf-8").split("\n")
    assert got[-1] == ""  # every line ends with a newline
    got = got[:-1]
    assert len(got) == len(lines)
    for src_line, hyp in zip(lines, got):
        if not src_line.strip():
            assert hyp == ""


def test_translate_gzip_input(run, capsys, tmp_path):
    inp = write_lines(tmp_path / "in.txt.gz", ["red cat", "", "dog"], gz=True)
    rc, out, err = cli(capsys, "translate", run.best, "-i", inp)
    assert rc == 0, err
    assert len(out.splitlines()) == 3 and out.splitlines()[1] == ""


@pytest.mark.parametrize("dash", [False, True], ids=["no-input", "input-dash"])
def test_translate_stdin(run, capsys, monkeypatch, dash):
    rc, expected, _ = cli(capsys, "translate", run.best, "red cat", "dog")
    assert rc == 0
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(b"red cat\n\ndog\n")))
    rc, out, err = cli(capsys, "translate", run.best, *(["--input", "-"] if dash else []))
    assert rc == 0, err
    got = out.split("\n")
    assert got[-1] == "" and len(got[:-1]) == 3
    assert got[1] == ""
    assert [got[0], got[2]] == expected.splitlines()  # the same translations as from arguments


def test_translate_stdin_invalid_utf8(run, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(b"red\ncat \xff\n")))
    rc, _, err = cli(capsys, "translate", run.best)
    assert_user_error(rc, err, "translate", "<stdin>:2", "UTF-8")


def test_translate_nbest_format(run, capsys):
    rc, out, err = cli(capsys, "translate", run.best, "red cat", "dog", "--nbest", "2")
    assert rc == 0, err
    rows = [line.split("\t") for line in out.splitlines()]
    assert len(rows) == 4
    assert all(len(r) == 3 for r in rows)
    assert [int(r[0]) for r in rows] == [0, 0, 1, 1]
    scores = [float(r[1]) for r in rows]
    assert all(s <= 0 for s in scores)  # log-probabilities
    assert scores[0] >= scores[1] and scores[2] >= scores[3]  # best first
    for r in rows:
        assert r[1] == f"{float(r[1]):.4f}"


def test_translate_nbest_keeps_n_rows_for_an_empty_line(run, capsys):
    rc, out, err = cli(capsys, "translate", run.best, "red cat", "", "dog", "--nbest", "2")
    assert rc == 0, err
    rows = [line.split("\t") for line in out.splitlines()]
    assert [int(r[0]) for r in rows] == [0, 0, 1, 1, 2, 2]
    assert [r[2] for r in rows if r[0] == "1"] == ["", ""]


def test_evaluate_model(run, capsys, tmp_path):
    hyps = tmp_path / "hyps.txt"
    rc, out, err = cli(capsys, "evaluate", run.best, "--src", run.files.src_valid, "--ref", run.files.tgt_valid,
                       "--output", hyps)
    assert rc == 0, err
    bleu_line, convention_line, chrf_line, ter_line = out.splitlines()  # no language: one line asks for --lang
    assert bleu_line.startswith("sacreBLEU (cased, detokenized): BLEU = ")
    assert "sacreBLEU signature:" in bleu_line and "tok:13a" in bleu_line
    # the reference file has no language suffix: the lowercased Moses BLEU asks for --lang
    assert "--lang" in convention_line
    assert chrf_line.startswith("chrF2 = ") and "sacreBLEU signature:" in chrf_line
    assert ter_line.startswith("TER = ") and "tok:tercom" in ter_line
    assert len(hyps.read_text(encoding="utf-8").splitlines()) == len(run.valid)


def test_evaluate_identical_files_is_100(capsys, tmp_path):
    lines = ["The cat sat on the mat.", "A dog, a tree; the sun!", "Guten Morgen."]
    hyp = write_lines(tmp_path / "hyp.txt", lines)
    ref = write_lines(tmp_path / "ref.txt", lines)
    rc, out, err = cli(capsys, "evaluate", "--hyp", hyp, "--ref", ref, "--lang", "en")
    assert rc == 0, err
    sacre, moses, wmt, chrf, ter = out.splitlines()
    assert sacre.startswith("sacreBLEU (cased, detokenized): BLEU = 100.00 ") and "tok:13a" in sacre
    assert moses.startswith("Multi30k convention (lowercased, punctuation-normalized, Moses-tokenized -l en): "
                            "BLEU = 100.00 ")
    assert "case:lc" in moses and "tok:lc.norm.tok-en" in moses
    assert wmt.startswith("WMT convention (cased, Moses-tokenized -l en, compounds split ##AT##-##AT##; the "
                          "Transformer paper's): BLEU = 100.00 ") and "tok:moses-en+compound-split" in wmt
    assert chrf.startswith("chrF2 = 100.00 ")
    assert ter.startswith("TER = 0.00 ")  # no edit


def test_evaluate_names_both_conventions_and_infers_the_language(capsys, tmp_path):
    hyp = write_lines(tmp_path / "hyp.de", ["Ein Mann fährt ein Fahrrad."])
    ref = write_lines(tmp_path / "ref.de", ["ein mann fährt ein fahrrad ."])
    rc, out, err = cli(capsys, "evaluate", "--hyp", hyp, "--ref", ref)
    assert rc == 0, err
    sacre, moses, wmt, _, _ = out.splitlines()
    assert "-l de" in moses and "BLEU = 100.00" in moses  # lowercased + tokenized: identical
    assert "-l de" in wmt and "BLEU = 100.00" not in wmt  # cased: not identical
    assert "BLEU = 100.00" not in sacre  # cased, detokenized: not identical


def test_info_base_preset(capsys):
    rc, out, err = cli(capsys, "info", "--preset", "base", "--vocab-size", "37000")
    assert rc == 0, err
    assert "63,082,496" in out
    assert "FLOPs" in out


def test_info_checkpoint(run, capsys):
    rc, out, err = cli(capsys, "info", run.best)
    assert rc == 0, err
    n = sum(p.numel() for p in qkv.load(run.best).model.parameters())  # shared matrices once
    total = next(line for line in out.splitlines() if line.strip().startswith("total"))
    assert f"{n:,}" in total
    assert "FLOPs" in out


def test_python_api_matches_cli(run, capsys):
    sentences = ["red cat", "dog", "sun tree blue"]
    hyps = qkv.load(run.best).translate(sentences)
    assert isinstance(hyps, list) and len(hyps) == len(sentences)
    assert all(isinstance(h, str) for h in hyps)
    rc, out, _ = cli(capsys, "translate", run.best, *sentences)
    assert rc == 0 and out.splitlines() == hyps


def test_help_in_subprocess():
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "200"}  # no wrapping inside phrases
    p = subprocess.run([sys.executable, "-m", "qkv", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    for command in ("train", "translate", "evaluate", "info"):
        assert command in p.stdout
    script = shutil.which("qkv", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    cmd = [script] if script else [sys.executable, "-m", "qkv"]
    p = subprocess.run([*cmd, "train", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    for option in ("--src-train", "--tgt-train", "--resume", "--max-steps", "--d-model", "--n-heads", "--beam-size"):
        assert option in p.stdout
    assert "token budget per batch" in p.stdout  # options are explained, not just listed


@pytest.mark.parametrize("command", [["train"], ["generate"], ["bench", "layers"], ["bench", "long-range"]])
def test_help_shows_each_default_once_and_never_none(command, capsys):
    """Options whose default is None say in words what happens without them ("or the preset's"), so
    argparse's "(default: None)" would only confuse; a default the help already names is not repeated."""
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's wrapping
    assert "(default: None)" not in out
    if command == ["train"]:
        default = "(default: 256 on given data (preset small), 128 on the embedded task)"  # what a run gets
        assert out.count(default) == 1 and f"{default} (default" not in out  # --d-model, shown once
    if command == ["bench", "layers"]:
        assert "representation dimension d (default: 512)" in out  # plain defaults are still shown


# --- the command line as git and pip behave ------------------------------------------------------------

def parsers(parser):
    """``parser`` and every command's and subcommand's parser under it."""
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


def no_command_runs(monkeypatch) -> list:
    """Every command's handler replaced by one that records its call (a parse that should fail runs nothing)."""
    from qkv.cli import COMMANDS

    called = []
    for name in COMMANDS:
        monkeypatch.setattr(f"qkv.cli.cmd_{name}", lambda args: called.append(args) or 0)
    return called


def usage_error(capsys, *argv: str) -> str:
    """``qkv ARGV`` stops in the parser with exit status 2; its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_version_is_the_package_version(capsys):
    import tomllib

    version = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"qkv {version}\n"


def test_qkv_alone_lists_the_commands_and_exits_1(capsys, monkeypatch):
    """As git: no command is a mistake (status 1, not 2: nothing was wrong with what was given), and the
    answer is the list of commands, a line each, and how to get a command's help."""
    from qkv.cli import COMMANDS

    monkeypatch.setenv("COLUMNS", "200")
    rc, out, _ = cli(capsys)
    assert rc == 1
    described = {line.split()[0] for line in out.splitlines() if len(line.split()) > 2 and line.startswith("    ")}
    assert described >= set(COMMANDS)
    assert "qkv COMMAND --help" in out


def test_abbreviated_flags_are_refused(capsys, monkeypatch):
    """argparse would take --max-step for --max-steps and --beam for --beam-size: a typo must not start a run."""
    from qkv.cli import COMMANDS
    from qkv.cli_options import build_parser

    called = no_command_runs(monkeypatch)
    for argv in (["train", "--max-step", "5"], ["translate", "M", "--beam", "1", "a b"], ["bench", "layers", "--quic"],
                 ["info", "--d-mod", "64"]):
        usage_error(capsys, *argv)
    assert called == []
    assert all(p.allow_abbrev is False for p in parsers(build_parser({name: None for name in COMMANDS})))


@pytest.mark.parametrize("argv, prog, unknown, suggestion", [
    (["train", "--max-step", "5"], "qkv train", "--max-step 5", "--max-steps"),
    (["translate", "M", "--beam", "1", "a b"], "qkv translate", "--beam 1 a b", "--beam-size"),
    (["bench", "layers", "--nmax=64"], "qkv bench layers", "--nmax=64", "--n-max"),
])
def test_an_unknown_flag_is_reported_by_its_command_with_the_nearest_flag(argv, prog, unknown, suggestion, capsys,
                                                                          monkeypatch):
    no_command_runs(monkeypatch)
    err = usage_error(capsys, *argv)
    assert err.startswith(f"usage: {prog} [-h]")  # the command's own usage, not the top parser's
    assert f"{prog}: error: unrecognized arguments: {unknown} (did you mean {suggestion}?)" in err


def test_an_unknown_flag_far_from_any_says_no_more(capsys, monkeypatch):
    no_command_runs(monkeypatch)
    err = usage_error(capsys, "train", "--xyzzy")
    assert err.splitlines()[-1] == "qkv train: error: unrecognized arguments: --xyzzy"


@pytest.mark.parametrize("argv, prog, wrong, suggestion", [
    (["trian"], "qkv", "trian", "train"),
    (["evalute", "--hyp", "h"], "qkv", "evalute", "evaluate"),
    (["bench", "layer"], "qkv bench", "layer", "layers"),
    (["export", "M", "--format", "ctranslate", "--out", "o"], "qkv export", "ctranslate", "ctranslate2"),
])
def test_an_unknown_command_or_choice_suggests_the_nearest(argv, prog, wrong, suggestion, capsys, monkeypatch):
    no_command_runs(monkeypatch)
    err = usage_error(capsys, *argv)
    assert f"{prog}: error: " in err and f"invalid choice: '{wrong}' (did you mean '{suggestion}'?" in err


def test_a_bad_preset_is_one_line(capsys, monkeypatch):
    called = no_command_runs(monkeypatch)
    for command in ("train", "info"):
        rc, out, err = cli(capsys, command, "--preset", "hgue")
        assert rc == 2 and out == ""
        assert err == f"qkv {command}: error: --preset: unknown preset 'hgue' (choose from tiny, small, base, big)\n"
    assert called == []
    rc, _, _ = cli(capsys, "train", "--preset", "base")
    assert rc == 0 and called[0].preset == "base"


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_serve_stops_on_a_signal_without_a_traceback(signame):
    """Ctrl-C or SIGTERM (kill, a service manager) of ``qkv serve``: exit status 130 as for an interrupted
    training run, one line, no traceback (uvicorn's own shutdown lines may come first)."""
    import re
    import signal
    import time

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "serve", str(FIXTURES / "translate-transformer"),
                             "--host", "127.0.0.1", "--port", "0", "--threads", "1"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines, url, deadline = [], None, time.monotonic() + 120
        while url is None and time.monotonic() < deadline and (line := proc.stderr.readline()):
            lines.append(line)
            url = m.group(1) if (m := re.search(r"on (http://127\.0\.0\.1:\d+)/", line)) else None
        assert url, "".join(lines)
        while httpx.get(url + "/health", timeout=30).status_code != 200:  # answering
            time.sleep(0.2)
        proc.send_signal(getattr(signal, signame))
        err = "".join(lines) + proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "qkv serve: interrupted"


# --- bad input: training data ------------------------------------------------------------------------

def test_train_missing_file(run, capsys, tmp_path):
    missing = tmp_path / "nope.src"
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "train", "--src-train", missing, "--tgt-train", run.files.tgt_train, *TRAIN_FLAGS,
                     "--out", out)
    assert_user_error(rc, err, "train", str(missing), "no such file")
    assert not out.exists()


def test_train_mismatched_line_counts(run, capsys, tmp_path):
    src = write_lines(tmp_path / "a.src", ["red", "cat", "dog"])
    tgt = write_lines(tmp_path / "a.tgt", ["red", "cat"])
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "train", "--src-train", src, "--tgt-train", tgt, *TRAIN_FLAGS, "--out", out)
    assert_user_error(rc, err, "train", f"{src} has 3 lines", f"{tgt} has 2 lines")
    assert not out.exists()


def test_train_invalid_utf8(capsys, tmp_path):
    src = tmp_path / "bad.src"
    src.write_bytes(b"red\ncat\ndog \xff\xfe sun\ntree\n")
    tgt = write_lines(tmp_path / "ok.tgt", ["red", "cat", "sun dog", "tree"])
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "train", "--src-train", src, "--tgt-train", tgt, *TRAIN_FLAGS, "--out", out)
    assert_user_error(rc, err, "train", f"{src}:3:", "invalid UTF-8")
    assert not out.exists()


def test_train_line_over_cap(capsys, tmp_path):
    src = write_lines(tmp_path / "long.src", ["red", "a" * 100_001, "dog"])
    tgt = write_lines(tmp_path / "ok.tgt", ["red", "cat", "dog"])
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "train", "--src-train", src, "--tgt-train", tgt, *TRAIN_FLAGS, "--out", out)
    assert_user_error(rc, err, "train", f"{src}:2:", "100001 characters", "100000")
    assert not out.exists()


def test_train_src_without_tgt(run, capsys, tmp_path):
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "train", "--src-train", run.files.src_train, *TRAIN_FLAGS, "--out", out)
    assert_user_error(rc, err, "train", "--src-train", "--tgt-train")
    assert not out.exists()


# --- bad input: configuration ------------------------------------------------------------------------

def test_train_heads_do_not_divide_d_model(run, capsys, tmp_path):
    out = tmp_path / "out"
    rc, _, err = cli(capsys, *train_argv(run.files, out, "--d-model", "32", "--n-heads", "5"))
    assert_user_error(rc, err, "train", "n_heads", "d_model=32", "n_heads=5")
    assert not out.exists()


def test_train_config_unknown_field(run, capsys, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('preset = "tiny"\n[model]\nd_model = 32\nd_modle = 64\n', encoding="utf-8")
    out = tmp_path / "out"
    rc, _, err = cli(capsys, *train_argv(run.files, out, "--config", cfg))
    assert_user_error(rc, err, "train", str(cfg), "d_modle", "[model]")
    assert not out.exists()


def test_train_config_syntax_error(run, capsys, tmp_path):
    cfg = tmp_path / "broken.toml"
    cfg.write_text("[model\nd_model = 32\n", encoding="utf-8")
    out = tmp_path / "out"
    rc, _, err = cli(capsys, *train_argv(run.files, out, "--config", cfg))
    assert_user_error(rc, err, "train", str(cfg), "TOML")
    assert not out.exists()


def test_train_config_section_not_a_table(run, capsys, tmp_path):
    cfg = tmp_path / "flat.toml"
    cfg.write_text("model = 3\n", encoding="utf-8")
    out = tmp_path / "out"
    rc, _, err = cli(capsys, *train_argv(run.files, out, "--config", cfg))
    assert_user_error(rc, err, "train", str(cfg), "model")


# --- bad input: checkpoints --------------------------------------------------------------------------

def test_translate_truncated_weights(run, capsys, tmp_path):
    ckpt = shutil.copytree(run.best, tmp_path / "best")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    dst = tmp_path / "out.txt"
    dst.write_text("previous translations\n", encoding="utf-8")
    rc, out, err = cli(capsys, "translate", ckpt, "red cat", "--output", dst)
    assert_user_error(rc, err, "translate", "corrupt", "model.safetensors", str(ckpt))
    assert out == ""
    assert dst.read_text(encoding="utf-8") == "previous translations\n"


def test_translate_without_manifest(run, capsys, tmp_path):
    ckpt = shutil.copytree(run.best, tmp_path / "best")
    (ckpt / "manifest.json").unlink()
    rc, _, err = cli(capsys, "translate", ckpt, "red cat")
    assert_user_error(rc, err, "translate", "incomplete", str(ckpt), "manifest.json")


def test_translate_nonexistent_model(capsys, tmp_path):
    missing = tmp_path / "no-such-run" / "best"
    rc, _, err = cli(capsys, "translate", missing, "red cat")
    assert_user_error(rc, err, "translate", str(missing), "not found")


def test_evaluate_corrupt_checkpoint(run, capsys, tmp_path):
    ckpt = shutil.copytree(run.best, tmp_path / "best")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    rc, _, err = cli(capsys, "evaluate", ckpt, "--src", run.files.src_valid, "--ref", run.files.tgt_valid)
    assert_user_error(rc, err, "evaluate", "corrupt", "model.safetensors")


# --- bad input: runs and resuming --------------------------------------------------------------------

def test_resume_nonexistent_run(run, capsys, tmp_path):
    out = tmp_path / "never-trained"
    rc, _, err = cli(capsys, *train_argv(run.files, out, "--resume"))
    assert_user_error(rc, err, "train", str(out / "last"))
    assert "not found" in err or "does not exist" in err
    assert not out.exists()


def test_train_into_existing_run_refused(run, capsys, tmp_path):
    out = shutil.copytree(run.out, tmp_path / "run")
    before = snapshot(out)
    rc, _, err = cli(capsys, *train_argv(run.files, out))
    assert_user_error(rc, err, "train", str(out), "already holds a run", "--resume")
    assert snapshot(out) == before


def test_resume_raises_max_steps(run, capsys, tmp_path):
    out = shutil.copytree(run.out, tmp_path / "run")
    new_max = MAX_STEPS + 10
    rc, _, err = cli(capsys, *data_argv(run.files, out, "--resume", "--max-steps", str(new_max), "--patience", "5"))
    assert rc == 0, err
    assert f"resuming from {out / 'last'} at step {MAX_STEPS}" in err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[: len(steps) - 1] == [json.loads(line)["step"]
                                       for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == steps[-1] == new_max  # appended, continuing from the old records
    config = json.loads((out / "last" / "config.json").read_text())
    assert config["train"]["max_steps"] == new_max
    assert config["train"]["patience"] == 5  # early stopping may be turned on for a running run
    assert config["model"]["d_model"] == 32  # the run's own model


def test_resume_takes_raised_limits_from_the_config_file(run, capsys, tmp_path):
    """A recipe raises max_steps in its TOML and resumes: the file's limits apply, its model must match."""
    out = shutil.copytree(run.out, tmp_path / "run")
    new_max = MAX_STEPS + 6
    config = tmp_path / "run.toml"
    config.write_text(f"[train]\nmax_steps = {new_max}\n")
    rc, _, err = cli(capsys, *data_argv(run.files, out, "--resume", "--config", config))
    assert rc == 0, err
    assert json.loads((out / "last" / "config.json").read_text())["train"]["max_steps"] == new_max
    before = snapshot(out)
    config.write_text(f"[train]\nmax_steps = {new_max + 6}\n[model]\nd_model = 64\n")
    rc, _, err = cli(capsys, *data_argv(run.files, out, "--resume", "--config", config))
    assert_user_error(rc, err, "train", str(config), "[model] d_model", "cannot change")
    assert snapshot(out) == before


def test_resume_refuses_model_flags(run, capsys, tmp_path):
    out = shutil.copytree(run.out, tmp_path / "run")
    before = snapshot(out)
    rc, _, err = cli(capsys, *data_argv(run.files, out, "--resume", "--max-steps", "40", "--d-model", "64"))
    assert_user_error(rc, err, "train", "--resume", "--d-model", "cannot change")
    assert snapshot(out) == before


def test_resume_refuses_an_update_freq_that_changes_the_update_size(run, capsys, tmp_path):
    """One process before and after: --update-freq cannot change (it may only keep update_freq x processes)."""
    out = shutil.copytree(run.out, tmp_path / "run")
    before = snapshot(out)
    rc, _, err = cli(capsys, *data_argv(run.files, out, "--resume", "--max-steps", "40", "--update-freq", "3"))
    assert_user_error(rc, err, "train", "--update-freq 3 with 1 process(es) makes an update of 3 batches",
                      "(give --update-freq 1)")
    assert snapshot(out) == before


def test_resume_accepts_unchanged_flags(run, capsys, tmp_path):
    out = shutil.copytree(run.out, tmp_path / "run")
    rc, _, err = cli(capsys, *train_argv(run.files, out, "--resume", "--max-steps", str(MAX_STEPS)))
    assert rc == 0, err


def test_resume_without_data_refused(run, capsys, tmp_path, monkeypatch):
    import qkv.training.run as run_module

    called = []

    def fake_train(model_cfg, train_cfg, decode_cfg, train_data, *args, **kwargs):
        called.append(train_data.name)
        return None

    monkeypatch.setattr(run_module, "train", fake_train)
    rc, _, err = cli(capsys, "train", "--out", run.out, "--resume", "--max-steps", "40")
    assert called == []  # never trained on something else than the run's data
    assert_user_error(rc, err, "train", "--src-train")


# --- bad input: translate and evaluate files ---------------------------------------------------------

def test_translate_input_invalid_utf8(run, capsys, tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_bytes(b"red cat\ndog\n\nsun \xc3\x28 tree\n")
    dst = tmp_path / "out.txt"
    dst.write_text("previous translations\n", encoding="utf-8")
    rc, out, err = cli(capsys, "translate", run.best, "--input", inp, "--output", dst)
    assert_user_error(rc, err, "translate", f"{inp}:4:", "invalid UTF-8")
    assert out == ""
    assert dst.read_text(encoding="utf-8") == "previous translations\n"


def test_translate_bad_decode_flag_keeps_output(run, capsys, tmp_path):
    inp = write_lines(tmp_path / "in.txt", ["red cat"])
    dst = tmp_path / "out.txt"
    dst.write_text("previous translations\n", encoding="utf-8")
    rc, _, err = cli(capsys, "translate", run.best, "--input", inp, "--output", dst, "--nbest", "8")
    assert_user_error(rc, err, "translate", "nbest")
    assert dst.read_text(encoding="utf-8") == "previous translations\n"


def test_translate_stdin_splits_lines_like_files(run, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO("red\u2028cat\ndog\n".encode())))
    rc, out, err = cli(capsys, "translate", run.best)
    assert rc == 0, err
    assert out.count("\n") == 2


def test_evaluate_hyp_line_count_mismatch(capsys, tmp_path):
    hyp = write_lines(tmp_path / "hyp.txt", ["a", "b", "c"])
    ref = write_lines(tmp_path / "ref.txt", ["a", "b", "c", "d", "e"])
    rc, out, err = cli(capsys, "evaluate", "--hyp", hyp, "--ref", ref)
    assert_user_error(rc, err, "evaluate", f"{hyp} has 3 lines", f"{ref} has 5")
    assert out == ""


def test_evaluate_missing_reference(capsys, tmp_path):
    hyp = write_lines(tmp_path / "hyp.txt", ["a"])
    ref = tmp_path / "missing.ref"
    rc, _, err = cli(capsys, "evaluate", "--hyp", hyp, "--ref", ref)
    assert_user_error(rc, err, "evaluate", str(ref), "no such file")


def test_sigterm_saves_last_and_the_run_resumes(run, tmp_path):
    """``kill`` (or a scheduler's preemption) stops training as Ctrl-C does: last/ first, then exit 130."""
    import signal
    import time

    from qkv.checkpoint import read_checkpoint

    out = tmp_path / "run"
    argv = [str(a) for a in data_argv(run.files, out, "--preset", "tiny", "--tokenizer", "char", "--vocab-size", "60",
                                      "--max-tokens", "512", "--max-steps", "100000", "--eval-every", "100000",
                                      "--threads", "1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qkv", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:  # step 1 is recorded: training
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted at step" in err and "saving" in err, err
    state = read_checkpoint(out / "last", need_trainer_state=True).trainer_state
    assert state["step"] >= 1
    rc = main([str(a) for a in data_argv(run.files, out, "--resume", "--max-steps", str(state["step"] + 2))])
    assert rc == 0
    assert read_checkpoint(out / "last", need_trainer_state=True).trainer_state["step"] == state["step"] + 2
