"""The presets' facts and measured training time: docs/training.md's table and `qkv info --preset`."""

import json
import re
from pathlib import Path

import pytest

from qkv import info
from qkv.cli import main
from qkv.config import MODEL_PRESETS, PRESETS, TRAIN_PRESETS

DOC = Path(__file__).resolve().parent.parent / "docs" / "training.md"

# counted by hand: tiny (d 32, d_ff 64, 2+2 layers, vocabulary 200 shared with the output layer):
# embeddings 200·32 = 6,400; encoder layer 4·(32·32+32) + (32·64+64 + 64·32+32) + 2·64 = 8,544;
# decoder layer 2·4,224 + 4,192 + 3·64 = 12,832; total 6,400 + 2·8,544 + 2·12,832 = 49,152.
# base (test_cli.py checks the same figure): 63,082,496.
PARAMETERS = {"tiny": 49_152, "base": 63_082_496}


def fake_times(tmp_path, monkeypatch, **presets):
    """A preset_times.json of the benchmark's layout with these presets' records."""
    record = {"machine": "Test CPU, 2 cores", "threads": 2, "date": "2026-01-01T0000Z", "commit": "abc1234",
              "lengths": [10, 40], "command": "python benchmarks/preset_speed.py", "presets": presets}
    path = tmp_path / "preset_times.json"
    path.write_text(json.dumps(record))
    monkeypatch.setattr(info, "PRESET_TIMES", path)
    return record


def timing(name, seconds_per_update, **over):
    facts = info.preset_facts(name)
    return {"seconds_per_update": seconds_per_update, "seconds_per_1000_updates": 1000 * seconds_per_update,
            "extrapolated_from_updates": 30, "warmup_updates": 3, "batch_split": 1, "date": "2026-01-01T0000Z",
            "note": "", "max_tokens": facts["tokens per batch"], "parameters": facts["parameters"], **over}


def doc_table() -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in DOC.read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in PRESETS]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def test_docs_table_is_generated_from_the_presets_and_the_measurements():
    assert info.preset_table() in DOC.read_text(), \
        "docs/training.md's preset table is stale: paste python -c 'from qkv.info import preset_table; " \
        "print(preset_table())'"
    table = doc_table()
    assert list(table) == list(PRESETS)
    for name, cells in table.items():  # against the config itself, not through qkv.info
        m, t = MODEL_PRESETS[name], TRAIN_PRESETS[name]
        expected = [f"{t.max_steps:,}", f"{t.warmup_steps:,}", f"{t.max_tokens:,}", f"{t.vocab_size:,}",
                    f"{m.n_encoder_layers}/{m.n_decoder_layers}", f"{m.d_model:,}", f"{m.n_heads}", f"{m.d_ff:,}"]
        assert cells[:8] == expected, name
        if name in PARAMETERS:
            assert cells[8] == f"{PARAMETERS[name]:,}"
        assert re.fullmatch(r"\d+:\d\d(:\d\d)?", cells[9]), f"{name}: no measured time in the docs table"


def test_the_committed_measurements_cover_every_preset_as_it_is():
    times = info.preset_times()
    assert times["threads"] == 2 and times["machine"] and times["command"].startswith("python benchmarks/")
    for name in PRESETS:
        r = info.preset_time(name, times)
        assert r is not None, f"{name}: not measured for the preset as it is (run benchmarks/preset_speed.py)"
        assert r["seconds_per_1000_updates"] == pytest.approx(1000 * r["seconds_per_update"], rel=1e-3)


def test_preset_table_rule(tmp_path, monkeypatch):
    times = fake_times(tmp_path, monkeypatch, tiny=timing("tiny", 2.942),
                       base=timing("base", 12.5, batch_split=16, note="a busy machine"))
    table = info.preset_table(times).splitlines()
    assert table[0].endswith("| parameters | time per 1,000 updates (2 CPU threads) |")
    assert table[2] == "| tiny | 200 | 100 | 1,024 | 200 | 2/2 | 32 | 2 | 64 | 49,152 | 49:02 |"  # 2,942 s
    assert table[4].endswith("| 63,082,496 | 3:28:20 |")  # 12,500 s
    assert table[3].endswith("| not measured |") and table[5].endswith("| not measured |")
    assert "base on 1/16 of the batch" in table[-1] and "Test CPU, 2 cores" in table[-1]
    assert table[-1].endswith("A busy machine.")


def test_info_preset_shows_training_values_and_measured_time(tmp_path, monkeypatch, capsys):
    fake_times(tmp_path, monkeypatch, tiny=timing("tiny", 2.942, note="loaded"))
    assert main(["info", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "vocab=200/200" in out[0]  # the preset's own vocabulary by default
    assert next(line for line in out if line.strip().startswith("total")).split()[1] == "49,152"
    assert "preset tiny: 200 updates, warmup 100, 1,024 tokens per batch, vocabulary 200" in out
    measured = next(line for line in out if line.startswith("measured training time"))
    assert measured.startswith("measured training time: 49:02 per 1,000 updates (2.94 s per update, the median of 30")
    assert "on 2 CPU threads of Test CPU, 2 cores, 2026-01-01T0000Z; loaded" in measured


def test_info_does_not_claim_a_time_for_a_changed_or_unmeasured_preset(tmp_path, monkeypatch, capsys):
    fake_times(tmp_path, monkeypatch, tiny=timing("tiny", 2.942), small=timing("small", 9.0, parameters=1),
               base=timing("base", 2150.41, batch_split=16, extrapolated_from_updates=2))
    assert main(["info", "--preset", "tiny", "--d-model", "64"]) == 0
    assert "only for the preset unchanged" in capsys.readouterr().out
    assert main(["info", "--preset", "tiny", "--vocab-size", "300"]) == 0
    assert "only for the preset unchanged" in capsys.readouterr().out
    assert main(["info", "--preset", "base"]) == 0 and "(2,150 s per update, the median of 2 timed, timed on 1/16 of " \
        "the batch; extrapolated)" in capsys.readouterr().out
    assert main(["info", "--preset", "small"]) == 0  # recorded for another parameter count: stale
    assert "none for the preset as it is now" in capsys.readouterr().out
    assert main(["info", "--preset", "big"]) == 0
    assert "none for the preset as it is now" in capsys.readouterr().out
