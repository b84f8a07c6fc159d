"""Bad output paths, full disks and damaged checkpoints: a clear ``qkv CMD: error: ...`` and exit
status 2, never a traceback, and nothing already written lost (:mod:`qkv.files` and its callers).

Two tiny models are trained once per module (a word-reversal translator, a two-label classifier);
the CLI runs in-process through ``qkv.cli.main``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import qkv.files
from qkv.cli import main
from qkv.errors import QkvError
from qkv.files import atomic_output, check_output_dir, check_output_file

WORDS = ["red", "blue", "cat", "dog", "sun", "tree"]
TRAIN_FLAGS = ["--preset", "tiny", "--max-steps", "20", "--eval-every", "20", "--vocab-size", "60",
               "--tokenizer", "char", "--max-tokens", "512", "--eval-bleu-samples", "0", "--threads", "1"]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc: int, err: str, command: str, *needles: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    assert f"qkv {command}: error:" in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def leftovers(directory: Path) -> list[str]:
    """Temporary files an output left behind."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny translator and a tiny classifier, trained once."""
    d = tmp_path_factory.mktemp("safety")
    rng = random.Random(0)
    src = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(120)]
    write_lines(d / "train.src", src)
    write_lines(d / "train.tgt", [" ".join(reversed(s.split())) for s in src])
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", "--src-train", str(d / "train.src"), "--tgt-train", str(d / "train.tgt"),
                     *TRAIN_FLAGS, "--out", str(d / "mt")]) == 0
        rows = [json.dumps({"text": f"the film was {a}", "label": a})
                for a in [rng.choice(["great", "bad"]) for _ in range(40)]]
        write_lines(d / "train.jsonl", rows)
        assert main(["train", "--task", "classify", *TRAIN_FLAGS, "--train", str(d / "train.jsonl"),
                     "--out", str(d / "clf")]) == 0
    return types.SimpleNamespace(dir=d, mt=d / "mt" / "best", clf=d / "clf" / "best", src=src)


# --- atomic outputs ----------------------------------------------------------------------------------

def test_atomic_output_replaces_only_on_success(tmp_path):
    dst = write_lines(tmp_path / "out.txt", ["old"])
    os.chmod(dst, 0o640)
    with atomic_output(dst) as fh:
        fh.write("new\n")
        assert dst.read_text() == "old\n"  # not yet: the data go to a temporary file
    assert dst.read_text() == "new\n"
    assert oct(dst.stat().st_mode & 0o777) == oct(0o640)  # the replaced file's permissions
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(dst) as fh:
            fh.write("partial\n")
            raise KeyboardInterrupt
    assert dst.read_text() == "new\n"
    assert leftovers(tmp_path) == []


def test_atomic_output_follows_a_symlink(tmp_path):
    real = write_lines(tmp_path / "real.txt", ["old"])
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    with atomic_output(link) as fh:
        fh.write("new\n")
    assert link.is_symlink() and real.read_text() == "new\n"


def test_atomic_output_writes_devices_in_place(tmp_path):
    with atomic_output("/dev/null") as fh:
        fh.write("nothing\n")
    assert Path("/dev/null").is_char_device()  # written, not renamed over
    with pytest.raises(QkvError, match="/dev/full: no space left on device \\(disk full\\)"):
        with atomic_output("/dev/full") as fh:
            fh.write("x" * 100_000)


def test_atomic_output_disk_full_names_the_file_and_keeps_it(tmp_path, monkeypatch):
    dst = write_lines(tmp_path / "out.txt", ["old"])

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(qkv.files.os, "fsync", full)
    with pytest.raises(QkvError, match=f"{dst}: no space left on device \\(disk full\\)"):
        with atomic_output(dst) as fh:
            fh.write("new\n")
    assert dst.read_text() == "old\n"
    assert leftovers(tmp_path) == []


def test_translate_output_same_as_input_refused(run, capsys, tmp_path):
    inp = write_lines(tmp_path / "in.txt", run.src[:3])
    before = inp.read_bytes()
    alias = tmp_path / "alias.txt"
    alias.symlink_to(inp)
    for output in (inp, alias):
        rc, _, err = cli(capsys, "translate", run.mt, "--input", inp, "--output", output)
        assert_user_error(rc, err, "translate", f"--output {output}", "same file", f"--input {inp}")
        assert inp.read_bytes() == before


def test_classify_and_embed_output_same_as_input_refused(run, capsys, tmp_path):
    inp = write_lines(tmp_path / "in.tsv", ["the film was great", "the film was bad"])
    before = inp.read_bytes()
    rc, _, err = cli(capsys, "classify", run.clf, "--input", inp, "--output", inp)
    assert_user_error(rc, err, "classify", "same file", str(inp))
    rc, _, err = cli(capsys, "embed", run.clf, "--input", inp, "--output", inp)
    assert_user_error(rc, err, "embed", "same file", str(inp))
    assert inp.read_bytes() == before


def test_evaluate_output_over_the_references_refused(run, capsys, tmp_path):
    src = write_lines(tmp_path / "src.txt", run.src[:2])
    ref = write_lines(tmp_path / "ref.txt", ["cat red", "dog"])
    rc, _, err = cli(capsys, "evaluate", run.mt, "--src", src, "--ref", ref, "--output", ref)
    assert_user_error(rc, err, "evaluate", "same file", "--ref")
    assert ref.read_text() == "cat red\ndog\n"


def test_translate_interrupted_keeps_the_previous_output(run, capsys, tmp_path, monkeypatch):
    """The output replaces the old file only once complete: an interrupt in the second chunk of
    a long input leaves the old file (and no temporary file) behind."""
    from qkv.frontends import Translator

    inp = write_lines(tmp_path / "in.txt", run.src[:2] * 300)  # two chunks of batch_size * 8 lines
    dst = write_lines(tmp_path / "out.txt", ["previous translations"])
    real, calls = Translator.translate_scored, []

    def interrupted(self, sentences, **kw):
        calls.append(len(sentences))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, sentences, **kw)

    monkeypatch.setattr(Translator, "translate_scored", interrupted)
    rc, _, err = cli(capsys, "translate", run.mt, "--input", inp, "--output", dst, "--beam-size", "1")
    assert rc == 130 and "interrupted" in err
    assert dst.read_text() == "previous translations\n"
    assert leftovers(tmp_path) == []


def test_translate_stopped_by_sigterm_leaves_no_temporary_file(run, tmp_path, signal_when):
    """SIGTERM (kill, timeout, a scheduler) while a long --input is being translated: the temporary
    file holding the lines done so far is removed, the previous output stays, exit status 130."""
    inp = write_lines(tmp_path / "in.txt", run.src * 200)
    dst = write_lines(tmp_path / "out.txt", ["previous translations"])

    def translating() -> bool:  # some lines are written to the temporary file
        return any(p.suffix == ".tmp" and p.stat().st_size > 0 for p in tmp_path.iterdir())

    rc, err = signal_when(["translate", run.mt, "--input", inp, "--output", dst, "--beam-size", "1"],
                          translating)
    assert rc == 130, err
    assert "qkv translate: interrupted" in err and "Traceback" not in err
    assert dst.read_text() == "previous translations\n"
    assert leftovers(tmp_path) == []


def test_a_stale_temporary_output_is_removed_by_the_next_write(run, capsys, tmp_path, pids):
    """The temporary file of a writer killed outright (kill -9) goes at the next write of the same
    output; that of a process still running, or of another output, stays."""
    dead, live = pids
    stale, alive, other = (tmp_path / f".out.txt.{dead}.abc123.tmp", tmp_path / f".out.txt.{live}.abc123.tmp",
                           tmp_path / f".other.txt.{dead}.abc123.tmp")
    for p in (stale, alive, other):
        p.write_text("lines done so far\n")
    rc, _, err = cli(capsys, "translate", run.mt, "red cat", "--output", tmp_path / "out.txt")
    assert rc == 0, err
    assert not stale.exists() and alive.exists() and other.exists()
    assert (tmp_path / "out.txt").read_text().count("\n") == 1


def test_translate_and_embed_write_complete_files(run, capsys, tmp_path):
    inp = write_lines(tmp_path / "in.txt", run.src[:3])
    dst = tmp_path / "out.txt"
    rc, _, err = cli(capsys, "translate", run.mt, "--input", inp, "--output", dst)
    assert rc == 0, err
    assert len(dst.read_text().splitlines()) == 3
    texts = write_lines(tmp_path / "texts.txt", ["the film was great", "the film was bad"])
    rc, _, err = cli(capsys, "embed", run.clf, "--input", texts, "--output", tmp_path / "v.npy")
    assert rc == 0, err
    assert np.load(tmp_path / "v.npy").shape[0] == 2
    assert leftovers(tmp_path) == []


# --- qkv average --out ---------------------------------------------------------------------------------

def test_average_refuses_to_overwrite_what_it_averages(run, capsys, tmp_path):
    import shutil

    rundir = shutil.copytree(run.mt.parent, tmp_path / "run")
    before = {p: p.read_bytes() for p in rundir.rglob("*") if p.is_file()}
    best, last = rundir / "best", rundir / "last"
    for out in (last, best / "avg"):
        rc, _, err = cli(capsys, "average", best, last, "--out", out)
        assert_user_error(rc, err, "average", f"--out {out}", "being averaged")
    rc, _, err = cli(capsys, "average", best, last, "--out", rundir / "step_000005")
    assert_user_error(rc, err, "average", "a checkpoint of the run being averaged")
    (rundir / "step_000020").mkdir()  # a run directory given whole: none of its checkpoints may be the output
    shutil.copytree(last, rundir / "step_000020", dirs_exist_ok=True)
    rc, _, err = cli(capsys, "average", rundir, "--last", "1", "--out", best)
    assert_user_error(rc, err, "average", "run being averaged")
    assert all(p.read_bytes() == b for p, b in before.items())
    rc, _, err = cli(capsys, "average", best, last, "--out", tmp_path / "avg")
    assert rc == 0, err
    rc, _, err = cli(capsys, "average", rundir, "--last", "1", "--out", rundir / "avg1")  # a new name in the run
    assert rc == 0, err


def test_average_never_writes_into_another_run(run, capsys, tmp_path):
    """A training checkpoint (it has trainer state: a run resumes from it) and the directory of another
    run, locked or not, are refused as --out, by name, with nothing written; the run still resumes."""
    import shutil

    from qkv.checkpoint import read_checkpoint

    mine = shutil.copytree(run.mt.parent, tmp_path / "mine")
    other = shutil.copytree(run.clf.parent, tmp_path / "other")
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    copied = shutil.copytree(other / "last", tmp_path / "copy-of-last")  # trainer state outside any run
    for out, needle in ((other / "last", "training checkpoint"), (other / "best", "training checkpoint"),
                        (copied, "training checkpoint"), (other / "avg", f"inside the run directory {other}"),
                        (other / "averages" / "avg", f"inside the run directory {other}"),
                        (other, f"is the run directory {other}")):
        rc, _, err = cli(capsys, "average", mine / "best", mine / "last", "--out", out)
        assert_user_error(rc, err, "average", f"--out {out}", needle)
        assert len(err.strip().splitlines()) == 1
    (other / ".lock").unlink()  # a run that is not running: its metrics and checkpoints still say what it is
    rc, _, err = cli(capsys, "average", mine / "best", mine / "last", "--out", other / "avg")
    assert_user_error(rc, err, "average", f"inside the run directory {other}")
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == {
        p: b for p, b in before.items() if p.name != ".lock"}
    assert read_checkpoint(other / "last", need_trainer_state=True).trainer_state is not None
    # a run that is starting (its lock held, nothing written yet)
    hold = "import sys, time\nfrom qkv.training.rundir import RunLock\nRunLock(sys.argv[1]).__enter__()\n" \
           "print('held', flush=True)\ntime.sleep(120)\n"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "starting")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, _, err = cli(capsys, "average", mine / "best", mine / "last", "--out", tmp_path / "starting" / "avg")
        assert_user_error(rc, err, "average", f"inside the run directory {tmp_path / 'starting'}")
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in (tmp_path / "starting").iterdir()) == [".lock"]
    # what the docs promise: a new directory, a new name in the averaged run's own directory, an average
    # again; a directory with a .lock file that no process holds (other tools make them too) is no run
    for out in (tmp_path / "avg", mine / "avg1", mine / "avg1", tmp_path / "starting" / "avg"):
        rc, _, err = cli(capsys, "average", mine / "best", mine / "last", "--out", out)
        assert rc == 0, err


# --- early output checks -------------------------------------------------------------------------------

def test_translate_output_directory_refused_before_loading(capsys, tmp_path):
    """The output is checked first: the (missing) model is never looked at."""
    missing_model = tmp_path / "no-model"
    rc, _, err = cli(capsys, "translate", missing_model, "red", "--output", tmp_path)
    assert_user_error(rc, err, "translate", f"--output {tmp_path}", "is a directory")
    assert "not found" not in err
    rc, _, err = cli(capsys, "classify", missing_model, "x", "--output", tmp_path / "no-dir" / "labels.txt")
    assert_user_error(rc, err, "classify", str(tmp_path / "no-dir"), "does not exist")
    afile = write_lines(tmp_path / "afile", ["x"])
    rc, _, err = cli(capsys, "evaluate", missing_model, "--src", afile, "--ref", afile, "--output", afile / "hyp.txt")
    assert_user_error(rc, err, "evaluate", str(afile), "not a directory")
    rc, _, err = cli(capsys, "embed", missing_model, "--input", afile, "--output", tmp_path / "no-dir" / "v.npy")
    assert_user_error(rc, err, "embed", "does not exist")


def test_train_out_checked_before_reading_data(capsys, tmp_path):
    """--out that cannot be a directory fails before the (missing) data files are read."""
    afile = write_lines(tmp_path / "afile", ["x"])
    missing = tmp_path / "missing.src"
    for out, needle in ((afile, "exists and is not a directory"), (afile / "run", "is a file, not a directory")):
        rc, _, err = cli(capsys, "train", "--src-train", missing, "--tgt-train", missing, "--out", out)
        assert_user_error(rc, err, "train", f"--out {out}", needle)
        assert "missing.src" not in err
    assert afile.read_text() == "x\n"


def test_unwritable_directory_found_by_trying(tmp_path, monkeypatch):
    """Root passes os.access everywhere: the check creates a file to find out."""
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(qkv.files.tempfile, "mkstemp", denied)
    with pytest.raises(QkvError, match=f"cannot create files in {tmp_path}: permission denied"):
        check_output_file(tmp_path / "out.txt")
    with pytest.raises(QkvError, match=f"--out {tmp_path / 'a' / 'b'}: cannot create files in {tmp_path}"):
        check_output_dir(tmp_path / "a" / "b")


def test_special_outputs_pass_the_checks(tmp_path):
    for path in ("/dev/null", "/dev/stdout"):
        check_output_file(path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    check_output_file(fifo)
    assert qkv.files.is_special(fifo)


# --- disk full and other OS errors ---------------------------------------------------------------------

def test_translate_to_dev_full(run, capsys):
    rc, out, err = cli(capsys, "translate", run.mt, "red cat", "--output", "/dev/full")
    assert_user_error(rc, err, "translate", "/dev/full: no space left on device (disk full)")


def test_classify_disk_full_keeps_the_old_labels(run, capsys, tmp_path, monkeypatch):
    dst = write_lines(tmp_path / "labels.txt", ["old labels"])

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(qkv.files.os, "fsync", full)
    rc, _, err = cli(capsys, "classify", run.clf, "the film was great", "--output", dst)
    assert_user_error(rc, err, "classify", f"{dst}: no space left on device (disk full)")
    assert dst.read_text() == "old labels\n"
    assert leftovers(tmp_path) == []


def test_unexpected_os_error_is_a_message(capsys, monkeypatch):
    import qkv.cli

    def broken(args):
        raise OSError(errno.EIO, os.strerror(errno.EIO), "/data/somefile")

    monkeypatch.setattr(qkv.cli, "cmd_info", broken)
    rc, _, err = cli(capsys, "info")
    assert_user_error(rc, err, "info", "/data/somefile: input/output error")

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(qkv.cli, "cmd_info", full)
    rc, _, err = cli(capsys, "info")
    assert_user_error(rc, err, "info", "disk full")


# --- config values that crash torch ------------------------------------------------------------------

@pytest.mark.parametrize("cls", ["ModelConfig", "TrainConfig", "DecodeConfig"])
def test_every_float_field_must_be_finite(cls):
    import dataclasses
    import math

    import qkv.config
    from qkv.errors import ConfigError

    klass = getattr(qkv.config, cls)
    floats = [f.name for f in dataclasses.fields(klass) if f.type == "float"]
    assert floats
    for name in floats:
        for bad in (math.inf, -math.inf, math.nan):
            with pytest.raises(ConfigError, match=f"'{name}': must be a finite number"):
                dataclasses.replace(klass(), **{name: bad}).validate()


def test_threads_seed_and_positions_bounded():
    import dataclasses

    from qkv.config import MODEL_PRESETS, TRAIN_PRESETS, ModelConfig, TrainConfig
    from qkv.errors import ConfigError

    with pytest.raises(ConfigError, match="'threads': must be a whole number from 0 to 1024"):
        TrainConfig(threads=100_000).validate()
    TrainConfig(threads=1024).validate()
    for seed in (10**30, 2**63, -1):
        with pytest.raises(ConfigError, match="'seed'"):
            TrainConfig(seed=seed).validate()
    TrainConfig(seed=2**63 - 1).validate()
    with pytest.raises(ConfigError, match="'max_positions': must be a whole number from 1 to 65536"):
        ModelConfig(max_positions=10**9).validate()
    for cfg in (*MODEL_PRESETS.values(), *TRAIN_PRESETS.values()):  # every preset stays valid
        dataclasses.replace(cfg).validate()


def test_cli_refuses_crashing_values_by_name(run, capsys):
    for flag, value, field in (("--threads", "100000", "threads"), ("--seed", str(10**30), "seed"),
                               ("--max-positions", str(10**9), "max_positions"), ("--lr-scale", "inf", "lr_scale")):
        rc, _, err = cli(capsys, "train", flag, value, "--out", run.dir / "never")
        assert_user_error(rc, err, "train", flag)
    assert not (run.dir / "never").exists()
    rc, _, err = cli(capsys, "translate", run.mt, "red", "--length-penalty", "nan")
    assert_user_error(rc, err, "translate", "--length-penalty", "finite")
    rc, _, err = cli(capsys, "generate", run.mt, "--seed", str(10**30))
    assert_user_error(rc, err, "generate", "--seed")
    rc, _, err = cli(capsys, "bench", "layers", "--threads", "100000")
    assert_user_error(rc, err, "bench", "--threads")


def test_huge_output_budget_is_capped(run, capsys):
    """The decoder caps every budget at 1024 tokens; a --max-len-a or --max-len-b above 1024 could only
    ever mean that cap, so it is refused by name rather than accepted silently."""
    import torch

    from qkv.decoding import MAX_OUTPUT_LEN, max_output_len

    assert MAX_OUTPUT_LEN == 1024
    assert max_output_len(torch.tensor([3, 10]), 1e300, 50).tolist() == [MAX_OUTPUT_LEN] * 2
    assert max_output_len(torch.tensor([3, 10]), 1.0, 10**30).tolist() == [MAX_OUTPUT_LEN] * 2
    assert max_output_len(torch.tensor([3, 10]), 1.0, 50, limit=torch.tensor([20, 5])).tolist() == [20, 5]
    for flag, value, field in (("--max-len-a", "1e300", "max_len_a"), ("--max-len-a", "1025", "max_len_a"),
                               ("--max-len-b", str(10**30), "max_len_b"), ("--max-len-b", "1025", "max_len_b")):
        rc, out, err = cli(capsys, "translate", run.mt, "red cat", "--beam-size", "2", flag, value)
        assert_user_error(rc, err, "translate", flag, "1024")
        assert out == ""
    rc, out, err = cli(capsys, "translate", run.mt, "red cat", "--max-len-a", "1024", "--max-len-b", "1024")
    assert rc == 0, err
    assert out.count("\n") == 1


def test_valid_fraction_must_be_a_fraction(capsys, tmp_path):
    """Refused by name before anything is read (the training text named here does not exist)."""
    for value in ("nan", "inf", "-0.1", "1"):
        rc, _, err = cli(capsys, "train", "--task", "lm", "--train", tmp_path / "missing.txt", "--valid-fraction",
                         value, "--out", tmp_path / "never")
        assert_user_error(rc, err, "train", "--valid-fraction", value)
    assert not (tmp_path / "never").exists()


def test_learned_positions_shorter_than_max_len_refused(run, capsys):
    from qkv.config import ModelConfig, TrainConfig
    from qkv.errors import ConfigError
    from qkv.tasks import get_task

    d = run.dir
    rc, _, err = cli(capsys, "train", "--src-train", d / "train.src", "--tgt-train", d / "train.tgt", *TRAIN_FLAGS,
                     "--positional", "learned", "--max-positions", "4", "--out", d / "short")
    assert_user_error(rc, err, "train", "'max_positions'", "max_positions=4", "max_len=256", "257")
    assert not (d / "short").exists()
    # the library check, per task: specials on top of max_len (prefix_lm: two sides and three)
    for task, need in (("translate", 11), ("classify", 11), ("lm", 10), ("prefix_lm", 23)):
        cfg = ModelConfig(task=task, positional="learned", max_positions=need)
        get_task(task).check_positions(cfg, TrainConfig(max_len=10))
        with pytest.raises(ConfigError, match=f"at least {need}"):
            get_task(task).check_positions(ModelConfig(task=task, positional="learned", max_positions=need - 1),
                                           TrainConfig(max_len=10))
    with pytest.raises(ConfigError, match="location-based attention"):
        get_task("translate").check_positions(ModelConfig(arch="lstm", attention="location", max_positions=8),
                                              TrainConfig(max_len=10))


# --- learned positions at decoding time ----------------------------------------------------------------

@pytest.fixture(scope="module")
def learned(run):
    """A translator and a classifier with 16 learned positions (max_len 12)."""
    d = run.dir
    flags = [*TRAIN_FLAGS, "--positional", "learned", "--max-positions", "16", "--max-len", "12"]
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", "--src-train", str(d / "train.src"), "--tgt-train", str(d / "train.tgt"), *flags,
                     "--out", str(d / "mt16")]) == 0
        assert main(["train", "--task", "classify", *flags, "--train", str(d / "train.jsonl"),
                     "--out", str(d / "clf16")]) == 0
    return types.SimpleNamespace(mt=d / "mt16" / "best", clf=d / "clf16" / "best")


def test_translate_truncates_a_line_longer_than_learned_positions(learned, capsys, tmp_path):
    long = "red cat dog sun tree blue red"  # 29 characters: more than 16 positions
    inp = write_lines(tmp_path / "in.txt", ["red cat", long, "", long])
    rc, out, err = cli(capsys, "translate", learned.mt, "--input", inp, "--max-len-b", "1000")
    assert rc == 0, err
    assert out.count("\n") == 4
    assert f"qkv translate: warning: {inp}: lines 2, 4: longer than the 15 tokens the model reads" in err
    assert "Traceback" not in err


def test_decoding_never_runs_past_learned_positions(learned):
    import qkv as api

    model = api.load(learned.mt)
    assert model.model.max_source_len() == 16 and model.model.max_steps(None) == 16
    for beam in (1, 3):
        hyps = model.translate(["red cat dog"] * 3, beam_size=beam, max_len_a=50.0, max_len_b=1000, min_len=1000)
        # min_len forbids EOS: every output runs to the limit, 15 tokens (positions 0..15 incl. BOS)
        assert all(len(model.tokenizers.tgt.encode([h])[0]) <= 15 for h in hyps)
    with pytest.warns(UserWarning, match="1 of 1 sentences are longer than the model reads"):
        model.translate(["red cat dog sun tree blue red"])


def test_attention_maps_refuse_what_learned_positions_cannot_read(learned):
    import qkv as api
    from qkv import viz

    model = api.load(learned.mt)
    assert viz.attention_data(model, "red cat", None)["target_from"] == "greedy"
    with pytest.raises(QkvError, match="the source is 31 tokens .* at most 16"):
        viz.attention_data(model, "red cat dog sun tree blue red", None)
    with pytest.raises(QkvError, match="the target is .* at most 16"):
        viz.attention_data(model, "red", "red cat dog sun tree blue red")


def test_classify_warns_for_a_text_longer_than_the_model_reads(learned, capsys, tmp_path):
    inp = write_lines(tmp_path / "in.txt", ["great", "the film was great and bad and great"])
    rc, out, err = cli(capsys, "classify", learned.clf, "--input", inp)
    assert rc == 0, err
    assert out.count("\n") == 2
    assert f"qkv classify: warning: {inp}:2: longer than the 12 tokens the model reads; classified from the first 12" in err


def test_language_model_stops_where_learned_positions_end():
    import dataclasses

    import torch

    from qkv.config import MODEL_PRESETS
    from qkv.decoding.sampling import sample
    from qkv.models.decoder_only import DecoderOnlyTransformer
    from qkv.frontends import LanguageModel

    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], task="lm", positional="learned", max_positions=8,
                              src_vocab_size=20, tgt_vocab_size=20)
    model = DecoderOnlyTransformer(cfg).eval()
    lm = LanguageModel(model, tokenizers=None)
    with pytest.warns(UserWarning) as caught:
        ids, n = lm.fit_positions(list(range(4, 20)), 50)
    assert ids == [16, 17, 18, 19] and n == 5  # the last 7 // 2 + 1 tokens; 8 - 3 positions left
    assert "more than the model reads" in str(caught[0].message) and "max_positions=8" in str(caught[1].message)
    assert len(list(sample(model, ids, n, temperature=0))) == n
    with pytest.raises(ValueError, match="max_positions=8"):  # the bound is tight: one more step fails
        list(sample(model, ids, n + 1, temperature=0))
    assert torch.equal(torch.as_tensor(model.max_steps(torch.tensor([3]))), torch.tensor([5]))


# --- checkpoints: config sections, run directories, stray files, beams ---------------------------------

def bad_config_checkpoint(path: Path, config: dict) -> Path:
    """A checkpoint whose manifest is valid but whose config.json sections are wrong."""
    import torch

    from qkv.checkpoint import save_checkpoint

    return save_checkpoint(path, torch.nn.Linear(2, 2), config)


@pytest.mark.parametrize("config, section, needle", [
    ({"train": {}, "decode": {}}, "model", "has no 'model' section"),
    ({"model": 5, "train": {}, "decode": {}}, "model", "'model' section of config.json must be a JSON object"),
    ({"model": {}, "decode": {}}, "train", "has no 'train' section"),
    ({"model": {}, "train": [], "decode": {}}, "train", "'train' section of config.json must be a JSON object"),
    ({"model": {}, "train": {}, "decode": "beam"}, "decode", "'decode' section"),
])
def test_checkpoint_config_sections_checked(run, capsys, tmp_path, config, section, needle):
    import qkv as api
    from qkv.errors import CheckpointError

    ckpt = bad_config_checkpoint(tmp_path / "ckpt", config)
    with pytest.raises(CheckpointError, match=needle):
        api.load(ckpt)
    rc, _, err = cli(capsys, "translate", ckpt, "red")
    assert_user_error(rc, err, "translate", str(ckpt), needle)
    rc, _, err = cli(capsys, "average", ckpt, run.mt, "--out", tmp_path / "avg")
    assert_user_error(rc, err, "average", str(ckpt), f"'{section}'" if section == "model" else "")


def test_resume_from_a_checkpoint_with_a_bad_section(capsys, tmp_path):
    bad_config_checkpoint(tmp_path / "run" / "last", {"model": {}, "train": 7, "decode": {}})
    rc, _, err = cli(capsys, "train", "--out", tmp_path / "run", "--resume")
    assert_user_error(rc, err, "train", str(tmp_path / "run" / "last"), "'train' section")


def test_translate_a_run_directory_points_to_its_checkpoint(run, capsys, tmp_path):
    import shutil

    rc, _, err = cli(capsys, "translate", run.mt.parent, "red")
    assert_user_error(rc, err, "translate", "is a run directory", str(run.mt))
    only_last = tmp_path / "only-last"
    shutil.copytree(run.mt.parent / "last", only_last / "last")
    rc, _, err = cli(capsys, "translate", only_last, "red")
    assert_user_error(rc, err, "translate", str(only_last / "last"))
    empty_run = tmp_path / "empty-run"
    (empty_run / "best").mkdir(parents=True)  # a save never completed
    (empty_run / "metrics.jsonl").write_text("")
    rc, _, err = cli(capsys, "translate", empty_run, "red")
    assert_user_error(rc, err, "translate", f"{empty_run} is a run directory that holds no checkpoint yet")


def test_files_the_manifest_does_not_list_are_not_loaded(run, tmp_path):
    """A checkpoint with separate source/target tokenizers, and a joint spm.model copied in beside
    them: only the listed models are read (and the reverse for a joint checkpoint)."""
    import shutil

    import qkv as api
    from qkv.data.tokenizer import Tokenizer, TokenizerPair
    from qkv.checkpoint import load_into, read_checkpoint, save_checkpoint

    joint = api.load(run.mt)
    stray = (run.clf / "spm.model").read_bytes()  # another run's tokenizer: other pieces, other ids
    assert stray != joint.tokenizers.src.model_bytes
    separate = TokenizerPair(Tokenizer(joint.tokenizers.src.model_bytes), Tokenizer(joint.tokenizers.tgt.model_bytes))
    ckpt = read_checkpoint(run.mt)
    path = save_checkpoint(tmp_path / "separate", joint.model, ckpt.config, write_extra=separate.save)
    (path / "spm.model").write_bytes(stray)
    loaded = api.load(path)
    assert not loaded.tokenizers.joint
    assert loaded.tokenizers.src.model_bytes == joint.tokenizers.src.model_bytes
    assert loaded.translate(["red cat"]) == joint.translate(["red cat"])
    # the reverse: a joint checkpoint with stray separate models
    path = shutil.copytree(run.mt, tmp_path / "joint")
    for name in ("spm.src.model", "spm.tgt.model"):
        (path / name).write_bytes(stray)
    assert api.load(path).tokenizers.joint
    load_into(joint.model, read_checkpoint(path))  # still a valid checkpoint


def test_beam_wider_than_the_target_vocabulary_refused(run, capsys):
    import qkv as api
    from qkv.errors import ConfigError

    vocab = api.load(run.mt).tokenizers.tgt.vocab_size
    rc, _, err = cli(capsys, "translate", run.mt, "red", "--beam-size", str(vocab + 1))
    assert_user_error(rc, err, "translate", "'beam_size'", f"{vocab + 1}", f"vocabulary ({vocab} tokens)")
    with pytest.raises(ConfigError, match="beam_size"):
        api.load(run.mt).translate(["red"], beam_size=vocab + 1)
    rc, _, err = cli(capsys, "translate", run.mt, "red", "--beam-size", str(vocab))
    assert rc == 0, err
