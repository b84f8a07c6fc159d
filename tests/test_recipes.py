"""The Multi30k recipe end to end on a tiny stand-in data folder (the real data are not needed).

It must train, average, choose the checkpoint *and* the length penalty on val only, decode the
test set once with that choice, and write scores that are the metrics of its own test output.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.cli import resolve_configs
from qkv.config import load_toml
from qkv.data import toy
from qkv.metrics import bleu, bleu_tok_lc

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[model]
d_model = 32
n_heads = 2
d_ff = 64
n_encoder_layers = 1
n_decoder_layers = 1
[train]
tokenizer = "char"
vocab_size = 60
max_tokens = 512
max_steps = 6
eval_every = 2
eval_bleu_samples = 2
keep_last = 3
warmup_steps = 4
[decode]
beam_size = 2
"""


def write_split(d: Path, split: str, numbers: range, sentence: bool = False) -> None:
    """Number words, one per line; ``sentence``: capitalized and with a full stop, as real text is."""
    for lang, make in (("en", toy.english), ("de", toy.german)):
        with gzip.open(d / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
            f.writelines((make(n).capitalize() + "." if sentence else make(n)) + "\n" for n in numbers)


def test_multi30k_recipe_chooses_checkpoint_and_length_penalty_on_val(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_split(data, "train", range(1, 300))
    write_split(data, "val", range(300, 320))
    (tmp_path / "tiny.toml").write_text(CONFIG, encoding="utf-8")
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "recipes" / "multi30k" / "run.py"), "en-de", "--data", str(data),
           "--out", str(out), "--config", str(tmp_path / "tiny.toml"), "--threads", "1",
           "--average", "3", "--length-penalties", "0.6,2.0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --val-only: the choice on val is written, the test set is not touched
    proc = subprocess.run(cmd + ["--val-only"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "test.hyp").exists() and not (out / "scores.json").exists()
    choice = json.loads((out / "val_choice.json").read_text())
    assert choice["val_sacrebleu"] == max(s for v in choice["val_sacrebleu_by_length_penalty"].values()
                                          for s in v.values())
    # then the full recipe, needing the test set only now: training is already done (resumed at its
    # limit), and the same choice is decoded on test
    write_split(data, "test_2016_flickr", range(320, 335))
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = json.loads((out / "scores.json").read_text())
    by_alpha = scores["model"]["val_sacrebleu_by_length_penalty"]
    assert set(by_alpha) == {"best", "last", "average of the last 3"}
    assert all(set(v) == {"0.6", "2"} for v in by_alpha.values())
    chosen, alpha = scores["model"]["chosen_on_val"], scores["decode"]["length_penalty"]
    assert by_alpha[chosen][f"{alpha:g}"] == max(s for v in by_alpha.values() for s in v.values())
    hyps = (out / "test.hyp").read_text(encoding="utf-8").splitlines()
    refs = [toy.german(n) for n in range(320, 335)]
    assert len(hyps) == len(refs)
    assert scores["bleu_sacrebleu"] == bleu(hyps, refs).score
    assert scores["bleu_lc_moses"] == bleu_tok_lc(hyps, refs, "de").score
    assert scores["steps"] == 6 and scores["parameters"] > 0
    assert (scores["model"]["chosen_on_val"], alpha) == (choice["chosen_on_val"], choice["length_penalty"])
    assert scores["model"]["val_sacrebleu_by_length_penalty"] == choice["val_sacrebleu_by_length_penalty"]
    # the val score in the published convention is recorded too, for comparing with lowercased runs
    assert set(choice["val_bleu_lc_moses_by_length_penalty"]) == set(by_alpha)
    assert choice["val_bleu_lc_moses"] == choice["val_bleu_lc_moses_by_length_penalty"][chosen][f"{alpha:g}"]
    # each val cell's BLEU line, with its length ratio, is kept; the test score's too
    summary = choice["val_bleu_lc_moses_summary_by_length_penalty"][chosen][f"{alpha:g}"]
    assert summary.startswith(f"BLEU = {choice['val_bleu_lc_moses']:.2f}") and "ratio" in summary
    assert scores["bleu_lc_moses_summary"] == bleu_tok_lc(hyps, refs, "de").summary
    # fairseq's search (|Y|^alpha, early stopping) writes its own files; the default search's stay as they were
    before = {name: (out / name).read_bytes() for name in ("val_choice.json", "scores.json", "test.hyp")}
    proc = subprocess.run(cmd + ["--length-norm", "length", "--early-stopping"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {name: (out / name).read_bytes() for name in before} == before
    fairseq = json.loads((out / "scores-length-early.json").read_text())
    assert (fairseq["decode"]["length_norm"], fairseq["decode"]["early_stopping"]) == ("length", True)
    assert (scores["decode"]["length_norm"], scores["decode"]["early_stopping"]) == ("gnmt", False)
    hyps = (out / "test-length-early.hyp").read_text(encoding="utf-8").splitlines()
    assert fairseq["bleu_sacrebleu"] == bleu(hyps, refs).score

    # benchmarks/multi30k_lengths.py: the references' length per source token of each split, and
    # the val BLEU line of each search, the same as the recipe's val cell for that search
    lengths = tmp_path / "lengths.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi30k_lengths.py"), str(out / "best"),
                           "--data", str(data), "--search", "gnmt:2.0", "--search", "length-early:0.6",
                           "--threads", "1", "--out", str(lengths)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(lengths.read_text())
    val_words = sum(len(toy.german(n).split()) for n in range(300, 320))
    assert measured["references_per_source_token"]["val"]["reference_tokens"] == val_words
    assert measured["references_per_source_token"]["val"]["ratio"] == pytest.approx(
        val_words / sum(len(toy.english(n).split()) for n in range(300, 320)))
    default, fs = measured["val"]
    assert (default["length_norm"], default["early_stopping"], default["length_penalty"]) == ("gnmt", False, 2.0)
    assert default["bleu_lc_moses"] == choice["val_bleu_lc_moses_by_length_penalty"]["best"]["2"]
    assert (fs["length_norm"], fs["early_stopping"], fs["length_penalty"]) == ("length", True, 0.6)
    assert fs["bleu_lc_moses"] == fairseq["model"]["val_bleu_lc_moses_by_length_penalty"]["best"]["0.6"]

    # benchmarks/multi30k_ensemble.py: an ensemble of one scores on val as the model alone; with
    # --test it decodes test once, with the α chosen on val
    ens = tmp_path / "ensemble.json"
    bench = [sys.executable, str(ROOT / "benchmarks" / "multi30k_ensemble.py"), "--data", str(data),
             "--length-penalties", "0.6,2.0", "--threads", "1", "--out", str(ens)]
    proc = subprocess.run(bench + [str(out / "best")], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads(ens.read_text())
    assert one["val_bleu_lc_moses_by_length_penalty"] == pytest.approx(
        choice["val_bleu_lc_moses_by_length_penalty"]["best"])
    assert "test" not in one
    proc = subprocess.run(bench + [str(out / "best"), str(out / "last"), "--test"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(ens.read_text())
    grid = two["val_bleu_lc_moses_by_length_penalty"]
    assert two["val_bleu_lc_moses"] == max(grid.values()) == grid[f"{two['length_penalty']:g}"]
    assert two["members"] == [str(out / "best"), str(out / "last")]
    assert two["test"]["bleu_lc_moses_signature"] == scores["bleu_lc_moses_signature"]


def test_multi30k_recipe_trains_on_lowercased_tokenized_text_and_scores_in_the_published_convention(tmp_path):
    from sacremoses import MosesTokenizer

    from qkv.data.corpus import read_lines

    data = tmp_path / "data"
    data.mkdir()
    write_split(data, "train", range(1, 300), sentence=True)
    write_split(data, "val", range(300, 320), sentence=True)
    raw_before = {p.name: p.read_bytes() for p in data.iterdir()}
    (tmp_path / "tiny.toml").write_text(CONFIG, encoding="utf-8")
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "recipes" / "multi30k" / "run.py"), "en-de", "--data", str(data),
           "--out", str(out), "--config", str(tmp_path / "tiny.toml"), "--threads", "1",
           "--average", "3", "--length-penalties", "0.6,2.0", "--lowercase-tokenized",
           "--max-steps", "4", "--max-time", "0"]  # the config says 6 updates: the flag wins
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd + ["--val-only"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the model was trained on lowercased, Moses-tokenized copies; the raw files are untouched
    assert {p.name: p.read_bytes() for p in data.iterdir()} == raw_before
    assert sorted(p.name for p in (out / "data").iterdir()) == ["train.de", "train.en", "val.de", "val.en"]
    for name in ("train.en", "val.de"):
        raw = read_lines(data / f"{name}.gz")
        assert raw[0][0].isupper() and raw[0].endswith(".")
        tok = MosesTokenizer(lang=name[-2:])  # tokenizer.perl -a -no-escape, then lowercase
        assert read_lines(out / "data" / name) == [
            tok.tokenize(line, aggressive_dash_splits=True, escape=False, return_str=True).lower() for line in raw]
    assert read_lines(out / "data" / "val.de")[0] == "dreihundert ."
    choice = json.loads((out / "val_choice.json").read_text())
    assert choice["lowercase_tokenized"] and choice["val_sacrebleu"] is None
    lc_by_alpha = choice["val_bleu_lc_moses_by_length_penalty"]
    assert choice["val_bleu_lc_moses"] == max(s for v in lc_by_alpha.values() for s in v.values())

    write_split(data, "test_2016_flickr", range(320, 335), sentence=True)
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = json.loads((out / "scores.json").read_text())
    assert scores["lowercase_tokenized"] and scores["bleu_sacrebleu"] is None
    assert (scores["model"]["chosen_on_val"], scores["decode"]["length_penalty"]) == \
        (choice["chosen_on_val"], choice["length_penalty"])
    hyps = (out / "test.hyp").read_text(encoding="utf-8").splitlines()
    refs = read_lines(data / "test_2016_flickr.de.gz")  # the raw references, cased and detokenized
    assert all(h == h.lower() for h in hyps)
    # both sides are brought to the published convention's form (the hypotheses from their tokenized form)
    assert scores["bleu_lc_moses"] == bleu_tok_lc(hyps, refs, "de", hyps_tokenized=True).score
    assert "n/a (lowercased model)" in proc.stdout
    assert scores["steps"] == 4


def test_multi30k_recipe_names_a_missing_data_file(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "multi30k" / "run.py"), "en-de",
                           "--data", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert str(tmp_path / "train.en.gz") in proc.stderr


def test_multi30k_recipe_refuses_bad_length_penalties(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "multi30k" / "run.py"), "en-de",
                           "--data", str(tmp_path), "--length-penalties", "0.6,x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--length-penalties" in proc.stderr
    for flag, value in (("--max-steps", "0"), ("--max-time", "-5")):
        proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "multi30k" / "run.py"), "en-de",
                               "--data", str(tmp_path), flag, value], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and flag in proc.stderr, proc.stderr


def test_every_shipped_recipe_config_loads_and_its_values_take_effect():
    """Each TOML under recipes/ goes through ``qkv train --config``'s own resolution (preset < file,
    then validation), so a misspelt field, a wrong type or an invalid value in a shipped config
    fails here, not hours into a run; and every value the file sets is the one the run gets."""
    configs = sorted((ROOT / "recipes").rglob("*.toml"))
    assert len(configs) >= 10, configs  # the Multi30k, IMDb and Time Machine recipes are all there
    for path in configs:
        args = argparse.Namespace(config=str(path), preset=None)
        try:
            resolved = resolve_configs(args)
        except Exception as e:  # noqa: BLE001 - name the file in the failure
            pytest.fail(f"{path.relative_to(ROOT)}: {e}")
        file = load_toml(path)
        for section, cfg in zip(("model", "train", "decode"), resolved):
            got = dataclasses.asdict(cfg)
            for key, value in file.get(section, {}).items():
                assert got[key] == value, f"{path.relative_to(ROOT)}: [{section}] {key}"


def test_distill_writes_the_teachers_translations_as_training_targets(tmp_path):
    """recipes/multi30k/distill.py: a data folder whose train targets are the teacher's beam-search
    output (here an ensemble of two checkpoints), the rest copies of the raw files; an interrupted
    run continues from its partial file and ends with the same result."""
    import torch

    import qkv
    from qkv.config import DecodeConfig, ModelConfig, TrainConfig
    from qkv.data.corpus import read_lines
    from qkv.training.trainer import ParallelData, train

    data = tmp_path / "data"
    data.mkdir()
    write_split(data, "train", range(1, 60))
    write_split(data, "val", range(300, 310))
    write_split(data, "test_2016_flickr", range(320, 325))
    torch.set_num_threads(1)
    pairs = [(toy.english(n), toy.german(n)) for n in range(1, 300)]
    corpus = ParallelData([s for s, _ in pairs], [t for _, t in pairs], name="numbers")
    model = ModelConfig(d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1, n_decoder_layers=1, max_positions=64)
    cfg = TrainConfig(tokenizer="char", vocab_size=60, max_tokens=512, warmup_steps=4, max_steps=6, eval_every=2,
                      eval_bleu_samples=0, keep_last=2)
    train(model, cfg, DecodeConfig(beam_size=2), corpus, None, tmp_path / "run", log=lambda m: None)
    teachers = [str(tmp_path / "run" / "last"), str(tmp_path / "run" / "step_000004")]
    sources = read_lines(data / "train.en.gz")
    want = qkv.load_ensemble(teachers).translate(sources, length_penalty=1.0)

    out = tmp_path / "distilled"
    out.mkdir()
    (out / "train.de.partial").write_text("".join(h + "\n" for h in want[:20]), encoding="utf-8")  # "interrupted"
    cmd = [sys.executable, str(ROOT / "recipes" / "multi30k" / "distill.py"), *teachers, "--data", str(data),
           "--length-penalty", "1.0", "--chunk", "7", "--out", str(out), "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuing after 20 lines" in proc.stderr
    assert read_lines(out / "train.de.gz") == want
    assert not (out / "train.de.partial").exists()
    for name in ("train.en.gz", "val.en.gz", "val.de.gz", "test_2016_flickr.en.gz", "test_2016_flickr.de.gz"):
        assert (out / name).read_bytes() == (data / name).read_bytes(), name
    facts = json.loads((out / "distill.json").read_text())
    assert (facts["teachers"], facts["lines"], facts["beam_size"]) == (teachers, len(sources), 2)
    # done: a second run changes nothing; a missing raw file is named
    before = (out / "train.de.gz").read_bytes()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "nothing to do" in proc.stderr and (out / "train.de.gz").read_bytes() == before
    (data / "val.de.gz").unlink()
    proc = subprocess.run(cmd[:-4] + ["--out", str(tmp_path / "other")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "val.de.gz" in proc.stderr


def test_distill_sh_refuses_an_unknown_mode_before_any_work(tmp_path):
    """recipes/multi30k/distill.sh takes no argument (fine-tune) or ``scratch``; anything else stops at once,
    with the accepted modes named, before a stage starts or a file is written."""
    before = sorted(p.name for p in (ROOT / "runs").iterdir()) if (ROOT / "runs").is_dir() else []
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "multi30k" / "distill.sh"), "finetuning"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "DATA": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    assert "'scratch'" in proc.stderr and "'finetuning'" in proc.stderr
    after = sorted(p.name for p in (ROOT / "runs").iterdir()) if (ROOT / "runs").is_dir() else []
    assert after == before


def test_wmt14_readme_commands_parse():
    """Every qkv command of recipes/wmt14/README.md (torchrun ones too) parses with qkv's own parser,
    so a renamed or misspelt option in the recipe fails here."""
    import re
    import shlex

    from qkv.cli import COMMANDS
    from qkv.cli_options import build_parser

    text = (ROOT / "recipes" / "wmt14" / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = [" ".join(c.split()) for b in blocks for c in b.replace("\\\n", " ").splitlines() if c.strip()]
    commands = [c for c in commands if c.split()[0] in ("qkv", "torchrun")]  # not the data's cat, sacrebleu
    assert len(commands) >= 7, commands
    parser = build_parser({name: (lambda a: 0) for name in COMMANDS})
    seen = set()
    for command in commands:
        words = shlex.split(command)
        if words[0] == "torchrun":
            words = words[words.index("qkv"):]
        assert words[0] == "qkv", command
        args, extra = parser.parse_known_args(words[1:])
        assert not extra, f"{command}: unknown {extra}"
        seen.add(args.command)
    assert seen >= {"preprocess", "train", "average", "translate", "evaluate"}


def test_wmt14_base_config_is_the_papers_setup():
    """recipes/wmt14/base.toml, as qkv train --config resolves it, against the paper (sections 5.3, 5.4, 6.1
    and Table 3, row base): residual dropout 0.1 and no attention dropout, no gradient clipping, Adam
    0.9 / 0.98 / 1e-9, the warmup schedule with 4000 steps, label smoothing 0.1, beam 4, alpha 0.6, |x| + 50."""
    model, train, decode = resolve_configs(argparse.Namespace(config=str(ROOT / "recipes" / "wmt14" / "base.toml"),
                                                              preset=None))
    assert (model.d_model, model.n_heads, model.d_ff, model.n_encoder_layers, model.n_decoder_layers) == \
        (512, 8, 2048, 6, 6)
    assert (model.dropout, model.attention_dropout, model.norm_first) == (0.1, 0.0, False)
    assert train.clip_norm == 0.0  # off
    assert (train.optimizer, train.adam_beta1, train.adam_beta2, train.adam_eps) == ("adam", 0.9, 0.98, 1e-9)
    assert (train.schedule, train.warmup_steps, train.lr_scale, train.label_smoothing) == ("noam", 4000, 1.0, 0.1)
    assert (decode.beam_size, decode.length_penalty, decode.length_norm, decode.max_len_a, decode.max_len_b) == \
        (4, 0.6, "gnmt", 1.0, 50)
    text = (ROOT / "recipes" / "wmt14" / "README.md").read_text(encoding="utf-8")
    assert "Ampere" in text and "wmt14/full" in text and "3,003" in text and "##AT##-##AT##" in text


def test_wmt14_big_config_and_preset_train_as_the_paper():
    """recipes/wmt14/big.toml and --preset big against the paper (Table 3, row big; sections 5.2, 5.4, 6.1):
    d_model 1024, 16 heads, d_ff 4096, residual dropout 0.3 and no attention dropout, no gradient clipping,
    300,000 steps, the last 20 checkpoints kept for averaging, 25,000 tokens per side an update over all
    processes (not per process); the recipe checkpoints every 600 updates, 10 minutes at the paper's 1.0 s a
    step, and the base recipe every 1,500 (0.4 s a step)."""
    from qkv.config import preset

    model, train, decode = resolve_configs(argparse.Namespace(config=str(ROOT / "recipes" / "wmt14" / "big.toml"),
                                                              preset=None))
    for m, t in ((model, train), preset("big")):
        assert (m.d_model, m.n_heads, m.d_ff, m.n_encoder_layers, m.n_decoder_layers) == (1024, 16, 4096, 6, 6)
        assert (m.dropout, m.attention_dropout) == (0.3, 0.0)
        assert (t.clip_norm, t.keep_last, t.update_tokens, t.max_steps, t.warmup_steps, t.label_smoothing) == \
            (0.0, 20, 25000, 300_000, 4000, 0.1)
    assert train.eval_every * 1.0 == 600 and (decode.beam_size, decode.length_penalty) == (4, 0.6)
    _, base, _ = resolve_configs(argparse.Namespace(config=str(ROOT / "recipes" / "wmt14" / "base.toml"), preset=None))
    assert base.update_tokens == 25000 and base.eval_every * 0.4 == 600 and base.keep_last >= 5
    text = (ROOT / "recipes" / "wmt14" / "README.md").read_text(encoding="utf-8")
    assert "big.toml" in text and "--last 20" in text


@pytest.mark.parametrize("processes,update_freq,share", [(1, 1, 25000), (2, 1, 12500), (4, 2, 3125), (8, 1, 3125),
                                                          (8, 2, 1562), (3, 1, 8333)])
def test_update_tokens_is_shared_out_over_the_processes(processes, update_freq, share):
    """Each batch's budget is update_tokens // (processes x update_freq), so an update holds at most 25,000
    tokens a side whatever the process count (within one batch's rounding of it); too small a share is refused."""
    from qkv.config import ConfigError, TrainConfig, per_process_batch

    cfg = per_process_batch(TrainConfig(update_tokens=25000, update_freq=update_freq, max_tokens=25000), processes)
    assert cfg.max_tokens == share
    assert 25000 - processes * update_freq < cfg.max_tokens * processes * update_freq <= 25000
    assert per_process_batch(TrainConfig(max_tokens=3200), processes).max_tokens == 3200  # update_tokens 0: as given
    with pytest.raises(ConfigError, match="update_tokens"):
        per_process_batch(TrainConfig(update_tokens=25000, max_len=256), 128)
