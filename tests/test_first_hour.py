"""What a new user meets in the first hour: a short run's validation and closing report cost no more than
they must, the errors and warnings of the tour say the real reason."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import qkv
from qkv.config import DecodeConfig, TrainConfig

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def counted_steps(model):
    """Wrap ``model.step`` to count the decoding steps it runs."""
    calls = []
    step = model.step

    def counting(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    model.step = counting
    return calls


def test_validation_decodes_at_most_twice_the_reference_plus_five():
    """A model that never ends (min_len beyond any budget) decodes source + 50 tokens per sample without a cap
    (58 steps for this source); validation stops at 2 x the reference's tokens + 5, the step of EOS included."""
    from qkv.tasks.translate import TranslateTask

    translator = qkv.load(FIXTURES / "translate-transformer")
    src, ref = "one two three four five six seven eight", "eins"
    ref_len = len(translator.tokenizers.tgt.encode([ref])[0])
    steps = counted_steps(translator.model)
    split = SimpleNamespace(raw_src=[src], raw_tgt=[ref], metric="bleu")
    scores = TranslateTask().metrics(translator.model, split, translator.tokenizers,
                                     DecodeConfig(min_len=1000, scripted_greedy=False), TrainConfig(eval_bleu_samples=1))
    assert scores["valid_exact"] == 0.0
    assert len(steps) <= 2 * ref_len + 5 + 1, (len(steps), ref_len)
    src_len = len(translator.tokenizers.src.encode([src])[0])
    assert src_len + 50 > 2 * (2 * ref_len + 6)  # the cap is what made it short


def test_the_closing_report_decodes_at_most_twice_each_reference_plus_five():
    """The embedded task's held-out report after a few updates: every output capped by its expected number's
    length, the numbers of one cap decoded together."""
    from qkv.data.toy import default_numbers, english, german, held_out_report

    budgets = {}

    class Model:
        decode_cfg = SimpleNamespace(beam_size=4)
        tokenizers = SimpleNamespace(tgt=SimpleNamespace(encode=lambda texts: [list(t) for t in texts]))

        @staticmethod
        def translate(sources, max_len_a=1.0, max_len_b=50):
            budgets.update({s: max_len_a * 3 + max_len_b for s in sources})  # 3 source tokens a number here
            return ["x"] * len(sources)

    lines = held_out_report(Model(), "runs/default").splitlines()
    assert lines[0].startswith("held-out test: 0.0% exact match on 616 numbers")
    for n in default_numbers()["test"][:50]:
        assert budgets[english(n)] == 2 * len(german(n)) + 5  # characters, in this fake tokenizer


def test_import_help_lists_every_family_of_the_importers_registry(monkeypatch, capsys):
    """Every architecture of every converter module, the sentence-transformers folders, and a family added to
    the registry without touching the help."""
    import importlib
    import sys
    import types

    import qkv.importers as importers
    from qkv.cli import main

    def shown() -> str:
        with pytest.raises(SystemExit) as stop:
            main(["import", "--help"])
        assert stop.value.code == 0
        return capsys.readouterr().out

    out = shown()
    for name in importers.FAMILIES:
        family = importlib.import_module(name)
        for arch in (*family.ARCHITECTURES, *family.MODEL_TYPES):
            assert arch in out, (arch, out)
    for named in ("BertForSequenceClassification", "GPT2LMHeadModel", "MarianMTModel", "sentence-transformers"):
        assert named in out
    fake = types.ModuleType("qkv_test_family")
    fake.ARCHITECTURES, fake.MODEL_TYPES = ("T5ForConditionalGeneration",), ("t5",)
    monkeypatch.setitem(sys.modules, "qkv_test_family", fake)
    monkeypatch.setattr(importers, "FAMILIES", (*importers.FAMILIES, "qkv_test_family"))
    assert "T5ForConditionalGeneration" in shown()


def fake_run(root: Path, steps: list[int], **train) -> Path:
    """A run directory with the fixture translation checkpoint as ``last/`` (its train settings changed to
    ``train``) and empty ``step_N/`` folders: what `qkv average --last` counts."""
    import json
    import shutil

    run = root / "run"
    shutil.copytree(FIXTURES / "translate-transformer", run / "last", ignore=shutil.ignore_patterns("ct2-*"))
    config = json.loads((run / "last" / "config.json").read_text())
    config["train"].update(train)
    (run / "last" / "config.json").write_text(json.dumps(config))
    for step in steps:
        (run / f"step_{step:06d}").mkdir()
    return run


@pytest.mark.parametrize("steps, train, says, not_says", [
    # the README's tour at --max-steps 1000: keep_last is 10, the run validated 4 times
    ([300, 600, 900, 1000], dict(keep_last=10, eval_every=300, max_steps=1000),
     ["every 300 updates (eval_every)", "trained 1,000 of max_steps 1,000", "--max-steps 3000",
      "average --last 4"], ["train with --keep-last"]),
    ([600, 900], dict(keep_last=2, eval_every=300, max_steps=900),
     ["keeps only the newest 2 (keep_last 2)", "--keep-last 10", "average --last 2"], ["--max-steps"]),
    ([], dict(keep_last=0, eval_every=300, max_steps=900), ["keeps none (keep_last 0)"], ["average --last 0"]),
])
def test_average_says_why_a_run_has_too_few_checkpoints(tmp_path, capsys, steps, train, says, not_says):
    from qkv.cli import main

    run = fake_run(tmp_path, steps, **train)
    assert main(["average", str(run), "--last", "10", "--out", str(run / "avg10")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    for text in says:
        assert text in err, (text, err)
    for text in not_says:
        assert text not in err, (text, err)
    assert not (run / "avg10").exists()


DEFAULT_TASK = Path(__file__).parent / "fixtures" / "default-task"  # the embedded task's recipe, trained


def test_translate_names_the_words_the_vocabulary_cannot_read(capsys, tmp_path):
    """A capital letter and an out-of-domain word ('m' is in no English number word) become <unk>: the model
    answers anyway, with a warning naming the words and their lines; a number it can read gets none."""
    from qkv.cli import main

    assert main(["translate", str(DEFAULT_TASK), "Twelve", "twelve", "seven million"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[1] == "zwölf"
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1, err
    assert "<arguments>:1: 'Twelve'" in warnings[0] and "<arguments>:3: 'million'" in warnings[0]
    assert "'twelve'" not in warnings[0] and "'seven'" not in warnings[0]
    (tmp_path / "in.txt").write_text("twelve\nseven thousand\n", encoding="utf-8")
    assert main(["translate", str(DEFAULT_TASK), "--input", str(tmp_path / "in.txt")]) == 0
    out, err = capsys.readouterr()
    assert out == "zwölf\nsiebentausend\n" and "warning" not in err


def test_unknown_words_are_what_the_tokenizer_reads_as_unk():
    model = qkv.load(DEFAULT_TASK)
    texts = ["Twelve", "seven, eight", "three hundred", "zwölf"]
    assert model.unknown_words(texts) == [["Twelve"], ["seven,"], [], []]
    tokenizer = model.tokenizers.src
    for text, words in zip(texts, model.unknown_words(texts)):  # the reference: the ids themselves
        assert (1 in tokenizer.encode([text])[0]) == bool(words)


def test_translate_warns_when_every_output_is_empty(capsys):
    """With no output budget every translation is empty, as an untrained model's are (it emits EOS first):
    one warning; a model that answers something gets none."""
    from qkv.cli import main

    assert main(["translate", str(DEFAULT_TASK), "seven", "eight", "--max-len-a", "0", "--max-len-b", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n\n"
    assert "warning: every output is empty (2 inputs)" in err and len(err.strip().splitlines()) == 1
    assert main(["translate", str(DEFAULT_TASK), "seven", "--output-format", "jsonl", "--max-len-b", "0",
                 "--max-len-a", "0"]) == 0
    assert "every output is empty (1 input)" in capsys.readouterr().err
    assert main(["translate", str(DEFAULT_TASK), "seven", "eight"]) == 0
    out, err = capsys.readouterr()
    assert out == "sieben\nacht\n" and "warning" not in err


def test_generate_warns_when_it_generates_nothing(capsys, monkeypatch):
    from qkv.cli import main
    from qkv.frontends.language_model import LanguageModel

    lm = str(FIXTURES / "lm-lstm")
    assert main(["generate", lm, "--prefix", "red", "--max-new-tokens", "5", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() != "red" and "warning" not in err
    assert main(["generate", lm, "--prefix", "red", "--max-new-tokens", "5", "--greedy"]) == 0  # it says spaces
    out, err = capsys.readouterr()
    assert out.startswith("red ") and out.strip() == "red" and "generated nothing but white space" in err
    monkeypatch.setattr(LanguageModel, "generate", lambda self, *args, **kwargs: iter(["\n"]))  # EOS at once
    assert main(["generate", lm, "--prefix", "red", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == "red\n\n" and "warning: generated nothing but white space" in err
    monkeypatch.setattr(LanguageModel, "generate", lambda self, *args, **kwargs: iter([]))
    assert main(["generate", lm, "--prefix", "red", "--max-new-tokens", "5"]) == 0
    assert "warning: generated nothing:" in capsys.readouterr().err


def test_bench_layers_quick_runs_on_one_thread_and_its_help_claims_what_was_measured(monkeypatch, capsys):
    """On the busy 2-core machine --quick took 234 s with torch's default threads, 45 s with one: it takes
    one unless --threads says otherwise, and its help gives the measured time, not "seconds"."""
    import torch

    import qkv.complexity
    from qkv import cli, cli_options

    seen = []
    monkeypatch.setattr(qkv.complexity, "bench_layers", lambda *a, **k: (seen.append(torch.get_num_threads()), ("", []))[1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cli.main(["bench", "layers", "--quick", "--out", "unused"]) == 0
        torch.set_num_threads(2)
        assert cli.main(["bench", "layers", "--quick", "--threads", "2", "--out", "unused"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]
    parser = cli_options.build_parser({name: None for name in cli.COMMANDS})
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._subparsers._group_actions[0]
                 .choices["layers"]._actions if "--quick" in a.option_strings)
    assert "in seconds" not in bench.help and "45 s" in bench.help and "234 s" in bench.help
    assert "45 s wall, 13 s of CPU" in (Path(__file__).parent.parent / "docs" / "seeing-inside.md").read_text()
