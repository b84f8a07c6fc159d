import json
import random

import pytest
import torch
from torch import nn

from qkv.errors import CheckpointError
from qkv.checkpoint import (
    Checkpoint,
    list_checkpoints,
    load_into,
    read_checkpoint,
    save_checkpoint,
    step_path,
)

CONFIG = {"model": {"d_model": 8, "tie_output": True}, "train": {"lr_scale": 2.0}, "decode": {"beam_size": 4}}


class Tied(nn.Module):
    """Embedding and output projection share one Parameter, as in the paper (section 3.4)."""

    def __init__(self, vocab: int = 11, d: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.hidden = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("counter", torch.tensor([3, 1, 4]))


def tokenizer_writer(directory):
    (directory / "spm.model").write_bytes(b"fake tokenizer model")


def test_round_trip_with_tied_weights(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    path = save_checkpoint(tmp_path / "ckpt", model, CONFIG, write_extra=tokenizer_writer)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "manifest.json", "model.safetensors", "spm.model"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["config.json", "model.safetensors", "spm.model"]
    assert manifest["files"]["spm.model"]["size"] == len(b"fake tokenizer model")
    saved = json.loads((path / "config.json").read_text())
    assert saved["format"] == 1 and "qkv_version" in saved

    ckpt = read_checkpoint(path)
    assert ckpt.config == CONFIG
    assert ckpt.trainer_state is None
    assert set(ckpt.state_dict) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(ckpt.state_dict[name], tensor)

    fresh = Tied()
    assert not torch.equal(fresh.embed.weight, model.embed.weight)
    load_into(fresh, path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh.out.weight is fresh.embed.weight  # still tied after loading
    x = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(fresh.out(fresh.hidden(fresh.embed(x))), model.out(model.hidden(model.embed(x))))


def test_tied_weight_stored_once(tmp_path):
    from safetensors import safe_open

    path = save_checkpoint(tmp_path / "ckpt", Tied(), CONFIG)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert len(names & {"embed.weight", "out.weight"}) == 1


def test_untied_model_round_trip(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    path = save_checkpoint(tmp_path / "c", model, {})
    other = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    load_into(other, read_checkpoint(path))
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_load_into_names_mismatches(tmp_path):
    path = save_checkpoint(tmp_path / "c", nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), {})
    with pytest.raises(CheckpointError, match=r"shape mismatch: 1\.weight \(2, 4\) vs model \(5, 4\)"):
        load_into(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5)), path)
    with pytest.raises(CheckpointError, match=r"missing: 2\.weight, 2\.bias"):
        load_into(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2)), path)
    with pytest.raises(CheckpointError, match=r"unexpected: 1\.bias, 1\.weight"):
        load_into(nn.Sequential(nn.Linear(3, 4)), path)


def test_trainer_state_round_trip(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    state = {
        "step": 1200,
        "epoch": 3,
        "best_bleu": 27.5,
        "run": "toy",
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "history": [1.5, 1.25, None],
    }
    path = save_checkpoint(tmp_path / "c", model, CONFIG, trainer_state=state)
    ckpt = read_checkpoint(path)
    assert ckpt.trainer_state is None  # only read when asked for
    got = read_checkpoint(path, need_trainer_state=True).trainer_state
    plain = (got["step"], got["epoch"], got["best_bleu"], got["run"], got["history"])
    assert plain == (1200, 3, 27.5, "toy", [1.5, 1.25, None])
    assert torch.equal(got["rng"]["torch"], state["rng"]["torch"])
    assert got["rng"]["python"] == random.getstate()
    # Restoring the RNG reproduces the same random numbers.
    expected = torch.rand(4)
    torch.set_rng_state(got["rng"]["torch"])
    assert torch.equal(torch.rand(4), expected)
    opt2 = torch.optim.Adam(model.parameters())
    opt2.load_state_dict(got["optimizer"])
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt2.state_dict()["state"][0][k], opt.state_dict()["state"][0][k])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.98)


def test_trainer_state_missing_when_needed(tmp_path):
    path = save_checkpoint(tmp_path / "c", nn.Linear(2, 2), {})
    with pytest.raises(CheckpointError, match="no trainer_state.pt"):
        read_checkpoint(path, need_trainer_state=True)


def test_trainer_state_refuses_unloadable_values(tmp_path):
    class Custom:
        pass

    with pytest.raises(TypeError, match=r"trainer_state\['rng'\]\['numpy'\] has type Custom"):
        save_checkpoint(tmp_path / "c", nn.Linear(2, 2), {}, trainer_state={"rng": {"numpy": Custom()}})
    assert list(tmp_path.iterdir()) == []


def test_atomic_replace_and_failed_save_leaves_old(tmp_path):
    path = tmp_path / "last"
    old_model = nn.Linear(2, 2)
    save_checkpoint(path, old_model, {"v": 1})
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def failing_writer(directory):
        (directory / "spm.model").write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(CheckpointError, match="cannot write the checkpoint .*last: disk full; the previous last is unchanged"):
        save_checkpoint(path, nn.Linear(2, 2), {"v": 2}, write_extra=failing_writer)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["last"]  # no temp dir left behind
    assert read_checkpoint(path).config == {"v": 1}

    # A successful save replaces it completely, again leaving nothing else behind.
    new_model = nn.Linear(2, 2)
    save_checkpoint(path, new_model, {"v": 3})
    assert [p.name for p in tmp_path.iterdir()] == ["last"]
    ckpt = read_checkpoint(path)
    assert ckpt.config == {"v": 3}
    assert torch.equal(ckpt.state_dict["weight"], new_model.weight.detach())


def test_failure_during_swap_restores_old(tmp_path, monkeypatch):
    import qkv.checkpoint as ckpt_module

    path = tmp_path / "last"
    save_checkpoint(path, nn.Linear(2, 2), {"v": 1})
    real_replace = ckpt_module.os.replace

    def replace(src, dst):
        if ".tmp-" in str(src) and not str(src).endswith(".old"):  # moving the new one in
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_module.os, "replace", replace)
    with pytest.raises(CheckpointError, match="simulated crash; the previous last is unchanged"):
        save_checkpoint(path, nn.Linear(2, 2), {"v": 2})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["last"]
    assert read_checkpoint(path).config == {"v": 1}


def test_refuses_to_replace_a_non_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a qkv checkpoint"):
        save_checkpoint(tmp_path / "notes", nn.Linear(2, 2), {})
    assert (tmp_path / "notes" / "precious.txt").read_text() == "keep me"


def test_write_extra_cannot_overwrite_reserved_files(tmp_path):
    with pytest.raises(CheckpointError, match="reserved"):
        save_checkpoint(tmp_path / "c", nn.Linear(2, 2), {}, write_extra=lambda d: (d / "config.json").write_text("{}"))
    assert list(tmp_path.iterdir()) == []


def test_truncated_weights_are_corrupt(tmp_path):
    path = save_checkpoint(tmp_path / "c", Tied(), CONFIG)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt.*model.safetensors does not match its checksum"):
        read_checkpoint(path)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_into(Tied(), path)


def test_flipped_byte_is_corrupt(tmp_path):
    path = save_checkpoint(tmp_path / "c", nn.Linear(2, 2), {}, write_extra=tokenizer_writer)
    data = bytearray((path / "spm.model").read_bytes())
    data[0] ^= 1
    (path / "spm.model").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt.*spm.model"):
        read_checkpoint(path)


def test_damaged_safetensors_with_matching_manifest(tmp_path):
    path = save_checkpoint(tmp_path / "c", nn.Linear(2, 2), {})
    (path / "model.safetensors").write_bytes(b"\xff" * 16)
    manifest = json.loads((path / "manifest.json").read_text())
    import hashlib

    manifest["files"]["model.safetensors"] = {"size": 16, "sha256": hashlib.sha256(b"\xff" * 16).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot read model.safetensors"):
        read_checkpoint(path)


def test_missing_manifest_is_incomplete(tmp_path):
    path = save_checkpoint(tmp_path / "c", nn.Linear(2, 2), {})
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*no manifest.json.*interrupted"):
        read_checkpoint(path)


def test_listed_file_missing(tmp_path):
    path = save_checkpoint(tmp_path / "c", nn.Linear(2, 2), {}, write_extra=tokenizer_writer)
    (path / "spm.model").unlink()
    with pytest.raises(CheckpointError, match="spm.model is missing"):
        read_checkpoint(path)


def test_missing_path_and_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found: .*nowhere"):
        read_checkpoint(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        read_checkpoint(tmp_path / "file")


def test_unreadable_config(tmp_path):
    path = save_checkpoint(tmp_path / "c", nn.Linear(2, 2), {})
    (path / "config.json").write_text("{not json")
    manifest = json.loads((path / "manifest.json").read_text())
    import hashlib

    data = (path / "config.json").read_bytes()
    manifest["files"]["config.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot parse config.json"):
        read_checkpoint(path)


def test_list_checkpoints_sorted_by_step(tmp_path):
    model = nn.Linear(2, 2)
    for step in (200, 1000, 100, 50):
        save_checkpoint(step_path(tmp_path, step), model, {})
    save_checkpoint(tmp_path / "last", model, {})
    (tmp_path / "step_000300.txt").write_text("not a checkpoint")
    assert step_path(tmp_path, 100).name == "step_000100"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000050", "step_000100", "step_000200", "step_001000"]
    (tmp_path / "empty_run").mkdir()
    assert list_checkpoints(tmp_path / "empty_run") == []
    with pytest.raises(CheckpointError, match="run directory not found"):
        list_checkpoints(tmp_path / "missing")


def test_checkpoint_object_accepted(tmp_path):
    path = save_checkpoint(tmp_path / "c", nn.Linear(2, 2), {"a": [1, 2]})
    ckpt = read_checkpoint(path)
    assert isinstance(ckpt, Checkpoint) and ckpt.path == path
    assert load_into(nn.Linear(2, 2), ckpt) is ckpt
