"""Data-parallel training: 2 processes (gloo, CPU) train the weights of 1 process with update_freq x 2.

The runs go through the real command, ``python -m torch.distributed.run --standalone
--nproc-per-node 2 -m qkv train ...`` (what ``torchrun`` runs), on a tiny word-reversal task:

* reference: one process, ``--update-freq 4``, 6 updates, a numbered checkpoint every 3;
* DDP: two processes, ``--update-freq 2``, stopped at update 3, then ``--resume`` to 6;
* one process, ``--update-freq 4``, stopped at update 3, then resumed on two with ``--update-freq 2``.

The data make 17 batches an epoch, so update 5 (the epoch's last) holds one batch: rank 1 has
none and must join the all-reduce with a zero-weighted backward, and update 6 is in epoch 1.
Dropout is off (each rank draws its own masks, which one process cannot reproduce), and
Adam's ε is 1e-6: a gradient that is zero in exact arithmetic (the key bias, to which softmax
is blind) is rounding noise of ~1e-10 whose sign depends on the order of summation, and
ε = 1e-9 would turn that noise into a full ±lr step.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.data.batching import token_budget_batches
from qkv.data.tokenizer import TokenizerPair
from qkv.errors import ConfigError
from qkv.training import distributed
from qkv.checkpoint import read_checkpoint

WORDS = ["red", "blue", "cat", "dog", "sun", "tree"]
FLAGS = ["--preset", "tiny", "--tokenizer", "char", "--vocab-size", "60", "--max-len", "40", "--max-tokens", "96",
         "--max-steps", "6", "--eval-every", "3", "--keep-last", "5", "--eval-bleu-samples", "2",
         "--dropout", "0", "--attention-dropout", "0", "--adam-eps", "1e-6", "--threads", "1", "--device", "cpu"]
ATOL = 1e-5


def write_data(d: Path) -> list[str]:
    rng = random.Random(0)
    src, tgt = [], []
    for _ in range(120):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
        src.append(" ".join(words))
        tgt.append(" ".join(reversed(words)))
    for name, lines in (("train.src", src), ("train.tgt", tgt), ("valid.src", src[:10]), ("valid.tgt", tgt[:10])):
        (d / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return ["--src-train", str(d / "train.src"), "--tgt-train", str(d / "train.tgt"),
            "--src-valid", str(d / "valid.src"), "--tgt-valid", str(d / "valid.tgt")]


def torchrun(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "qkv", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def max_diff(a: Path, b: Path) -> float:
    wa, wb = read_checkpoint(a).state_dict, read_checkpoint(b).state_dict
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def valid_steps(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "valid_loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    data = write_data(d)
    assert main(["train", *data, *FLAGS, "--update-freq", "4", "--out", str(d / "ref")]) == 0
    part = torchrun(d, *data, *FLAGS, "--update-freq", "2", "--max-steps", "3", "--out", str(d / "ddp"))
    after_part = {"listing": sorted(os.listdir(d / "ddp")), "valid_steps": valid_steps(d / "ddp"),
                  "stderr": part.stderr, "diff3": max_diff(d / "ref" / "step_000003", d / "ddp" / "last")}
    resumed = torchrun(d, *data, "--resume", "--max-steps", "6", "--out", str(d / "ddp"))
    return d, after_part, resumed


def test_the_data_make_an_epoch_tail_with_one_batch(runs):
    d, _, _ = runs
    tok = TokenizerPair.load(d / "ref" / "last")
    src = tok.src.encode((d / "train.src").read_text().splitlines())
    tgt = tok.tgt.encode((d / "train.tgt").read_text().splitlines())
    order = token_budget_batches([len(s) for s in src], [len(t) for t in tgt], 96, True, 1, 0)
    assert len(order) % 4 == 1  # update 5 has one batch for two ranks: rank 1 takes the dummy path


def test_two_processes_equal_one_with_update_freq_doubled(runs):
    d, after_part, _ = runs
    assert after_part["diff3"] < ATOL
    assert max_diff(d / "ref" / "step_000006", d / "ddp" / "step_000006") < ATOL  # across the epoch's tail
    ref = read_checkpoint(d / "ref" / "last", need_trainer_state=True).trainer_state
    got = read_checkpoint(d / "ddp" / "last", need_trainer_state=True).trainer_state
    assert (got["step"], got["epoch"], got["batch_in_epoch"]) == (ref["step"], ref["epoch"], ref["batch_in_epoch"]) \
        == (6, 1, 4)


def test_rank_0_alone_writes_one_set_of_files(runs):
    d, after_part, resumed = runs
    assert after_part["listing"] == [".lock", "best", "last", "metrics.jsonl", "step_000003", "tokenizer"]
    assert after_part["valid_steps"] == [3]
    assert after_part["stderr"].count("stopped: reached max_steps=3") == 1  # one rank logs
    assert after_part["stderr"].count("2 processes (gloo)") == 1
    assert sorted(os.listdir(d / "ddp")) == [".lock", "best", "last", "metrics.jsonl", "step_000003", "step_000006", "tokenizer"]
    assert valid_steps(d / "ddp") == [3, 6]  # one record per validation, none duplicated
    assert resumed.stderr.count("resuming from") == 1
    for name in ("best", "last", "step_000003", "step_000006"):
        read_checkpoint(d / "ddp" / name, need_trainer_state=True)  # manifests and checksums hold
    state = read_checkpoint(d / "ddp" / "last", need_trainer_state=True).trainer_state
    assert state["world_size"] == 2 and len(state["rank_rng"]) == 2  # each rank's dropout stream resumes
    assert all(t.device.type == "cpu" for t in state["optimizer"]["state"][0].values())


def test_resume_in_ddp_continues_to_the_same_weights(runs):
    d, _, _ = runs
    # ddp/step_000006 was written by the resumed run: it equals the uninterrupted reference
    assert max_diff(d / "ref" / "step_000006", d / "ddp" / "last") < ATOL


def test_resume_on_more_processes_keeps_the_update_with_a_smaller_update_freq(runs, tmp_path):
    """A run of one process with --update-freq 4, resumed on two with --update-freq 2: every update still
    takes 4 batches, so the weights are the uninterrupted run's."""
    d, _, _ = runs
    data = write_data(tmp_path)
    out = tmp_path / "one"
    assert main(["train", *data, *FLAGS, "--update-freq", "4", "--max-steps", "3", "--out", str(out)]) == 0
    resumed = torchrun(tmp_path, *data, "--resume", "--update-freq", "2", "--max-steps", "6", "--out", str(out))
    assert "update now takes 2 x 2 batches (was 4 x 1)" in resumed.stderr
    assert max_diff(d / "ref" / "step_000006", out / "last") < ATOL


def test_update_tokens_gives_two_processes_the_update_of_one(runs, tmp_path):
    """--update-tokens 384 with --update-freq 2 on two processes: each batch gets 384 / (2 x 2) = 96 tokens
    a side, so the update is the one-process reference's (--max-tokens 96, --update-freq 4) and so are the
    weights; the run records the share it computed, and one process would have taken 384 / 2 = 192."""
    d, _, _ = runs
    data = write_data(tmp_path)
    out = tmp_path / "shared"
    flags = [f for f in FLAGS]
    flags[flags.index("--max-tokens") + 1] = "4096"  # overridden by the share
    run = torchrun(tmp_path, *data, *flags, "--update-tokens", "384", "--update-freq", "2", "--max-steps", "3",
                   "--out", str(out))
    assert "update_tokens 384: 96 tokens a batch (per side, padded) x 2 x 2 process(es)" in run.stderr
    saved = json.loads((out / "last" / "config.json").read_text())["train"]
    assert (saved["update_tokens"], saved["max_tokens"]) == (384, 96)
    assert max_diff(d / "ref" / "step_000003", out / "last") < ATOL
    from qkv.config import TrainConfig, per_process_batch

    assert per_process_batch(TrainConfig(update_tokens=384, update_freq=2, max_len=40), 1).max_tokens == 192


def test_a_run_with_update_tokens_resumes_with_another_update_freq(tmp_path, capsys):
    """With update_tokens the update's size is in tokens: a resumed run may split it into more batches
    (--update-freq 2 after 1), which would be refused without it, and gets the halved share."""
    data = write_data(tmp_path)
    out = tmp_path / "run"
    assert main(["train", *data, *FLAGS, "--update-tokens", "192", "--max-steps", "2", "--out", str(out)]) == 0
    assert json.loads((out / "last" / "config.json").read_text())["train"]["max_tokens"] == 192
    capsys.readouterr()
    assert main(["train", *data, "--resume", "--update-freq", "2", "--max-steps", "3", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "update_tokens 192 is shared out as 96 tokens a batch" in err, err
    assert json.loads((out / "last" / "config.json").read_text())["train"]["max_tokens"] == 96


# --- the helpers without a process group ------------------------------------------------------------

def test_helpers_are_no_ops_for_one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = distributed.init_from_env(torch.device("cpu"))
    assert not info.distributed and info.is_main and not info.owns_group
    assert distributed.is_main() and distributed.get_world_size() == 1 and distributed.get_rank() == 0
    x = torch.tensor([3.0, 4.0])
    assert torch.equal(distributed.all_reduce_sum(x), x)
    assert distributed.any_rank(True) and not distributed.any_rank(False)
    assert distributed.from_main(7) == 7
    distributed.barrier()
    distributed.cleanup(info)


def test_device_requests_this_machine_cannot_serve_are_config_errors():
    assert distributed.resolve_device("cpu", "bf16") == torch.device("cpu")
    with pytest.raises(ConfigError, match="'device'"):
        distributed.resolve_device("tpu", "none")
    with pytest.raises(ConfigError, match="'amp'"):
        distributed.resolve_device("cpu", "fp16")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="'device'.*no CUDA"):
            distributed.resolve_device("cuda", "none")
        with pytest.raises(ConfigError, match="'amp'.*fp16"):
            distributed.resolve_device("auto", "fp16")


def _from_main_worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        got = distributed.from_main(5 if rank == 0 else 99)  # rank 1's own count is ignored
        Path(out, f"rank{rank}").write_text(str(got))
    finally:
        dist.destroy_process_group()


def test_from_main_gives_every_rank_the_count_of_rank_0(tmp_path):
    """What patience uses: rank 0 alone validates, and every rank must stop at the same update."""
    import torch.multiprocessing as mp

    mp.spawn(_from_main_worker, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["5", "5"]
