"""Data with a source: each recipe's fetch.py downloads its public data set and checks it by sha256.

The pinned checksums are checked against the copies in ../shared/data where that folder exists. The
download path runs against a server on 127.0.0.1 (and a file:// URL) that serves copies, since the
public hosts are not reached from the test machines.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "recipes"))
import fetch  # noqa: E402 (recipes/fetch.py)

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is absent (the shared data sets)")


def recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"fetch_{name}", ROOT / "recipes" / name / "fetch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no request log on stderr
        pass


@pytest.fixture
def server():
    """``serve(folder)``: the URL of an HTTP server on 127.0.0.1 serving ``folder``, stopped after the test."""
    servers = []

    def serve(folder: Path) -> str:
        handler = functools.partial(Quiet, directory=str(folder))
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}/"

    yield serve
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_every_recipe_has_a_fetch_script_naming_its_public_source():
    for name, host in [("multi30k", "github"), ("timemachine", "gutenberg.org"), ("imdb", "stanford.edu"),
                       ("wmt14", "statmt.org")]:
        module = recipe(name)
        assert module.__doc__ and "Source:" in module.__doc__
        urls = [s.url for s in getattr(module, "SOURCES", [])] + [getattr(module, "URL", "")]
        assert any(host in u and u.startswith("https://") for u in urls), (name, urls)


@needs_shared
def test_the_pinned_checksums_are_those_of_the_shared_copies():
    m30k = recipe("multi30k")
    assert {s.name for s in m30k.SOURCES} == {p.name for p in (SHARED / "multi30k").glob("*.gz")}
    for s in m30k.SOURCES:
        assert fetch.sha256_of(SHARED / "multi30k" / s.name) == s.sha256, s.name
    (tm,) = recipe("timemachine").SOURCES
    assert fetch.sha256_of(SHARED / "timemachine" / tm.name) == tm.sha256
    imdb = recipe("imdb")
    assert fetch.sha256_of(SHARED / "imdb" / "README") == imdb.README_SHA256
    for split, digest in imdb.JSONL_SHA256.items():
        assert sha256(gzip.open(SHARED / "imdb" / f"{split}.jsonl.gz").read()) == digest, split


@needs_shared
def test_multi30k_and_the_time_machine_download_from_a_local_server_checked(server, tmp_path):
    url = server(SHARED)
    assert recipe("multi30k").fetch.main("m", recipe("multi30k").SOURCES, tmp_path, argv=[
        "--out", str(tmp_path / "m30k"), "--mirror", url + "multi30k/"]) == 0
    for p in (SHARED / "multi30k").glob("*.gz"):
        assert (tmp_path / "m30k" / p.name).read_bytes() == p.read_bytes()
    tm = recipe("timemachine")
    assert fetch.main("t", tm.SOURCES, tmp_path, argv=["--out", str(tmp_path / "tm"), "--mirror", url + "timemachine"]) == 0
    assert (tmp_path / "tm" / "timemachine.txt").read_bytes() == (SHARED / "timemachine" / "timemachine.txt").read_bytes()
    assert not list(tmp_path.rglob("*.part"))


def test_a_file_with_the_wrong_checksum_is_refused_by_name_and_not_kept(server, tmp_path, capsys):
    served = tmp_path / "served"
    served.mkdir()
    (served / "a.txt").write_bytes(b"alpha\n")
    (served / "b.txt").write_bytes(b"tampered\n")
    sources = [fetch.Source("a.txt", "https://example.org/a.txt", sha256(b"alpha\n")),
               fetch.Source("b.txt", "https://example.org/b.txt", sha256(b"beta\n"))]
    out = tmp_path / "out"
    assert fetch.main("x", sources, out, argv=["--out", str(out), "--mirror", server(served)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fetch: error: b.txt: sha256 ") and sha256(b"beta\n") in err and len(err.splitlines()) == 1
    assert (out / "a.txt").read_bytes() == b"alpha\n"  # what was checked stays
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"]  # nothing of b.txt, no .part left
    (served / "b.txt").write_bytes(b"beta\n")  # the file set right: a.txt is kept, b.txt fetched
    assert fetch.main("x", sources, out, argv=["--out", str(out), "--mirror", served.as_uri()]) == 0
    assert (out / "b.txt").read_bytes() == b"beta\n"


def test_an_unreachable_source_is_an_error_naming_the_file(tmp_path, capsys):
    sources = [fetch.Source("a.txt", "https://example.org/a.txt", sha256(b"alpha\n"))]
    assert fetch.main("x", sources, tmp_path, argv=["--out", str(tmp_path), "--mirror", (tmp_path / "nowhere").as_uri()]) == 1
    assert capsys.readouterr().err.startswith("fetch: error: a.txt: cannot download ")
    assert not list(tmp_path.iterdir())


def test_imdb_reads_the_archive_into_json_lines(tmp_path):
    """Labelled reviews, neg before pos, each by id; the unlabelled ones and other files left out."""
    imdb = recipe("imdb")
    with tarfile.open(tmp_path / imdb.ARCHIVE, "w:gz") as tar:
        for name, data in [("aclImdb/README", b"about"), ("aclImdb/train/pos/3_9.txt", "Très bien".encode()),
                           ("aclImdb/train/neg/10_1.txt", b"bad<br />film"), ("aclImdb/train/neg/2_4.txt", b"meh"),
                           ("aclImdb/train/unsup/0_0.txt", b"?"), ("aclImdb/test/pos/0_7.txt", b"good"),
                           ("aclImdb/imdb.vocab", b"the")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    texts = imdb.read_archive(tmp_path / imdb.ARCHIVE)
    assert texts["README"] == b"about"
    assert texts["train"].decode() == (
        '{"id": 2, "rating": 4, "label": "neg", "text": "meh"}\n'
        '{"id": 10, "rating": 1, "label": "neg", "text": "bad<br />film"}\n'
        '{"id": 3, "rating": 9, "label": "pos", "text": "Très bien"}\n')
    assert texts["test"] == b'{"id": 0, "rating": 7, "label": "pos", "text": "good"}\n'


@needs_shared
@pytest.mark.long  # 50,000 reviews packed and unpacked: minutes on a busy 2-core machine
def test_imdb_unpacks_the_archive_into_the_shared_copys_json_lines(server, tmp_path):
    """An archive laid out as aclImdb_v1.tar.gz (train/ and test/, neg/ and pos/, ID_RATING.txt, README),
    made from the shared copy's reviews, unpacks into JSON lines of exactly the pinned checksums."""
    imdb = recipe("imdb")
    served = tmp_path / "served"
    served.mkdir()
    with tarfile.open(served / imdb.ARCHIVE, "w") as tar:  # uncompressed: quicker; tarfile reads either
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("aclImdb/README", (SHARED / "imdb" / "README").read_bytes())
        for split in ("test", "train"):
            for line in reversed(gzip.open(SHARED / "imdb" / f"{split}.jsonl.gz", "rt", encoding="utf-8").readlines()):
                r = json.loads(line)  # in another order than the output's: unpack sorts
                add(f"aclImdb/{split}/{r['label']}/{r['id']}_{r['rating']}.txt", r["text"].encode("utf-8"))
        add("aclImdb/train/unsup/0_0.txt", b"not a labelled review")
    out = tmp_path / "imdb"
    assert fetch.main("i", [fetch.Source(imdb.ARCHIVE, imdb.URL, None)], out, after=imdb.unpack,
                      argv=["--out", str(out), "--mirror", server(served)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README", "test.jsonl.gz", "train.jsonl.gz"]
    for split in ("train", "test"):
        assert gzip.open(out / f"{split}.jsonl.gz").read() == gzip.open(SHARED / "imdb" / f"{split}.jsonl.gz").read()


# --- a hostile server: every failure one line, nothing unchecked kept, no fetch held for long -----------


def _tar_gz(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


SMALL_IMDB = _tar_gz([("aclImdb/README", b"about"), ("aclImdb/train/neg/2_4.txt", b"meh"),
                      ("aclImdb/train/pos/3_9.txt", b"fine"), ("aclImdb/test/pos/0_7.txt", b"good")])
SMALL_TRAIN = (b'{"id": 2, "rating": 4, "label": "neg", "text": "meh"}\n'
               b'{"id": 3, "rating": 9, "label": "pos", "text": "fine"}\n')
SMALL_TEST = b'{"id": 0, "rating": 7, "label": "pos", "text": "good"}\n'
DRIP_S = 0.5  # the dripping endpoints send a byte this often


class Hostile(Quiet):
    """/good/, /truncated/, /nontar/: an archive whole, cut in half, and not an archive (any name);
    /drip/NAME: headers, then one byte of 1,000 every DRIP_S; /driphead/NAME: the headers themselves a
    byte at a time; /short/NAME: 1,000 bytes announced, 10 sent; anything else: 404."""

    def do_GET(self):
        kind = self.path.strip("/").split("/")[0]
        bodies = {"good": SMALL_IMDB, "truncated": SMALL_IMDB[: len(SMALL_IMDB) // 2], "nontar": b"<html>moved</html>\n"}
        if kind in bodies:
            self._send(bodies[kind])
        elif kind == "short":
            self._headers(1000)
            self.wfile.write(b"x" * 10)
        elif kind in ("drip", "driphead"):
            head = b"HTTP/1.0 200 OK\r\nContent-Length: 1000\r\n\r\n"
            if kind == "drip":
                self.wfile.write(head)
                self.wfile.flush()
                head = b""
            try:
                for byte in [head[i : i + 1] for i in range(len(head))] + [b"x"] * 60:  # 30 s at most
                    self.wfile.write(byte)
                    self.wfile.flush()
                    time.sleep(DRIP_S)
            except OSError:  # the client gave up: what the test wants
                pass
        else:
            self.send_error(404)

    def _headers(self, length: int) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _send(self, body: bytes) -> None:
        self._headers(len(body))
        self.wfile.write(body)


@pytest.fixture
def hostile():
    """The URL of a :class:`Hostile` server on 127.0.0.1, stopped after the test."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("fetch: error: ") and "Traceback" not in err, err
    return err


def test_imdb_from_a_good_archive_writes_its_json_lines_and_drops_the_archive(hostile, tmp_path, monkeypatch):
    imdb = recipe("imdb")
    monkeypatch.setattr(imdb, "README_SHA256", sha256(b"about"))  # the pins of this small archive's content
    monkeypatch.setattr(imdb, "JSONL_SHA256", {"train": sha256(SMALL_TRAIN), "test": sha256(SMALL_TEST)})
    out = tmp_path / "imdb"
    assert imdb.fetch.main("i", [fetch.Source(imdb.ARCHIVE, imdb.URL, None)], out, after=imdb.unpack,
                           argv=["--out", str(out), "--mirror", hostile + "good/"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README", "test.jsonl.gz", "train.jsonl.gz"]
    assert gzip.open(out / "train.jsonl.gz").read() == SMALL_TRAIN and gzip.open(out / "test.jsonl.gz").read() == SMALL_TEST


@pytest.mark.parametrize("kind", ["truncated", "nontar", "good"])
def test_a_bad_imdb_archive_is_one_line_and_not_kept(hostile, tmp_path, capsys, kind):
    """Cut short, not a tar archive, or a tar archive whose reviews are not the pinned ones: one line
    naming the archive, status 1, and nothing in the folder (the archive removed, no part files)."""
    imdb = recipe("imdb")
    out = tmp_path / "imdb"
    assert imdb.fetch.main("i", [fetch.Source(imdb.ARCHIVE, imdb.URL, None)], out, after=imdb.unpack,
                           argv=["--out", str(out), "--mirror", f"{hostile}{kind}/"]) == 1
    err = one_line_error(capsys)
    assert err.startswith({"good": "fetch: error: README of aclImdb_v1.tar.gz: sha256 ",
                           "truncated": "fetch: error: aclImdb_v1.tar.gz: a truncated or damaged archive (",
                           "nontar": "fetch: error: aclImdb_v1.tar.gz: not a readable tar archive "}[kind]), err
    assert not out.exists() or not list(out.iterdir())


def test_http_errors_short_bodies_and_bad_options_are_one_line(hostile, tmp_path, capsys):
    src = [fetch.Source("a.txt", "https://example.org/a.txt", sha256(b"alpha\n"))]
    out = tmp_path / "out"
    assert fetch.main("x", src, out, argv=["--out", str(out), "--mirror", hostile + "nothing/"]) == 1
    err = one_line_error(capsys)
    assert err.startswith(f"fetch: error: a.txt: cannot download {hostile}nothing/a.txt: HTTP 404 "), err
    assert fetch.main("x", src, out, argv=["--out", str(out), "--mirror", hostile + "short/"]) == 1
    assert "10 bytes arrived, the server announced 1,000" in one_line_error(capsys)
    for mirror in ["::::", "http://", "ftp://example.org/", "http://127.0.0.1:99999/", "no scheme"]:
        assert fetch.main("x", src, out, argv=["--out", str(out), "--mirror", mirror]) == 2, mirror
        assert f"--mirror {mirror!r}: not a URL" in one_line_error(capsys)
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    assert fetch.main("x", src, a_file, argv=["--out", str(a_file), "--mirror", hostile]) == 2
    assert f"--out {a_file}: is a file, not a folder" in one_line_error(capsys)
    assert fetch.main("x", src, a_file, argv=["--out", str(a_file / "sub"), "--mirror", hostile]) == 2
    assert f"--out {a_file / 'sub'}: cannot make the folder: " in one_line_error(capsys)
    assert a_file.read_text() == "mine"
    assert not out.exists() and not list(tmp_path.rglob("*.part"))


@pytest.mark.parametrize("kind,flags,message", [
    ("drip", ["--min-rate", "100", "--rate-window", "1"], "under the minimum of 100 (--min-rate)"),
    ("drip", ["--min-rate", "0", "--deadline", "2"], "over the deadline of 2 s (--deadline)"),
    ("driphead", ["--min-rate", "0", "--deadline", "2"], "over the deadline of 2 s (--deadline)"),
])
def test_a_dripping_server_cannot_hold_a_fetch(hostile, tmp_path, capsys, kind, flags, message):
    """A byte every DRIP_S keeps every read well inside --timeout; the minimum rate or the overall
    deadline ends the fetch within seconds, with one line, and no part file."""
    src = [fetch.Source("a.txt", "https://example.org/a.txt", None)]
    out = tmp_path / "out"
    t0 = time.monotonic()
    assert fetch.main("x", src, out, argv=["--out", str(out), "--mirror", f"{hostile}{kind}/", *flags]) == 1
    took = time.monotonic() - t0
    err = one_line_error(capsys)
    assert err.startswith("fetch: error: a.txt: cannot download ") and message in err, err
    assert took < 10, took
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_is_status_130_and_leaves_nothing(hostile, tmp_path, sig):
    """Ctrl-C (or SIGTERM) in the middle of a download: status 130, one line, no part file."""
    out = tmp_path / "tm"

    def as_a_shell_starts_it():  # SIGINT and SIGTERM at their defaults and unblocked, whatever this process has
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, str(ROOT / "recipes" / "timemachine" / "fetch.py"), "--out", str(out),
                             "--mirror", hostile + "drip/"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_a_shell_starts_it)
    try:
        deadline = time.monotonic() + 30
        while not (out / "timemachine.txt.part").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else ""
            time.sleep(0.05)
        proc.send_signal(getattr(signal, sig))
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:  # say what the process was doing and which signals it took
            status = Path(f"/proc/{proc.pid}/status")
            said = [line for line in status.read_text().splitlines() if line.startswith(("State", "Sig", "Shd"))] \
                if status.exists() else []
            pytest.fail(f"fetch.py did not end within 20 s of {sig}: {said}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err == "fetch: interrupted: nothing half-written was kept\n", err
    assert not out.exists() or not list(out.iterdir())


def test_the_default_data_folder_is_the_clones_own_and_shared_only_when_present(tmp_path, monkeypatch):
    own, shared = tmp_path / "clone" / "data", tmp_path / "shared" / "data"
    monkeypatch.setattr(fetch, "DATA", own)
    monkeypatch.setattr(fetch, "SHARED", shared)
    assert fetch.data_dir("multi30k") == own / "multi30k"  # neither: where fetch.py will write
    (shared / "multi30k").mkdir(parents=True)
    assert fetch.data_dir("multi30k") == shared / "multi30k"  # only the shared copy: read it
    (own / "multi30k").mkdir(parents=True)
    assert fetch.data_dir("multi30k") == own / "multi30k"  # the clone's own first
    assert fetch.data_dir("imdb") == own / "imdb"
    for name in ("multi30k", "timemachine", "imdb"):
        help_text = subprocess.run([sys.executable, str(ROOT / "recipes" / name / "fetch.py"), "--help"],
                                   capture_output=True, text=True, timeout=60,
                                   env={**os.environ, "COLUMNS": "400"}).stdout
        assert f"(default: {ROOT / 'data' / name})" in " ".join(help_text.split()), help_text


def test_a_bad_wmt14_archive_is_one_line_and_no_archive_is_kept(hostile, tmp_path, capsys):
    wmt = recipe("wmt14")
    out = tmp_path / "wmt14"
    assert wmt.fetch.main("w", wmt.SOURCES, out, after=wmt.concatenate,
                          argv=["--out", str(out), "--mirror", hostile + "nontar/"]) == 1
    err = one_line_error(capsys)
    assert err.startswith("fetch: error: training-parallel-europarl-v7.tgz: not a readable tar archive"), err
    assert not out.exists() or not list(out.iterdir())
