"""qkv preprocess and qkv train --data: memory-mapped token arrays that train exactly as the plain files do."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.config import TrainConfig
from qkv.data.binarized import Filters, open_corpus, preprocess
from qkv.errors import CorpusError, QkvError
from qkv.tasks import DataPaths
from qkv.tasks.translate import TranslateTask

torch.set_num_threads(1)

EN = "the a small big red blue dog cat man woman child runs sits eats looks at in on with house street park".split()
DE = "der die ein kleine grosse rote blaue hund katze mann frau kind lauft sitzt isst schaut auf im mit haus strasse park".split()


def corpus(n: int = 240, seed: int = 0) -> tuple[list[str], list[str]]:
    """Word-for-word 'translations' of random sentences: no pair empty, identical or oddly long."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        idx = [rng.randrange(len(EN)) for _ in range(rng.randint(3, 12))]
        src.append(" ".join(EN[i] for i in idx))
        tgt.append(" ".join(DE[i] for i in idx))
    return src, tgt


def write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("corpus")
    src, tgt = corpus(240)
    vsrc, vtgt = corpus(30, seed=1)
    return {"src_train": write(d / "train.en", src), "tgt_train": write(d / "train.de", tgt),
            "src_valid": write(d / "valid.en", vsrc), "tgt_valid": write(d / "valid.de", vtgt)}


@pytest.fixture(scope="module")
def data(files, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("bin") / "data"
    code = main(["preprocess", "--src-train", files["src_train"], "--tgt-train", files["tgt_train"],
                 "--src-valid", files["src_valid"], "--tgt-valid", files["tgt_valid"], "--vocab-size", "300",
                 "--workers", "2", "--out", str(out)])
    assert code == 0
    return str(out)


TRAIN = ["--preset", "tiny", "--threads", "1", "--seed", "5", "--max-tokens", "160", "--max-len", "40", "--eval-every", "4",
         "--eval-bleu-samples", "2"]


def test_layout_and_manifest(data, files):
    manifest = json.loads((Path(data) / "manifest.json").read_text())
    assert manifest["splits"]["train"]["pairs"] == 240 and manifest["splits"]["valid"]["pairs"] == 30
    assert manifest["tokenizer"]["files"] == ["spm.model"]
    for side in ("src", "tgt"):
        tokens = np.load(Path(data) / f"train.{side}.tokens.npy", mmap_mode="r")
        offsets = np.load(Path(data) / f"train.{side}.offsets.npy", mmap_mode="r")
        lengths = np.load(Path(data) / f"train.{side}.lengths.npy", mmap_mode="r")
        assert tokens.dtype == np.uint16 and offsets.dtype == np.int64 and len(lengths) == 240
        assert int(offsets[-1] + lengths[-1]) == len(tokens)
        assert manifest["splits"]["train"]["tokens"][side] == len(tokens)
    corpus = open_corpus(data)
    tok = corpus.tokenizers()
    first = Path(files["src_train"]).read_text().splitlines()[0]
    assert corpus.side("train", "src")[0] == tok.src.encode([first])[0]
    assert set(manifest["files"]) >= {"spm.model", "train.src.tokens.npy", "valid.tgt.txt"}


def test_loaded_arrays_read_sentences_with_pread(data):
    """A loaded side reads offsets and tokens from its files (pread), not through the maps, and a
    sentence's end from the next sentence's offset: the same sentences as slicing the maps, with the
    lengths array never read (here replaced by zeros)."""
    side = open_corpus(data).side("train", "tgt")
    assert sorted(side.files) == ["offsets", "tokens"]
    by_map = [side.tokens[int(o) : int(o) + int(n)].tolist() for o, n in zip(side.offsets, side.lengths)]
    side.lengths = np.zeros(len(side), dtype=np.uint16)
    assert side.rows(range(len(side))) == by_map
    assert side.rows([239, 0, 17]) == [by_map[239], by_map[0], by_map[17]]


def test_length_index_written_by_preprocess(data):
    """train.index.npy lists the pairs stably sorted by (source length, target length); buckets.npy
    counts each length pair: checked against a sort of the lengths arrays."""
    d = Path(data)
    src = np.load(d / "train.src.lengths.npy").astype(int)
    tgt = np.load(d / "train.tgt.lengths.npy").astype(int)
    order = np.load(d / "train.index.npy")
    assert order.dtype == np.int32
    assert order.tolist() == sorted(range(240), key=lambda i: (src[i], tgt[i]))
    pairs = sorted({(a, b) for a, b in zip(src.tolist(), tgt.tolist())})
    table = np.load(d / "train.buckets.npy")
    assert table.tolist() == [[a, b, sum(1 for x, y in zip(src, tgt) if (x, y) == (a, b))] for a, b in pairs]
    index = open_corpus(data).length_index("train")
    assert index.file is not None and index.take(np.array([3, 0, 200])).tolist() == order[[3, 0, 200]].tolist()


def test_version_1_directory_builds_the_index_in_memory(data, tmp_path):
    """A directory written before the index files existed trains on the same batches (its index built
    in memory from the lengths); a bucket table that does not fit the index is refused by name."""
    import shutil

    old = tmp_path / "v1"
    shutil.copytree(data, old)
    manifest = json.loads((old / "manifest.json").read_text())
    for split in ("train", "valid"):
        for name in (f"{split}.index.npy", f"{split}.buckets.npy"):
            (old / name).unlink()
            del manifest["files"][name]
    manifest["version"] = 1
    (old / "manifest.json").write_text(json.dumps(manifest))
    new_index, old_index = open_corpus(data).length_index("train"), open_corpus(old).length_index("train")
    assert old_index.file is None
    from qkv.data.buckets import BatchPlan

    assert BatchPlan(old_index, 160, seed=3, epoch=1).tolist() == BatchPlan(new_index, 160, seed=3, epoch=1).tolist()
    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    table = np.load(bad / "train.buckets.npy")
    table[0, 2] += 1
    np.save(bad / "train.buckets.npy", table)
    with pytest.raises(CorpusError, match="train.buckets.npy"):
        open_corpus(bad, checksums=False).length_index("train")
    shutil.copy(Path(data) / "train.buckets.npy", bad / "train.buckets.npy")
    order = np.load(bad / "train.index.npy")
    order[7] = -3  # damaged after the checksums were checked (a resumed run checks sizes only)
    np.save(bad / "train.index.npy", order)
    index = open_corpus(bad, checksums=False).length_index("train")
    with pytest.raises(CorpusError, match="train.index.npy: a pair index outside 0..239"):
        BatchPlan(index, 100000, shuffle=False)[0]


def test_byte_fallback_spells_unseen_characters(data):
    tok = open_corpus(data).tokenizers().src
    ids = tok.encode(["the dog ☃"])[0]
    assert 1 not in ids  # no <unk>
    assert tok.decode([ids]) == ["the dog ☃"]


def splits(data: str, files: dict, epoch: int, max_len: int = 256):
    task, cfg = TranslateTask(), TrainConfig(max_len=max_len)
    tr_b, _ = task.read_data(DataPaths(data=data), lambda m: None)
    tok = task.train_tokenizers(tr_b, cfg)
    tr_p, _ = task.read_data(DataPaths(src_train=files["src_train"], tgt_train=files["tgt_train"]), lambda m: None)
    return (task.encode(tr_b, tok, cfg, lambda m: None, train=True),
            task.encode(tr_p, tok, cfg, lambda m: None, train=True))


@pytest.mark.parametrize("epoch,max_len", [(0, 256), (3, 256), (1, 27)])
def test_same_batches_as_plain_files(data, files, epoch, max_len):
    """The same batches of the same pairs from the files and from the text, also when ``max_len``
    leaves pairs out (by their buckets in the mapped index; by filtering the text's pairs)."""
    mapped, plain = splits(data, files, epoch, max_len)
    assert len(mapped) == len(plain) and (len(plain) < 240) == (max_len < 256)
    assert mapped.src_ids == plain.src_ids and mapped.tgt_ids == plain.tgt_ids
    assert isinstance(mapped.src.tokens, np.memmap) and not isinstance(plain.src.tokens, np.memmap)
    a = list(mapped.batches(160, True, 5, epoch))
    b = list(plain.batches(160, True, 5, epoch))
    assert len(a) == len(b) and len(a) > 5
    kept = mapped._kept()  # the plain split numbers the pairs it kept 0, 1, ...; the mapped one by line
    assert a == [[kept[i] for i in ix] for ix in b]
    for ix, iy in zip(a, b):
        x, y = mapped.collate(ix), plain.collate(iy)
        for name in ("src", "tgt_in", "tgt_out"):
            assert torch.equal(getattr(x, name), getattr(y, name))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[tuple]:
    keep = ("step", "train_loss", "train_nll", "valid_loss", "valid_nll")
    return [tuple(r.get(k) for k in keep) for r in records(run)]


def weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_train_from_data_equals_plain_files_and_resumes(data, files, tmp_path):
    plain, mapped, resumed = tmp_path / "plain", tmp_path / "mapped", tmp_path / "resumed"
    assert main(["train", *[f"--{k.replace('_', '-')}={v}" for k, v in files.items()], "--tokenizer-from", data,
                 *TRAIN, "--max-steps", "8", "--out", str(plain)]) == 0
    assert main(["train", "--data", data, *TRAIN, "--max-steps", "8", "--out", str(mapped)]) == 0
    assert losses(plain) == losses(mapped)
    for name, t in weights(plain / "last").items():
        assert torch.equal(t, weights(mapped / "last")[name]), name
    # stopped at 4, resumed to 8: the same run
    assert main(["train", "--data", data, *TRAIN, "--max-steps", "4", "--out", str(resumed)]) == 0
    assert main(["train", "--data", data, "--resume", "--max-steps", "8", "--out", str(resumed)]) == 0
    assert losses(resumed) == losses(mapped)
    for name, t in weights(mapped / "last").items():
        assert torch.equal(t, weights(resumed / "last")[name]), name
    saved = json.loads((mapped / "last" / "config.json").read_text())["data"]
    assert saved["fingerprint"] == open_corpus(data).fingerprint


def test_resume_refuses_other_data(data, files, tmp_path, capsys):
    other = tmp_path / "other"
    assert main(["preprocess", "--src-train", files["src_train"], "--tgt-train", files["tgt_train"],
                 "--vocab-size", "340", "--out", str(other)]) == 0
    run = tmp_path / "run"
    assert main(["train", "--data", data, *TRAIN, "--max-steps", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", "--data", str(other), "--resume", "--max-steps", "4", "--out", str(run)]) == 2
    assert "differ from the data" in capsys.readouterr().err


def test_checksum_mismatch_is_a_clear_error(data, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    path = copy / "train.tgt.tokens.npy"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # same size, other content
    path.write_bytes(bytes(raw))
    assert main(["train", "--data", str(copy), *TRAIN, "--max-steps", "2", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "train.tgt.tokens.npy: sha256 checksum mismatch" in err and "qkv preprocess again" in err
    assert not (tmp_path / "run").exists()
    path.write_bytes(bytes(raw[:-1]))  # and a size that differs is found without reading the file
    with pytest.raises(CorpusError, match="bytes, the manifest says"):
        open_corpus(copy, checksums=False)


def test_checksum_mismatch_stops_two_processes(data, tmp_path):
    """Under torchrun rank 0 alone reads the files for their checksums (the other rank checks sizes and
    waits for it at the process group's start): a changed file still stops the run before any update."""
    import os
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    path = copy / "train.src.tokens.npy"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "qkv",
           "train", "--data", str(copy), *TRAIN, "--max-steps", "2", "--out", str(run)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "train.src.tokens.npy: sha256 checksum mismatch" in proc.stdout + proc.stderr
    assert not (run / "last").exists()


def test_filters_counted(tmp_path):
    src, tgt = corpus(40, seed=3)
    # hand-made lines (1-based line numbers in comments)
    src[4], tgt[4] = "", "ein hund"                               # line 5: empty
    src[9], tgt[9] = "   ", "   "                                  # line 10: empty (blank)
    src[14], tgt[14] = "the same dog", "the same dog"             # line 15: identical
    src[19], tgt[19] = " ".join(["dog"] * 70), "hund"             # line 20: too long (70 > 60 tokens)
    src[24], tgt[24] = "dog", " ".join(["hund sitzt"] * 15)       # line 25: ratio (30 > 9 x 1... tokens)
    src[29], tgt[29] = "cat", "katze"                             # line 30: kept (1 : 1)
    a, b = write(tmp_path / "a.en", src), write(tmp_path / "b.de", tgt)
    manifest = preprocess(a, b, tmp_path / "out", vocab_size=300, filters=Filters(max_len=60, max_ratio=9.0),
                          log=lambda m: None)
    train = manifest["splits"]["train"]
    assert train["skipped"] == {"empty": 2, "identical": 1, "too_long": 1, "ratio": 1}
    assert train["skipped_lines"] == {"empty": [5, 10], "identical": [15], "too_long": [20], "ratio": [25]}
    assert train["lines"] == 40 and train["pairs"] == 35


def test_bad_input_names_file_and_line(tmp_path, capsys):
    src, tgt = corpus(20)
    a, b = write(tmp_path / "a.en", src), write(tmp_path / "b.de", tgt)
    short = write(tmp_path / "short.de", tgt[:17])
    assert main(["preprocess", "--src-train", a, "--tgt-train", short, "--out", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert "short.de has 17 lines" in err and "line 18" in err
    bad = tmp_path / "bad.en"
    bad.write_bytes("\n".join(src[:6]).encode() + b"\nthe \xff dog\n" + "\n".join(src[7:]).encode() + b"\n")
    assert main(["preprocess", "--src-train", str(bad), "--tgt-train", b, "--out", str(tmp_path / "o2")]) == 2
    assert f"{bad}:7: invalid UTF-8" in capsys.readouterr().err
    assert main(["preprocess", "--src-train", str(tmp_path / "missing.en"), "--tgt-train", b,
                 "--out", str(tmp_path / "o3")]) == 2
    assert "missing.en: no such file" in capsys.readouterr().err
    # nothing half-written: no output, no temporary directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.en", "b.de", "bad.en", "short.de"]


def test_invalid_utf8_found_while_encoding(tmp_path):
    """Past the tokenizer's sample (a tokenizer reused), the encoding pass names the line too."""
    src, tgt = corpus(30)
    a, b = write(tmp_path / "a.en", src), write(tmp_path / "b.de", tgt)
    first = tmp_path / "first"
    preprocess(a, b, first, vocab_size=300, log=lambda m: None)
    bad = tmp_path / "bad.de"
    bad.write_bytes("\n".join(tgt[:24]).encode() + b"\n\xc3(\n" + "\n".join(tgt[25:]).encode() + b"\n")
    with pytest.raises(CorpusError, match=r"bad.de:25: invalid UTF-8"):
        preprocess(a, bad, tmp_path / "o", tokenizer_from=first, workers=2, log=lambda m: None)
    assert not (tmp_path / "o").exists()
    with pytest.raises(QkvError, match="exists"):
        preprocess(a, b, first, vocab_size=300, log=lambda m: None)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stopped_preprocess_leaves_no_temporary_directory(data, tmp_path, signal_when, workers):
    """SIGTERM (kill, timeout) in the middle of the encoding pass: the temporary directory beside the
    output, already holding token arrays, is removed; exit status 130, as for Ctrl-C."""
    src, tgt = corpus(200_000, seed=2)
    a, b = write(tmp_path / "big.en", src), write(tmp_path / "big.de", tgt)
    out = tmp_path / "out"

    def encoding() -> bool:  # the temporary directory exists and token arrays are being written into it
        return any(p.name.startswith(".out.tmp-") and any(p.iterdir()) for p in tmp_path.iterdir())

    rc, err = signal_when(["preprocess", "--src-train", a, "--tgt-train", b, "--tokenizer-from", data,
                           "--workers", workers, "--out", out], encoding)
    assert rc == 130, err
    assert "qkv preprocess: interrupted" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.de", "big.en"]


def test_a_stale_temporary_directory_is_removed_by_the_next_run(data, files, tmp_path, pids, capsys):
    """What a preprocess killed outright (kill -9) left beside its output goes at the next run on that
    output; the temporary directory of a process still running stays."""
    dead, live = pids
    for pid in (dead, live):
        (tmp_path / f".out.tmp-{pid}").mkdir()
        (tmp_path / f".out.tmp-{pid}" / "train.src.tokens.npy").write_bytes(b"x" * 1000)
    assert main(["preprocess", "--src-train", files["src_train"], "--tgt-train", files["tgt_train"],
                 "--tokenizer-from", data, "--out", str(tmp_path / "out")]) == 0
    assert f"removed {tmp_path / f'.out.tmp-{dead}'}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".out.tmp-{live}", "out"]


def test_workers_capped_by_the_cores_and_the_corpus_and_said(tmp_path, capsys, monkeypatch):
    """--workers 1000 on a 50-line corpus starts one worker, not 1000, and says why on stderr; with
    more chunks, the cores are the cap."""
    import qkv.data.binarized as binarized

    src, tgt = corpus(50)
    a, b = write(tmp_path / "a.en", src), write(tmp_path / "a.de", tgt)
    used = []
    write_split = binarized._write_split
    monkeypatch.setattr(binarized, "_write_split", lambda *args: used.append(args[7]) or write_split(*args))
    assert main(["preprocess", "--src-train", a, "--tgt-train", b, "--vocab-size", "300", "--workers", "1000",
                 "--out", str(tmp_path / "o1")]) == 0
    err = capsys.readouterr().err
    assert f"--workers 1000: 1 worker process used ({a} makes 1 chunk of up to 20,000 lines)" in err \
        or f"; {a} makes 1 chunk of up to 20,000 lines)" in err, err
    assert used == [1]
    monkeypatch.setattr(binarized, "available_cores", lambda: 2)  # 50 lines in chunks of 10: 5 chunks, 2 cores
    used.clear()
    messages = []
    preprocess(a, b, tmp_path / "o2", tokenizer_from=tmp_path / "o1", workers=1000, chunk_lines=10,
               log=messages.append)
    assert used == [2]
    assert "--workers 1000: 2 worker processes used (this process may use 2 cores)" in messages
    used.clear()
    preprocess(a, b, tmp_path / "o3", tokenizer_from=tmp_path / "o1", workers=2, chunk_lines=10, log=messages.append)
    assert used == [2] and not [m for m in messages if m.startswith("--workers 2")]  # not capped: not said
    assert (tmp_path / "o3" / "train.src.tokens.npy").read_bytes() == (tmp_path / "o1" / "train.src.tokens.npy").read_bytes()
    assert binarized.capped_workers(8, chunks=3, cores=16) == 3 and binarized.capped_workers(8, 100, 4) == 4
    assert binarized.capped_workers(8, 0, 4) == 1


def _children(pid: int) -> set[int]:
    """The live (not zombie) child processes of ``pid``, from /proc."""
    kids = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids.update(int(k) for k in (task / "children").read_text().split())
        except OSError:
            pass
    return {k for k in kids if _alive(k)}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("big")
    src, tgt = corpus(200_000, seed=2)
    return write(d / "big.en", src), write(d / "big.de", tgt)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree from /proc (Linux)")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_no_worker_outlives_a_stopped_or_killed_preprocess(data, big, tmp_path, sig):
    """SIGTERM in the middle of the encoding pass ends the whole process tree within seconds, and so
    does kill -9 of the main process alone: its workers notice and end (no orphans)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from qkv.data.binarized import available_cores

    if available_cores() < 2:
        pytest.skip("one core: --workers 2 is capped to 1 and starts no worker process")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "preprocess", "--src-train", big[0], "--tgt-train", big[1],
                             "--tokenizer-from", data, "--workers", "2", "--out", str(tmp_path / "out")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 or not any(p.name.startswith(".out.tmp-") and any(p.iterdir()) for p in tmp_path.iterdir()):
            assert proc.poll() is None, f"ended (status {proc.returncode}) before it could be stopped midway"
            assert time.monotonic() < deadline, "never reached the encoding pass with two workers"
            workers |= _children(proc.pid)
            time.sleep(0.02)
        workers |= _children(proc.pid)
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == (130 if sig == "SIGTERM" else -signal.SIGKILL), err
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)], f"workers still running {time.monotonic() - deadline + 5:.1f} s " \
                                                      "after the main process ended"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork") or not Path("/proc/self/stat").is_file(),
                    reason="forks, and reads process states from /proc")
@pytest.mark.parametrize("how", ["prctl", "polling"])
def test_a_busy_worker_ends_when_its_parent_is_killed(how):
    """A worker in the middle of a long chunk, its parent killed outright (kill -9), ends within seconds:
    the kernel's parent-death signal (Linux), or the thread that watches the parent's pid elsewhere."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = f"""
import os, sys, time
from qkv.data.binarized import _die_with_parent
parent = os.getpid()
child = os.fork()
if child == 0:
    if {how == "polling"!r}:
        sys.platform = "elsewhere"  # the portable path
    _die_with_parent(parent)
    os.write(1, b"armed\\n")  # one write each: two processes share the pipe, and print() may split a line
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # busy, as a worker encoding a chunk is
        pass
    os._exit(0)
os.write(1, b"%d\\n" % child)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        lines = {proc.stdout.readline().strip() for _ in range(2)}
        assert "armed" in lines, lines
        child = int((lines - {"armed"}).pop())
        assert _alive(child)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10  # within seconds, with room for a loaded 2-core CI machine
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its parent by 10 s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_translate_streams_a_file(data, files, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--data", data, *TRAIN, "--max-steps", "2", "--out", str(run)]) == 0
    out = tmp_path / "out.txt"
    assert main(["translate", str(run / "last"), "--input", files["src_valid"], "--output", str(out),
                 "--batch-size", "2"]) == 0
    n = len(Path(files["src_valid"]).read_text().splitlines())
    assert len(out.read_text().splitlines()) == n


def test_tensorboard_scalars_equal_metrics(data, tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed: pip install -c constraints.txt -e '.[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, tb = tmp_path / "run", tmp_path / "tb"
    assert main(["train", "--data", data, *TRAIN, "--max-steps", "8", "--out", str(run), "--tensorboard", str(tb)]) == 0
    events = EventAccumulator(str(tb))
    events.Reload()
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in records(run):
        for k, v in r.items():
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                expected.setdefault(k, []).append((r["step"], float(v)))  # time: when, not a scalar to plot
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in points]
        assert np.allclose([v for _, v in got], [v for _, v in points], rtol=1e-6, atol=0)  # float32 events


@pytest.mark.parametrize("flag,value,message", [("--sample", "-5", "--sample"), ("--max-len", "-1", "--max-len"),
                                                ("--max-ratio", "0.5", "--max-ratio"), ("--vocab-size", "0", "--vocab-size")])
def test_option_bounds_refused_before_any_work(tmp_path, capsys, flag, value, message):
    src, tgt = corpus(20)
    a, b = write(tmp_path / "a.en", src), write(tmp_path / "a.de", tgt)
    out = tmp_path / "out"
    assert main(["preprocess", "--src-train", a, "--tgt-train", b, "--out", str(out), flag, value]) == 2
    assert message in capsys.readouterr().err and not out.exists()
