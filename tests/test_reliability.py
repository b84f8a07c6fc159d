"""Nothing lost: one writer per run directory, non-finite steps skipped and never saved, signals
that stop at an update boundary, and crashes at every checkpoint-writing stage that resume to the
very weights of an uninterrupted run."""

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.config import DecodeConfig, ModelConfig, TrainConfig
from qkv.data import toy
from qkv.errors import QkvError, TrainingDiverged
from qkv.training import trainer as trainer_mod
from qkv.checkpoint import FAULT_ENV, list_checkpoints, read_checkpoint, save_checkpoint
from qkv.training.rundir import RunLock, recover, truncate_metrics
from qkv.training.trainer import ParallelData, Trainer, train

QUIET = lambda msg: None  # noqa: E731

MODEL = ModelConfig(d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1, n_decoder_layers=1,
                    dropout=0.1, attention_dropout=0.1, max_positions=64)
TRAIN = TrainConfig(tokenizer="char", vocab_size=100, max_len=64, max_tokens=512, lr_scale=2.0,
                    warmup_steps=20, max_steps=10, eval_every=4, eval_bleu_samples=0, keep_last=2, seed=5)


def numbers(lo: int, hi: int, step: int = 1) -> ParallelData:
    return ParallelData([toy.english(n) for n in range(lo, hi, step)], [toy.german(n) for n in range(lo, hi, step)],
                        name=f"numbers {lo}..{hi}")


DATA, VALID = numbers(1, 300, 2), numbers(2, 300, 37)


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(path).state_dict


def assert_same_run(a: Path, b: Path) -> None:
    """The same checkpoints (last, best, step_N), bit for bit, and one metrics record per step."""
    names = lambda d: sorted(p.name for p in d.iterdir() if p.is_dir())  # noqa: E731
    assert names(a) == names(b)
    for name in names(a):
        wa, wb = weights(a / name), weights(b / name)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{name}: {k}"
    sa = read_checkpoint(a / "last", need_trainer_state=True).trainer_state
    sb = read_checkpoint(b / "last", need_trainer_state=True).trainer_state
    assert (sa["step"], sa["best_score"]) == (sb["step"], sb["best_score"])
    ma, mb = (metrics(d) for d in (a, b))
    assert [r["step"] for r in mb] == [r["step"] for r in ma]
    assert [r.get("valid_loss") for r in mb] == [r.get("valid_loss") for r in ma]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run that every interrupted one must end equal to."""
    out = tmp_path_factory.mktemp("reference") / "run"
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        train(MODEL, TRAIN, DecodeConfig(), DATA, VALID, out, log=QUIET)
    assert [p.name for p in list_checkpoints(out)] == ["step_000008", "step_000010"]
    return out


# --- 1. one writer per run directory -------------------------------------------------------------------

HOLD = "import sys, time\nfrom qkv.training.rundir import RunLock\nRunLock(sys.argv[1]).__enter__()\n" \
       "print('held', flush=True)\ntime.sleep(120)\n"


def test_a_second_train_on_a_locked_run_directory_exits_2_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for extra in ([], ["--resume"]):
            capsys.readouterr()
            rc = main(["train", "--out", str(out), "--preset", "tiny", "--max-steps", "1", *extra])
            err = capsys.readouterr().err
            assert rc == 2, err
            assert f"in use by another qkv process (pid {holder.pid})" in err and "Traceback" not in err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing read, nothing written
        holder.send_signal(signal.SIGKILL)  # the kernel releases the lock of a process that dies
        holder.wait(timeout=30)
        with RunLock(out):
            assert (out / ".lock").read_text().strip() == str(os.getpid())
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_is_reentrant_in_one_process_and_leaves_no_empty_directory(tmp_path):
    d = tmp_path / "new"
    with RunLock(d):
        with RunLock(d):  # the CLI takes it, then train() again
            assert (d / ".lock").exists()
    assert not d.exists()  # a start that wrote nothing leaves nothing
    with pytest.raises(QkvError, match="cannot create the run directory"):
        (tmp_path / "file").write_text("x")
        with RunLock(tmp_path / "file" / "run"):
            pass


# --- 2. non-finite losses and gradients ------------------------------------------------------------------

def test_divergence_skips_updates_then_stops_with_exit_3_and_saves_nothing_non_finite(tmp_path, capsys):
    src, tgt = tmp_path / "train.src", tmp_path / "train.tgt"
    src.write_text("".join(s + "\n" for s in DATA.src))
    tgt.write_text("".join(t + "\n" for t in DATA.tgt))
    out = tmp_path / "run"
    rc = main(["train", "--src-train", str(src), "--tgt-train", str(tgt), "--src-valid", str(src), "--tgt-valid",
               str(tgt), "--out", str(out), "--preset", "tiny", "--tokenizer", "char", "--max-tokens", "512",
               "--schedule", "constant", "--lr", "1e3", "--max-steps", "40", "--eval-every", "1", "--threads", "1",
               "--nonfinite-limit", "4"])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "Traceback" not in err and "training diverged: 4 updates in a row" in err
    assert err.count("update skipped") == 4 and "non-finite" in err
    for ckpt in [p for p in out.iterdir() if p.is_dir()]:  # whatever was saved before it diverged is finite
        assert all(torch.isfinite(t).all() for t in weights(ckpt).values()), ckpt
    assert "checkpoints in" not in err  # no final line naming a best/ that does not exist


def test_a_non_finite_step_is_skipped_and_the_count_resets(tmp_path, monkeypatch):
    """Steps 3 and 4 (calls 3, 4) get a NaN loss: no update, no step counted; then training goes on."""
    real_loss, calls, logs = Trainer.loss, [0], []

    def loss(self, batch, train=False):
        value, nll = real_loss(self, batch, train)
        if train:
            calls[0] += 1
            if calls[0] in (3, 4):
                value = value * float("nan")
        return value, nll

    snapshots = []
    real_step = Trainer.train_step

    def train_step(self, group):
        before = {k: v.clone() for k, v in self.model.state_dict().items()}
        stats = real_step(self, group)
        snapshots.append((stats["skipped"], all(torch.equal(before[k], v) for k, v in self.model.state_dict().items())))
        return stats

    monkeypatch.setattr(Trainer, "loss", loss)
    monkeypatch.setattr(Trainer, "train_step", train_step)
    cfg = dataclasses.replace(TRAIN, max_steps=5, nonfinite_limit=3, keep_last=0)
    result = train(MODEL, cfg, DecodeConfig(), DATA, None, tmp_path / "run", log=logs.append)
    assert result.step == 5
    assert snapshots == [(False, False)] * 2 + [(True, True)] * 2 + [(False, False)] * 3
    assert [m for m in logs if "update skipped" in m][1].startswith("warning: step 3: non-finite loss nan")
    state = read_checkpoint(tmp_path / "run" / "last", need_trainer_state=True).trainer_state
    assert state["step"] == 5 and state["nonfinite"] == 0


def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch):
    real_step = Trainer.train_step

    def poison(self, group):
        stats = real_step(self, group)
        if self.step == 4:  # poisoned after the update, just before the validation and saves of step 4
            with torch.no_grad():
                next(self.model.parameters())[0] = float("inf")
        return stats

    monkeypatch.setattr(Trainer, "train_step", poison)
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match="weights are not finite"):
        train(MODEL, dataclasses.replace(TRAIN, max_steps=6, eval_every=2), DecodeConfig(), DATA, VALID, out,
              log=QUIET)
    assert read_checkpoint(out / "last", need_trainer_state=True).trainer_state["step"] == 2
    assert torch.equal(weights(out / "best")["encoder_layers.0.ffn.w_1.weight"],
                       weights(out / "last")["encoder_layers.0.ffn.w_1.weight"])


# --- 3. signals stop at an update boundary -------------------------------------------------------------

def _kill_self():
    os.kill(os.getpid(), signal.SIGTERM)


def _signal_in_forward(monkeypatch, call: int, times: int = 1):
    """SIGTERM after the forward pass of the ``call``-th training batch: its dropout masks are drawn."""
    real, n = Trainer.loss, [0]

    def loss(self, batch, train=False):
        out = real(self, batch, train)
        if train:
            n[0] += 1
            if n[0] == call:
                for _ in range(times):
                    _kill_self()
        return out

    monkeypatch.setattr(Trainer, "loss", loss)


def _signal_after_optimizer_step(call: int):
    """SIGTERM between optimizer.step() and the step counter."""
    n = [0]

    def hook(optimizer, args, kwargs):
        n[0] += 1
        if n[0] == call:
            _kill_self()

    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(hook)


def _signal_in(monkeypatch, obj, name: str, call: int):
    real, n = getattr(obj, name), [0]

    def wrapped(*args, **kwargs):
        n[0] += 1
        if n[0] == call:
            _kill_self()
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)


@pytest.mark.parametrize("where", ["forward", "after optimizer.step", "gradient clipping", "validation",
                                   "checkpoint save", "twice"])
def test_sigterm_anywhere_resumes_to_the_uninterrupted_weights(where, reference, tmp_path, monkeypatch):
    handle = None
    if where == "forward":
        _signal_in_forward(monkeypatch, call=6)
    elif where == "twice":  # the second signal stops at once: last/ holds the step-4 commit
        _signal_in_forward(monkeypatch, call=6, times=2)
    elif where == "after optimizer.step":
        handle = _signal_after_optimizer_step(call=7)
    elif where == "gradient clipping":
        _signal_in(monkeypatch, Trainer, "_grad_norm", call=3)
    elif where == "validation":
        _signal_in(monkeypatch, Trainer, "validate", call=1)
    else:  # while step_000004/ is written (best/ is the first save of step 4, step_000004/ the second)
        _signal_in(monkeypatch, trainer_mod, "save_checkpoint", call=2)
    out, logs = tmp_path / "run", []
    try:
        with pytest.raises(KeyboardInterrupt):
            train(MODEL, TRAIN, DecodeConfig(), DATA, VALID, out, log=logs.append)
    finally:
        if handle is not None:
            handle.remove()
    monkeypatch.undo()
    stopped = read_checkpoint(out / "last", need_trainer_state=True).trainer_state["step"]
    expected = {"forward": 6, "twice": 4, "after optimizer.step": 7, "gradient clipping": 3, "validation": 4,
                "checkpoint save": 4}[where]
    assert stopped == expected, logs
    if where == "twice":
        assert any("interrupted again at step 5" in m for m in logs), logs
    train(MODEL, TRAIN, DecodeConfig(), DATA, VALID, out, resume=True, log=QUIET)
    assert_same_run(reference, out)


STOP_IN_HELD_OUT_TEST = (
    "import os, signal, sys\n"
    "import qkv.data.toy as toy\n"
    "real = toy.held_out_report\n"
    "def report(model, out):  # SIGTERM reaches the process as the held-out test begins\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "    return real(model, out)\n"
    "toy.held_out_report = report\n"
    "from qkv.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


def test_sigterm_after_training_exits_130_as_documented(tmp_path):
    """SIGTERM at any stage of a command is an interruption (exit status 130), also once training is
    over and the embedded task's held-out test runs, where no training handler is installed any more."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", STOP_IN_HELD_OUT_TEST, "train", "--max-steps", "1", "--eval-every",
                           "1", "--eval-bleu-samples", "0", "--threads", "1", "--out", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 130, proc.stderr
    assert "qkv train: interrupted" in proc.stderr and "Traceback" not in proc.stderr
    assert read_checkpoint(out / "last", need_trainer_state=True).trainer_state["step"] == 1


# --- 4. crashes at each checkpoint-writing stage ---------------------------------------------------------

@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    files = {}
    for name, lines in (("train.src", DATA.src), ("train.tgt", DATA.tgt), ("valid.src", VALID.src),
                        ("valid.tgt", VALID.tgt)):
        (d / name).write_text("".join(s + "\n" for s in lines), encoding="utf-8")
        files[name] = str(d / name)
    return d, files


def cli_argv(files: dict, out: Path, *extra: str) -> list[str]:
    return ["train", "--src-train", files["train.src"], "--tgt-train", files["train.tgt"], "--src-valid",
            files["valid.src"], "--tgt-valid", files["valid.tgt"], "--out", str(out), "--preset", "tiny",
            "--tokenizer", "char", "--vocab-size", "60", "--max-tokens", "512", "--dropout", "0.1",
            "--max-steps", "9", "--eval-every", "3", "--keep-last", "2", "--eval-bleu-samples", "0",
            "--threads", "1", "--seed", "7", *extra]


@pytest.fixture(scope="module")
def cli_reference(cli_files):
    d, files = cli_files
    out = d / "reference"
    assert main(cli_argv(files, out)) == 0
    return out


@pytest.mark.parametrize("fault, committed", [("saved:start@1", 0), ("saved:best@2", 3), ("saved:step@2", 3),
                                              ("swap:best@1", 3), ("swap:last@2", 6), ("saved:last@2", 6),
                                              ("swap:last@3", 9)])
def test_a_kill_at_each_checkpoint_writing_stage_resumes_exactly(fault, committed, cli_files, cli_reference, tmp_path):
    """SIGKILL right after the start is committed (last/ at step 0); at the second validation's saves
    (step 6): after best/, after step_6/, between the two renames of best/ or of last/ (the first save
    of each is a plain rename), after last/ (before the oldest step_N/ is pruned); and between the
    renames of the final last/ (step 9). The resumed run ends with the reference's last/, best/,
    step_N/ and metrics, bit for bit."""
    _, files = cli_files
    out = tmp_path / "run"
    env = {**os.environ, FAULT_ENV: fault, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "qkv", *cli_argv(files, out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if fault.startswith("swap:last"):
        assert not (out / "last").exists()  # killed between the renames: no last/ until recovered
    recover(out, QUIET)  # as the next start does: a swap cut short is finished
    assert read_checkpoint(out / "last", need_trainer_state=True).trainer_state["step"] == committed
    assert main(cli_argv(files, out, "--resume")) == 0
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]  # no leftovers
    assert_same_run(cli_reference, out)


def test_checkpoints_get_the_usual_permissions(cli_reference):
    mask = os.umask(0)
    os.umask(mask)
    for ckpt in [cli_reference / "last", cli_reference / "best"]:
        assert stat.S_IMODE(ckpt.stat().st_mode) == 0o777 & ~mask
        for f in ckpt.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, f


# --- recovery of half-done swaps, metrics -----------------------------------------------------------------

def _ckpt(path: Path, value: float) -> Path:
    layer = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(layer.weight, value)
    return save_checkpoint(path, layer, {"value": value})


def test_recover_finishes_a_complete_swap_and_rolls_back_an_incomplete_one(tmp_path):
    logs = []
    # last: killed between the renames, new copy complete -> finished
    _ckpt(tmp_path / ".last.tmp-abc", 2.0)
    _ckpt(tmp_path / ".last.tmp-abc.old", 1.0)
    # best: killed between the renames, new copy incomplete -> previous copy put back
    _ckpt(tmp_path / ".best.tmp-def", 4.0)
    (tmp_path / ".best.tmp-def" / "model.safetensors").write_bytes(b"torn")
    _ckpt(tmp_path / ".best.tmp-def.old", 3.0)
    # step_000004: the swap was done, deleting the old copy was not; plus a save that never finished
    _ckpt(tmp_path / "step_000004", 5.0)
    _ckpt(tmp_path / ".step_000004.tmp-ghi.old", 6.0)
    (tmp_path / ".step_000008.tmp-jkl").mkdir()
    recover(tmp_path, logs.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "last", "step_000004"]
    assert read_checkpoint(tmp_path / "last").config["value"] == 2.0
    assert read_checkpoint(tmp_path / "best").config["value"] == 3.0
    assert read_checkpoint(tmp_path / "step_000004").config["value"] == 5.0
    assert any("finished a save" in m for m in logs) and any("put the previous checkpoint back" in m for m in logs)


def test_metrics_after_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train_loss": 1.0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "tr')
    assert truncate_metrics(path, 2) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


# --- 7. smaller: empty validation data, other data on --resume ------------------------------------------------

def test_empty_validation_data_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(QkvError, match="no validation examples"):
        train(MODEL, TRAIN, DecodeConfig(), DATA, ParallelData([], [], name="valid"), tmp_path / "run", log=QUIET)
    assert not (tmp_path / "run").exists()


def test_resume_on_other_training_data_is_refused(tmp_path):
    out = tmp_path / "run"
    train(MODEL, dataclasses.replace(TRAIN, max_steps=2), DecodeConfig(), DATA, None, out, log=QUIET)
    with pytest.raises(QkvError, match="differ from the data"):
        train(MODEL, dataclasses.replace(TRAIN, max_steps=4), DecodeConfig(), numbers(1, 300, 3), None, out,
              resume=True, log=QUIET)
    assert read_checkpoint(out / "last", need_trainer_state=True).trainer_state["step"] == 2


def test_resume_reads_only_the_tokenizer_the_manifest_lists(tmp_path):
    """A joint model file copied into last/ beside a run's separate source and target models is not
    part of the checkpoint: the resumed run ends as the uninterrupted one."""
    from qkv.data.tokenizer import TokenizerPair

    cfg = dataclasses.replace(TRAIN, joint_vocab=False, max_steps=4, eval_every=2, keep_last=0)
    train(MODEL, cfg, DecodeConfig(), DATA, None, tmp_path / "full", log=QUIET)
    part = tmp_path / "part"
    train(MODEL, dataclasses.replace(cfg, max_steps=2), DecodeConfig(), DATA, None, part, log=QUIET)
    stray = (part / "last" / TokenizerPair.TGT_FILE).read_bytes()  # the target side's pieces, for both sides
    (part / "last" / TokenizerPair.JOINT_FILE).write_bytes(stray)
    train(MODEL, cfg, DecodeConfig(), DATA, None, part, resume=True, log=QUIET)
    a, b = weights(tmp_path / "full" / "last"), weights(part / "last")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_disk_during_a_save_is_named_and_keeps_the_previous_checkpoints(cli_files, tmp_path, monkeypatch,
                                                                                capsys):
    """safetensors reports a full disk as its own error type: the message still says so, names the
    checkpoint, exits 2, and last/ keeps its previous commit; --resume then goes on."""
    from safetensors import SafetensorError

    from qkv import checkpoint

    _, files = cli_files
    real, calls = checkpoint.save_file, [0]

    def save_file(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # last/ at step 0, best/ at step 3, then step_000003/
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    out = tmp_path / "run"
    rc = main(cli_argv(files, out))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert f"cannot write the checkpoint {out / 'step_000003'}: no space left on device" in err
    assert read_checkpoint(out / "last", need_trainer_state=True).trainer_state["step"] == 0
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    monkeypatch.undo()
    assert main(cli_argv(files, out, "--resume")) == 0


def test_an_unwritable_metrics_file_is_named(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").mkdir()  # cannot be opened for appending
    with pytest.raises(QkvError, match="cannot write .*metrics.jsonl"):
        train(MODEL, dataclasses.replace(TRAIN, max_steps=2), DecodeConfig(), DATA, None, out, log=QUIET)


def test_a_run_directory_without_last_is_never_started_over(tmp_path):
    """best/ and step_N/ without last/ (deleted by hand, or left by an older qkv): neither a new run
    nor --resume replaces them, and the message does not advise what would."""
    out = tmp_path / "run"
    train(MODEL, dataclasses.replace(TRAIN, max_steps=4), DecodeConfig(), DATA, VALID, out, log=QUIET)
    before = {p.name: weights(p) for p in out.iterdir() if p.is_dir() and p.name != "last"}
    shutil.rmtree(out / "last")
    with pytest.raises(QkvError, match="holds checkpoints .*best.* of a run that has no last/"):
        train(MODEL, TRAIN, DecodeConfig(), DATA, VALID, out, log=QUIET)
    with pytest.raises(QkvError, match="cannot resume") as e:
        train(MODEL, TRAIN, DecodeConfig(), DATA, VALID, out, resume=True, log=QUIET)
    assert "another --out" in str(e.value) and "without --resume first" not in str(e.value)
    after = {p.name: weights(p) for p in out.iterdir() if p.is_dir()}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])
