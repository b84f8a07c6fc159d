"""The help says what happens: the defaults a run really gets, examples one a line, "did you mean" for a
mistyped preset or architecture, one default preset for train and info, the scores evaluate prints (TER
among them), and no module kept only as another module's old name."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from qkv import cli, cli_options
from qkv.cli import main
from qkv.config import DEFAULT_PRESET, ModelConfig, TrainConfig, preset
from qkv.data import toy

ROOT = Path(__file__).resolve().parents[1]


def help_of(*command: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    return re.sub(r"\s+", " ", capsys.readouterr().out)  # argparse wraps at the terminal's width


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser (and every subcommand's, as "viz attention"), by name."""
    found = {}

    def walk(parser, name):
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(p, f"{name} {sub}".strip())

    walk(cli_options.build_parser({name: None for name in cli.COMMANDS}), "")
    return found


@pytest.mark.parametrize("cls, given, embedded", [(ModelConfig, preset(DEFAULT_PRESET)[0], toy.MODEL),
                                                   (TrainConfig, preset(DEFAULT_PRESET)[1], toy.TRAIN)])
def test_train_help_shows_the_values_a_run_gets(cls, given, embedded, capsys):
    """Each model and training flag shows the default preset's value (a run on given data) and the
    embedded recipe's (a run with no data), not the config class's own default (the base model's)."""
    helps = {a.dest: re.sub(r"\s+", " ", a.help or "") for a in parsers()["train"]._actions}
    text = help_of("train", capsys=capsys)
    for f in dataclasses.fields(cls):
        if f.metadata.get("hidden"):
            continue
        a, b = getattr(given, f.name), getattr(embedded, f.name)
        want = (f"(default: {a!r})" if a == b else
                f"(default: {a!r} on given data (preset {DEFAULT_PRESET}), {b!r} on the embedded task)")
        shown = re.sub(r" \(allowed: [^()]*\)$", "", helps[f.name])  # a number's bound follows its default
        assert shown.endswith(want), (f.name, helps[f.name])
        assert re.sub(r"\s", "", helps[f.name].replace("%%", "%")) in re.sub(r"\s", "", text)  # as --help prints it
    assert "the preset's" not in helps["d_model"] + helps["max_tokens"]  # named, not left to guess
    assert f"(default: {ModelConfig().d_model!r}" not in helps["d_model"]  # not the base model's 512


def test_the_runs_defaults_are_what_help_says(tmp_path):
    """What resolve_configs gives a run with data and without it is what the help shows."""
    args = cli_options.build_parser({name: None for name in cli.COMMANDS}).parse_args(["train", "--out", str(tmp_path)])
    model, train, _ = cli.resolve_configs(args)
    assert (model, train) == preset(DEFAULT_PRESET)
    model, train, _ = cli.resolve_configs(args, embedded=True)
    assert (model, train) == (toy.MODEL, toy.TRAIN)


def test_every_example_stands_on_its_own_line():
    """Each command line of an epilog's examples is one line of the --help output, whatever its length."""
    checked = 0
    for name, parser in parsers().items():
        epilog = parser.epilog or ""
        examples = [line.split("  #")[0].strip() for line in epilog.splitlines() if line.strip().startswith("qkv ")]
        text = parser.format_help()
        lines = [line.split("  #")[0].strip() for line in text.splitlines()]
        for example in examples:
            assert example in lines, f"qkv {name} --help: the example {example!r} is not one line:\n{text}"
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("argv, message", [
    (["train", "--preset", "smal"], "did you mean 'small'?"),
    (["info", "--preset", "bse"], "did you mean 'base'?"),
    (["train", "--arch", "tranformer", "--max-steps", "1"], "did you mean 'transformer'?"),
    (["info", "--arch", "lstn"], "did you mean 'lstm'?"),
])
def test_a_mistyped_preset_or_arch_gets_did_you_mean(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_info_and_train_default_to_the_same_preset(capsys):
    assert main(["info"]) == 0
    plain = capsys.readouterr().out
    assert main(["info", "--preset", DEFAULT_PRESET]) == 0
    assert plain == capsys.readouterr().out
    m = preset(DEFAULT_PRESET)[0]
    assert f"d_model={m.d_model} h={m.n_heads} d_ff={m.d_ff}" in plain
    text = help_of("info", capsys=capsys)
    assert f"(default: {DEFAULT_PRESET}" in text


def test_evaluate_help_names_every_score_it_prints(capsys):
    text = help_of("evaluate", capsys=capsys)
    for score in ("sacreBLEU's BLEU", "the Multi30k way", "the WMT way", "chrF", "TER"):
        assert score in text, score


def test_evaluate_prints_ter(tmp_path, capsys):
    """TER = edits / reference words: one insertion ("down") over 4 + 2 reference words is 16.67."""
    (tmp_path / "hyp.txt").write_text("a cat sat\nthe dog\n")
    (tmp_path / "ref.de").write_text("a cat sat down\nthe dog\n")
    assert main(["evaluate", "--hyp", str(tmp_path / "hyp.txt"), "--ref", str(tmp_path / "ref.de")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5
    assert lines[-1].startswith("TER = 16.67 (sacreBLEU signature: nrefs:1|case:lc|tok:tercom")


@pytest.mark.parametrize("old", ["qkv.api", "qkv.encoder", "qkv.training.bptt", "qkv.training.checkpoint",
                                 "qkv.training.loss"])
def test_modules_kept_only_under_an_old_name_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    dotted = re.compile(re.escape(old) + r"\b")
    users = [str(p.relative_to(ROOT)) for p in [*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/*.py"),
                                                 *ROOT.glob("docs/*.md"), ROOT / "README.md"]
             if p.name != "test_help_pages.py" and dotted.search(p.read_text(encoding="utf-8"))]
    assert not users, users
