import dataclasses
import re

import pytest
import torch

import qkv
from qkv.config import DecodeConfig, ModelConfig, TrainConfig
from qkv.data import toy
from qkv.errors import CheckpointError
from qkv.training.average import average_checkpoints
from qkv.checkpoint import list_checkpoints, read_checkpoint
from qkv.training.trainer import ParallelData, train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("avg") / "run"
    pairs = [(toy.english(n), toy.german(n)) for n in range(1, 300, 3)]
    data = ParallelData([s for s, _ in pairs], [t for _, t in pairs], name="numbers")
    model = ModelConfig(d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1, n_decoder_layers=1, max_positions=64)
    cfg = TrainConfig(tokenizer="char", vocab_size=60, max_tokens=512, warmup_steps=10, max_steps=8,
                      eval_every=2, eval_bleu_samples=0, keep_last=3)
    train(model, cfg, DecodeConfig(), data, data, out, log=lambda m: None)
    return out


def test_keeps_the_last_k_numbered_checkpoints(run):
    assert [p.name for p in list_checkpoints(run)] == ["step_000004", "step_000006", "step_000008"]


def test_average_is_the_elementwise_mean(run, tmp_path):
    used = average_checkpoints([run], tmp_path / "avg", last=3)
    assert [p.name for p in used] == ["step_000004", "step_000006", "step_000008"]
    parts = [read_checkpoint(p).state_dict for p in used]
    avg = read_checkpoint(tmp_path / "avg").state_dict
    for k in avg:
        assert torch.allclose(avg[k], (parts[0][k] + parts[1][k] + parts[2][k]) / 3, atol=1e-6), k
    # the averaged checkpoint is a normal model: it loads and translates; weights stay tied
    model = qkv.load(tmp_path / "avg")
    assert model.model.src_embed is model.model.tgt_embed
    assert len(model.translate(["five", "twelve"])) == 2


def test_explicit_list_and_errors(run, tmp_path):
    ckpts = list_checkpoints(run)
    average_checkpoints(ckpts[:2], tmp_path / "two")
    with pytest.raises(CheckpointError, match="found 3"):
        average_checkpoints([run], tmp_path / "x", last=5)
    with pytest.raises(CheckpointError):
        average_checkpoints([tmp_path / "missing"], tmp_path / "y")


def test_refuses_different_architectures(run, tmp_path):
    other = tmp_path / "other"
    pairs = [(toy.english(n), toy.german(n)) for n in range(1, 100)]
    data = ParallelData([s for s, _ in pairs], [t for _, t in pairs], name="numbers")
    model = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, max_positions=64)
    cfg = TrainConfig(tokenizer="char", vocab_size=60, max_tokens=512, warmup_steps=10, max_steps=1,
                      eval_every=1, eval_bleu_samples=0)
    train(model, cfg, DecodeConfig(), data, None, other, log=lambda m: None)
    with pytest.raises(CheckpointError, match="not the same architecture"):
        average_checkpoints([list_checkpoints(run)[-1], other / "last"], tmp_path / "z")


def test_a_checkpoint_from_before_new_config_fields_averages_with_newer_ones(run, tmp_path):
    """A run resumed across versions: its older step checkpoints lack fields added later (at their
    defaults). They are the same architecture and must average."""
    import json
    import shutil

    old, new = list_checkpoints(run)[-2:]
    older = shutil.copytree(old, tmp_path / "step_old")
    config = json.loads((older / "config.json").read_text())
    config["model"].pop("task")  # as written before the field existed (default: translate)
    (older / "config.json").write_text(json.dumps(config))
    manifest = json.loads((older / "manifest.json").read_text())
    import hashlib
    for name in list(manifest.get("files", {})):
        if name == "config.json":
            data = (older / name).read_bytes()
            manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (older / "manifest.json").write_text(json.dumps(manifest))
    assert len(average_checkpoints([older, new], tmp_path / "avg")) == 2


def with_nan(source, dest, name: str = "decoder_layers.0.ffn.w_1.weight"):
    """A copy of the checkpoint ``source`` whose tensor ``name`` holds a NaN (written as any checkpoint is)."""
    from qkv.checkpoint import save_checkpoint
    from qkv.data.tokenizer import TokenizerPair
    from qkv.models import build_model
    from qkv.checkpoint import load_into, read_config

    ckpt = read_checkpoint(source)
    model = build_model(read_config(ckpt, "model"))
    load_into(model, ckpt)
    with torch.no_grad():
        dict(model.named_parameters())[name][0, 0] = float("nan")
    save_checkpoint(dest, model, ckpt.config, write_extra=TokenizerPair.load(source, ckpt.files).save)
    return dest


def test_nan_weights_are_refused_by_average_and_by_loading_naming_the_tensor(run, tmp_path, capsys):
    """NaN weights (a file damaged or made elsewhere: training never saves them) would average into NaN
    weights and give nonsense or an IndexError when decoded: refused where they are read, by tensor."""
    from qkv.cli import main

    name = "decoder_layers.0.ffn.w_1.weight"
    assert name in read_checkpoint(list_checkpoints(run)[-1]).state_dict
    bad = with_nan(list_checkpoints(run)[-1], tmp_path / "nan", name)
    for argv in (["average", str(bad), str(list_checkpoints(run)[-2]), "--out", str(tmp_path / "avg")],
                 ["translate", str(bad), "five"], ["export", str(bad), "--format", "hf", "--out", str(tmp_path / "e")]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and "Traceback" not in err and out == "", err
        assert f"{bad}: model.safetensors: the tensor {name} holds 1 non-finite value(s) (NaN)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan"]
    with pytest.raises(CheckpointError, match=name):
        qkv.load(bad)


def test_the_temporaries_of_killed_averages_are_removed_by_the_next_one(run, tmp_path):
    """kill -9 of ``qkv average`` (through the fault points: its output written whole, not renamed; or
    between the two renames that replace a previous average) leaves a temporary named by the pid; the
    next average to that place removes those of dead processes, or finishes the interrupted swap."""
    import os
    import subprocess
    import sys

    out = tmp_path / "avg"
    argv = [sys.executable, "-m", "qkv", "average", str(run), "--last", "2", "--out", str(out)]

    def killed(point: str) -> list[str]:
        env = {**os.environ, "QKV_FAULT": f"{point}:avg@1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == -9, proc.stderr
        return sorted(p.name for p in tmp_path.iterdir() if p.name != "avg")

    first = killed("written")
    assert len(first) == 1 and re.fullmatch(r"\.avg\.tmp-\d+-\w+", first[0]) and not out.exists(), first
    second = killed("written")
    assert len(second) == 1 and second != first, (first, second)  # the first one's removed by the second
    assert subprocess.run(argv, capture_output=True, text=True, timeout=600).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg"]
    expected = read_checkpoint(out).state_dict
    left = killed("swap")  # the previous average moved aside, the new one not yet in its place
    assert not out.exists() and len(left) == 2, left
    assert subprocess.run(argv, capture_output=True, text=True, timeout=600).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg"]
    got = read_checkpoint(out).state_dict
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_cli_average(run, tmp_path, capsys):
    from qkv.cli import main

    assert main(["average", str(run), "--last", "2", "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "model.safetensors").exists()
    assert main(["average", str(run), "--last", "9", "--out", str(tmp_path / "b")]) == 2
    assert "found 3" in capsys.readouterr().err and not (tmp_path / "b").exists()
