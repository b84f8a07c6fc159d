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
import sys
import tarfile
import threading
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
