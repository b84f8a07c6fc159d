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
