"""Every number a command or a config file takes is bounded (:mod:`qkv.bounds`): a value that could
only be a mistake or would overflow is refused as it is read, in one line naming the option, with
exit status 2, before any work (nothing written); ``--help`` says each bound; invalid UTF-8 in an
argument is refused as invalid UTF-8 in a file is.

The property test walks the parser itself, so an option added later without a bound, or with one
that lets a huge, negative or non-finite value through, fails it. The values the bounds must stop
(huge, negative, non-finite) are fixed here, not read from the bounds; a tiny value is allowed
exactly where the declared bound allows it, and then reaches the command unchanged.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import pytest

import qkv.cli
from qkv.bounds import Bound
from qkv.cli import COMMANDS, main
from qkv.cli_options import Number, build_parser
from qkv.config import SECTIONS, DecodeConfig, ModelConfig, TrainConfig

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
MT, LM = FIXTURES / "translate-transformer", FIXTURES / "lm-transformer"

# what each command needs besides the option under test to be parsed (no file is read before a bound)
REQUIRED = {
    "train": [], "preprocess": ["--src-train", "a", "--tgt-train", "b", "--out", "data"], "translate": ["M", "text"],
    "score": ["M", "--src", "a", "--tgt", "b"], "evaluate": ["M"], "generate": ["M"], "classify": ["M", "text"],
    "fill": ["M", "a [MASK]"], "embed": ["M", "--input", "a", "--output", "v.npy"], "search": ["M", "q", "--corpus", "c"],
    "average": ["a", "b", "--out", "avg"], "info": [], "viz positional": [], "viz schedule": [],
    "bench layers": [], "bench long-range": [], "export": ["M", "--format", "hf", "--out", "exported"],
    "serve": ["M"], "lab": [],
}


def numeric_options() -> list[tuple[str, str, argparse.Action]]:
    """(command, flag, action) of every option of every command whose value is a number, found by
    walking the parser (a number without a bound makes build_parser fail)."""
    found = []

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{command} {name}".strip())
            elif isinstance(action.type, Number):
                found.append((command, max(action.option_strings, key=len), action))
            else:
                assert action.type not in (int, float), (command, action.option_strings)

    walk(build_parser({c: None for c in COMMANDS}), "")
    return found


OPTIONS = numeric_options()


def test_every_numeric_option_is_found_and_bounded_below_overflow():
    """The walk finds the options the issue named, every bound is finite with nothing negative in it, and
    the bounds of whole numbers stop before torch's 64-bit limits (huge values can only be mistakes)."""
    flags = {(c, f) for c, f, _ in OPTIONS}
    for named in [("translate", "--length-penalty"), ("generate", "--temperature"), ("train", "--lr-scale"),
                  ("train", "--weight-decay"), ("train", "--length-penalty"), ("train", "--vocab-size"),
                  ("train", "--d-model"), ("train", "--n-encoder-layers"), ("serve", "--length-penalty"),
                  ("serve", "--beam-size"), ("serve", "--body-timeout"), ("preprocess", "--vocab-size"),
                  ("bench layers", "--n-max"), ("viz schedule", "--steps"), ("lab", "--max-runs")]:
        assert named in flags, named
    assert len(OPTIONS) > 120
    for command, flag, action in OPTIONS:
        b: Bound = action.type.bound
        assert 0 <= b.low <= b.high < 2**63 and math.isfinite(b.high), (command, flag, b)
        assert action.type.flag == flag
        assert f"(allowed: {b.text()})" in action.help, (command, flag, action.help)
        if action.default is not None:  # the default is within its own bound
            assert b.problem(action.default) is None, (command, flag, action.default)


def values_for(kind: type) -> dict[str, str]:
    """The values the property test feeds: what must always be refused, and the tiny one."""
    huge = [str(10**30), "1e12", "12345678901234567890123"] if kind is int else ["1e300", "1e39", "1e12"]
    return {"huge": huge, "negative": ["-1", "-1e300", str(-10**30)], "non-finite": ["nan", "inf", "-inf", "x"],
            "tiny": ["0"] if kind is int else ["1e-300", "5e-324"]}


def cases():
    for command, flag, action in OPTIONS:
        for group, values in values_for(action.type.bound.kind).items():
            for value in values:
                yield pytest.param(command, flag, action, group, value, id=f"{command}{flag}={value}")


RAN: list[argparse.Namespace] = []  # what the commands of the parser below were called with


@pytest.fixture(scope="module")
def recording_parser():
    """qkv's parser with every command replaced by one that records its arguments (built once: main()
    builds its own at every call)."""
    return build_parser({name: lambda args: RAN.append(args) or 0 for name in COMMANDS})


@pytest.mark.parametrize("command, flag, action, group, value", list(cases()))
def test_every_number_of_every_command_is_bounded(command, flag, action, group, value, recording_parser,
                                                  monkeypatch, capsys, tmp_path):
    """Huge, negative and non-finite values (and what is not a number) are refused in one line naming the
    option, exit status 2, the command never runs and nothing is written; a tiny value is refused where
    its declared bound starts above it, else it reaches the command as given."""
    RAN.clear()
    ran = RAN
    monkeypatch.setattr(qkv.cli, "build_parser", lambda handlers: recording_parser)
    monkeypatch.chdir(tmp_path)
    argv = [*command.split(), *REQUIRED[command], f"{flag}={value}"]
    rc = main(argv)
    out, err = capsys.readouterr()
    bound: Bound = action.type.bound
    parsed = None
    if group == "tiny":
        parsed = float(value) if bound.kind is float else int(value)
    if group == "tiny" and bound.problem(parsed) is None:
        assert rc == 0 and not err and len(ran) == 1, (argv, err)
        assert getattr(ran[0], action.dest) == parsed
        return
    assert rc == 2, (argv, rc, err)
    assert not ran and out == "" and list(tmp_path.iterdir()) == []
    assert err.count("\n") == 1 and err.startswith(f"qkv {command.split()[0]}: error: {flag} must be "), err
    assert "Traceback" not in err


def test_a_value_is_refused_with_or_without_the_equals_sign(capsys):
    """A negative number, an exponent or -inf after the flag is that flag's value, not taken for a flag
    of its own (argparse's usage message would say 'expected one argument')."""
    for value in ("-1e300", "-5", "-0.5", "-inf", "-nan", "-1E3"):
        assert main(["bench", "long-range", "--lr", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("qkv bench: error: --lr must be a ") and "number from 0 to 10, got " in err, err
        assert err.count("\n") == 1


def config_cases():
    for section, cls in zip(SECTIONS, (ModelConfig, TrainConfig, DecodeConfig)):
        for f in cls.__dataclass_fields__.values():
            if f.metadata.get("bound") is not None and not f.metadata.get("hidden"):
                huge = "1e300" if f.metadata["bound"].kind is float else str(10**30)
                for value in (huge, "-1e300" if f.metadata["bound"].kind is float else "-1", "nan"):
                    if value == "nan" and f.metadata["bound"].kind is int:
                        continue
                    yield pytest.param(section, f.name, value, id=f"{section}.{f.name}={value}")


@pytest.mark.parametrize("section, field, value", list(config_cases()))
def test_config_file_values_meet_the_same_bounds(section, field, value, capsys, tmp_path):
    """A --config TOML file does not pass argparse: its numbers meet the same bounds in validate(),
    refused by the field's name before anything is trained (the run directory is not left behind)."""
    toml = tmp_path / "c.toml"
    toml.write_text(f"[{section}]\n{field} = {value}\n", encoding="utf-8")
    rc = main(["train", "--config", str(toml), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"'{field}': must be " in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, needle", [
    (["translate", MT, "red cat", "--length-penalty", "1000"], "--length-penalty must be a number from 0 to 10"),
    (["generate", LM, "--temperature", "1e39"], "--temperature must be 0 or a number from 1e-06 to 100"),
    (["train", "--lr-scale", "1e300"], "--lr-scale must be a number from 0 to 100"),
    (["train", "--weight-decay", "1e300"], "--weight-decay must be a number from 0 to 10"),
    (["train", "--length-penalty", "1e300"], "--length-penalty must be a number from 0 to 10"),
    (["train", "--vocab-size", str(10**12)], "--vocab-size must be a whole number from 1 to 1,000,000"),
    (["train", "--d-model", str(10**12)], "--d-model must be a whole number from 1 to 65536"),
    (["train", "--n-encoder-layers", str(10**12)], "--n-encoder-layers must be a whole number from 1 to 1024"),
    (["serve", MT, "--length-penalty", "1000"], "--length-penalty must be a number from 0 to 10"),
    (["serve", MT, "--beam-size", "1000000"], "--beam-size must be a whole number from 1 to 4096"),
])
def test_the_values_that_failed_midway_are_refused_before_any_work(argv, needle, capsys, tmp_path, monkeypatch):
    """The real commands (nothing patched): what gave an OverflowError, a RuntimeError, an allocation of
    800 TB or an error after training had started is refused at once."""
    monkeypatch.chdir(tmp_path)
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, err
    assert out == "" and list(tmp_path.iterdir()) == []


def test_the_extremes_the_bounds_allow_still_work(capsys):
    """The bounds are set below overflow: the largest length penalty with the longest outputs, and the
    hottest and coldest temperatures, decode without error."""
    from qkv.bounds import MAX_LENGTH_PENALTY
    from qkv.decoding import MAX_OUTPUT_LEN
    from qkv.decoding.beam_search import _norm

    for norm in ("gnmt", "length"):  # the divisor of the longest output's log-probability at the largest alpha
        assert 1 < _norm(MAX_OUTPUT_LEN + 1, MAX_LENGTH_PENALTY, norm) < 1e31
        with pytest.raises(OverflowError):  # what the bound keeps out: 1000 overflowed from 8 tokens on
            _norm(1023, 1000.0, norm)
        rc = main(["translate", str(MT), "red cat", "the big dog sun", "--beam-size", "4", "--length-penalty", "10",
                   "--length-norm", norm, "--nbest", "4", "--max-len-b", "8"])
        out, err = capsys.readouterr()
        assert rc == 0 and out.count("\n") == 8, err
    for temperature in ("100", "1e-6", "0"):
        rc = main(["generate", str(LM), "--prefix", "red", "--max-new-tokens", "8", "--temperature", temperature,
                   "--seed", str(2**63 - 1)])
        assert rc == 0, capsys.readouterr().err
        capsys.readouterr()


def test_invalid_utf8_in_an_argument_is_refused_as_in_a_file(capsys, tmp_path):
    """What a shell passes as ``$'seven \\xff'`` reaches Python as a lone surrogate: refused by the
    argument's place and byte, before the model is loaded, as a file's invalid byte is by its line."""
    arg = os.fsdecode(b"seven \xff")
    for argv in (["translate", str(MT), arg], ["translate", str(MT), "--target-prefix", arg],
                 ["generate", str(LM), "--prefix", arg], ["classify", str(MT), arg]):
        rc = main(argv)
        out, err = capsys.readouterr()
        assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"qkv {argv[0]}: error: argument ") and "invalid UTF-8 (byte 0xff at character 7)" in err
    bad = tmp_path / "in.txt"
    bad.write_bytes(b"seven \xff\n")
    rc = main(["translate", str(MT), "--input", str(bad)])
    assert rc == 2 and "invalid UTF-8" in capsys.readouterr().err


def test_a_beam_wider_than_the_vocabulary_is_refused_before_training(capsys, tmp_path):
    """The target vocabulary is known once the tokenizer is trained (here 3 + the characters of the
    data): a --beam-size wider than it is refused then, before the first update, not after training
    (when validation or the held-out test would decode); no checkpoint is written."""
    words = ["red", "blue", "cat", "dog"]
    src = [" ".join(words[(i + j) % 4] for j in range(1 + i % 3)) for i in range(40)]
    for name, lines in (("train.src", src), ("train.tgt", [s.upper() for s in src])):
        (tmp_path / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    argv = ["train", "--src-train", str(tmp_path / "train.src"), "--tgt-train", str(tmp_path / "train.tgt"),
            "--preset", "tiny", "--tokenizer", "char", "--vocab-size", "60", "--max-steps", "2", "--eval-every", "2",
            "--eval-bleu-samples", "0", "--threads", "1", "--out", str(tmp_path / "run")]
    rc = main([*argv, "--beam-size", "200"])
    err = capsys.readouterr().err
    assert rc == 2 and "'beam_size': 200 is larger than the target vocabulary" in err and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("qkv train: error:")
    assert not (tmp_path / "run" / "last").exists()
