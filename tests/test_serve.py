"""qkv serve: the HTTP API against the front-ends it wraps, its batching, its bounds and errors.

The references are the front-ends themselves (``qkv.load(...).translate`` and friends), called
directly on the same inputs. Needs the serve extra (``pip install -c constraints.txt -e ".[serve]"``);
skipped without it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='qkv serve needs fastapi: pip install -c constraints.txt -e ".[serve]"')
pytest.importorskip("uvicorn", reason='qkv serve needs uvicorn: pip install -c constraints.txt -e ".[serve]"')
httpx = pytest.importorskip("httpx", reason='the serve tests need httpx: pip install -c constraints.txt -e ".[serve]"')

import qkv  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from qkv.cli import main  # noqa: E402
from qkv.errors import QkvError  # noqa: E402
from qkv.serve import BackgroundServer, Limits  # noqa: E402
from qkv.serve.app import create_app  # noqa: E402
from qkv.serve.batcher import Batcher  # noqa: E402
from qkv.serve.service import load_models, model_name  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
NAMES = ["translate-transformer", "translate-lstm-general", "prefix_lm-transformer", "classify-transformer",
         "mlm-transformer", "lm-transformer"]
SOURCES = ["red cat", "the big dog sun", "small tree", "blue"]
LOCAL = "http://127.0.0.1"  # TestClient's own host name, testserver, is refused like any other outside one
SMALL = Limits(max_texts=16, max_chars=200, max_tokens=40, max_beam=8, max_nbest=4, max_new_tokens=50,
               max_body_bytes=20_000)


@pytest.fixture(scope="module")
def models():
    return load_models([str(FIXTURES / n) for n in NAMES], SMALL)


@pytest.fixture(scope="module")
def client(models):
    with TestClient(create_app(models, SMALL), base_url=LOCAL) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """The front-ends, loaded on their own: what the server must agree with."""
    return {n: qkv.load(FIXTURES / n) for n in NAMES}


def ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


# --- answers equal the front-ends' -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["translate-transformer", "translate-lstm-general", "prefix_lm-transformer"])
@pytest.mark.parametrize("beam,n_best", [(1, 1), (4, 1), (4, 3)])
def test_translate_equals_the_translator(client, reference, name, beam, n_best):
    out = ok(client.post("/translate", json={"model": name, "texts": SOURCES, "beam_size": beam, "n_best": n_best}))
    expected = reference[name].translate_scored(SOURCES, beam_size=beam, nbest=n_best)
    assert [[h["text"] for h in r["hypotheses"]] for r in out["results"]] == \
        [[text for text, _ in nbest] for nbest in expected]
    for row, nbest in zip(out["results"], expected):
        assert [h["score"] for h in row["hypotheses"]] == pytest.approx([s for _, s in nbest], abs=1e-5)
        for h in row["hypotheses"]:
            assert len(h["token_logprobs"]) == len(h["tokens"]) + 1
            # the search's log-probability (greedy's too) is the sum of the forced token log-probabilities
            assert sum(h["token_logprobs"]) == pytest.approx(h["logprob"], abs=1e-4) and h["logprob"] < 0
    assert [r["hypotheses"][0]["text"] for r in out["results"]] == \
        reference[name].translate(SOURCES, beam_size=beam, nbest=n_best)


def test_target_prefix(client, reference):
    out = ok(client.post("/translate", json={"model": "translate-transformer", "texts": SOURCES,
                                             "target_prefix": "cat", "n_best": 2}))
    expected = reference["translate-transformer"].translate_scored(SOURCES, target_prefix="cat", nbest=2)
    assert [[h["text"] for h in r["hypotheses"]] for r in out["results"]] == [[t for t, _ in n] for n in expected]
    assert all(h["text"].startswith("cat") for r in out["results"] for h in r["hypotheses"])


def test_score_equals_translator_score(client, reference):
    sources, targets = ["red cat", "small tree", "blue"], ["cat red", "", "blue blue"]
    out = ok(client.post("/score", json={"model": "translate-transformer", "sources": sources, "targets": targets}))
    expected = reference["translate-transformer"].score(sources, targets)
    for row, lp in zip(out["results"], expected):
        assert row["token_logprobs"] == pytest.approx(lp, abs=1e-6)
        assert row["logprob"] == pytest.approx(sum(lp), abs=1e-6)
        assert len(row["tokens"]) == len(lp) and row["tokens"][-1] == "</s>"


@pytest.mark.parametrize("name", ["translate-transformer", "translate-lstm-general"])
def test_alignments_and_cross_attention_shapes(client, reference, models, name):
    out = ok(client.post("/translate", json={"model": name, "texts": SOURCES, "n_best": 2, "alignments": True,
                                             "attention": True}))
    cfg = reference[name].model.cfg
    layers, heads = (1, 1) if cfg.is_recurrent else (cfg.n_decoder_layers, cfg.n_heads)
    rich = reference[name].translate_rich(SOURCES, nbest=2)
    for row, expected in zip(out["results"], rich):
        src = row["source_tokens"]
        assert src[-1] == "</s>"
        for h, ref in zip(row["hypotheses"], expected):
            assert h["alignment"] == ref["alignment"]
            pairs = [tuple(map(int, p.split("-"))) for p in h["alignment"].split()] if h["alignment"] else []
            assert [j for _, j in pairs] == list(range(len(h["tokens"])))
            assert all(0 <= i < len(src) - 1 for i, _ in pairs)
            att = h["attention"]
            assert (len(att), len(att[0])) == (layers, heads)
            for layer in att:
                for head in layer:
                    assert len(head) == len(h["tokens"]) + 1 and all(len(r) == len(src) for r in head)
                    assert all(sum(r) == pytest.approx(1.0, abs=1e-4) for r in head)


def test_no_cross_attention_in_a_decoder_only_model(client):
    out = ok(client.post("/translate", json={"model": "prefix_lm-transformer", "texts": ["red"], "attention": True,
                                             "alignments": True}))
    h = out["results"][0]["hypotheses"][0]
    assert h["alignment"] is None and "attention" not in h


def test_classify_fill_generate_equal_the_front_ends(client, reference):
    texts = ["red cat", "the big dog", "a small tree"]
    out = ok(client.post("/classify", json={"texts": texts}))  # the one classifier: no "model" needed
    expected = reference["classify-transformer"].classify(texts)
    assert [(r["label"], pytest.approx(r["probability"], abs=1e-6)) for r in out["results"]] == expected
    assert all(sum(r["probabilities"].values()) == pytest.approx(1.0, abs=1e-5) for r in out["results"])

    out = ok(client.post("/fill", json={"texts": ["red [MASK] cat"], "k": 3}))
    expected = reference["mlm-transformer"].fill("red [MASK] cat", k=3)
    assert [[(p["piece"], pytest.approx(p["probability"], abs=1e-6)) for p in m] for m in out["results"][0]["masks"]] \
        == expected

    # every piece asked for: the special ones ([MASK], <cls>, </s>, <sep>, <pad>, <s>, unk) are never offered
    out = ok(client.post("/fill", json={"texts": ["red [MASK] cat", "[MASK] [MASK]"], "k": 100}))
    offered = [p["piece"].strip() for r in out["results"] for m in r["masks"] for p in m]
    V = reference["mlm-transformer"].tokenizers.src.sp.get_piece_size()
    assert len(offered) == 3 * (V - 7)
    assert not set(offered) & {"[MASK]", "<cls>", "</s>", "<sep>", "<pad>", "<s>", "<unk>", "⁇", ""}, offered

    args = dict(prefix="red cat", max_new_tokens=20, temperature=0.8, top_k=0, top_p=1.0, seed=7)
    expected = "".join(reference["lm-transformer"].generate(**args))
    assert ok(client.post("/generate", json=args))["text"] == expected
    streamed = client.post("/generate", json={**args, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = streamed.text.strip().split("\n\n")
    assert events[-1] == "event: done\ndata: {}"
    assert "".join(json.loads(e.removeprefix("data: "))["text"] for e in events[:-1]) == expected


def test_models_health_page_docs(client):
    listed = {m["name"]: m for m in ok(client.get("/models"))["models"]}
    assert set(listed) == set(NAMES)
    assert listed["translate-transformer"]["endpoints"] == ["/translate", "/score"]
    assert listed["translate-transformer"]["cross_attention"] is True
    assert listed["prefix_lm-transformer"]["cross_attention"] is False
    assert listed["classify-transformer"]["labels"] and listed["lm-transformer"]["endpoints"] == ["/generate"]
    assert ok(client.get("/health"))["status"] == "ok"
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text), "the page fetches nothing from outside"
    assert "fetch(" in page.text and "<style>" in page.text
    assert "/translate" in ok(client.get("/openapi.json"))["paths"]


def test_models_names_no_checkpoint_paths(client):
    """GET /models tells each model's name; where its checkpoint lies on the server's disk stays there."""
    answer = client.get("/models")
    assert [m["name"] for m in ok(answer)["models"]] == NAMES
    assert all("path" not in m for m in answer.json()["models"])
    assert str(FIXTURES) not in answer.text and "fixtures" not in answer.text


# --- the host names a server answers (DNS rebinding) ---------------------------------------------------

@pytest.mark.parametrize("host,allowed,status", [
    ("evil.example", (), 400), ("evil.example:8000", (), 400), ("localhost.evil.example", (), 400),
    ("127.0.0.1.evil.example", (), 400), ("", (), 400),
    ("localhost", (), 200), ("LocalHost:8000", (), 200), ("127.0.0.1:8000", (), 200), ("127.3.4.5", (), 200),
    ("[::1]:8000", (), 200), ("[::1]", (), 200),
    ("evil.example:9", ("evil.example",), 200), ("other.example", ("evil.example",), 400),
    ("localhost", ("evil.example",), 200), ("evil.example", ("*",), 200),
])
def test_only_loopback_host_names_unless_allowed(models, host, allowed, status):
    c = TestClient(create_app(models, SMALL, allowed), base_url=LOCAL)  # not entered: /models needs no batcher
    r = c.get("/models", headers={"host": host})
    assert r.status_code == status, r.text
    if status == 400:
        assert "does not answer" in r.json()["error"] and "--allowed-hosts" in r.json()["error"]
        assert "models" not in r.json()


def test_a_real_server_refuses_an_outside_host_name():
    """As ``curl -H 'Host: evil.example' 127.0.0.1:PORT/models``, and a request with no Host at all (HTTP/1.0)."""
    served = load_models([str(FIXTURES / "translate-transformer")], Limits())
    with BackgroundServer(create_app(served, Limits())) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/models", headers={"Host": "evil.example"}).status_code == 400
        assert c.post("/translate", json={"texts": ["red"]}, headers={"Host": "evil.example"}).status_code == 400
        assert c.get("/models", headers={"Host": f"localhost:{server.url.rsplit(':', 1)[1]}"}).status_code == 200
        assert c.get("/models").status_code == 200  # Host: 127.0.0.1:PORT
        with socket.create_connection(server.sock.getsockname()[:2], timeout=30) as raw:
            raw.sendall(b"GET /models HTTP/1.0\r\n\r\n")
            assert raw.makefile("rb").readline().split()[1] == b"400"


def test_allowed_hosts_flag():
    from qkv.errors import ConfigError
    from qkv.serve.hosts import allowed_hosts

    assert allowed_hosts("127.0.0.1") == () and allowed_hosts("localhost") == () and allowed_hosts("::1") == ()
    assert allowed_hosts("0.0.0.0") == ("*",)  # another address answers any name, unless told which
    assert allowed_hosts("0.0.0.0", ["box.lan"]) == ("box.lan",)
    assert allowed_hosts("127.0.0.1", ["a.example, B.example:8000", "[fe80::1]", "*"]) == \
        ("a.example", "b.example", "fe80::1", "*")
    for bad in ["http://a.example/", "a b", "a,,b", ""]:
        with pytest.raises(ConfigError, match="--allowed-hosts"):
            allowed_hosts("127.0.0.1", [bad])


def test_a_server_open_to_the_network_warns_that_it_has_no_authentication(monkeypatch):
    """``--host 0.0.0.0`` says at start that anyone who reaches it can use the models (the test
    listens on 127.0.0.1 all the same, and does not run the server)."""
    import uvicorn

    from qkv.serve import server as server_module

    sockets = []

    def loopback(host, port):
        sockets.append(socket.create_server(("127.0.0.1", 0)))
        return sockets[-1]

    monkeypatch.setattr(server_module, "bind", loopback)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    said = {}
    try:
        for host in ("0.0.0.0", "127.0.0.1"):
            said[host] = []
            server_module.serve([str(FIXTURES / "translate-transformer")], host=host, port=0, log=said[host].append)
    finally:
        for s in sockets:
            s.close()
    assert [line for line in said["0.0.0.0"] if "no authentication" in line][0].startswith("warning: --host 0.0.0.0")
    assert not any("warning" in line for line in said["127.0.0.1"])
    assert any("--allowed-hosts" in line for line in said["127.0.0.1"])


def local_references(html: str) -> list[str]:
    """Every src= and href= of a page, each checked to be a path on this server (nothing from outside)."""
    urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html)
    outside = [u for u in urls if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|//", u)]  # a scheme or another host
    assert not outside, f"the page fetches from outside: {outside}"
    assert not re.search(r"https?://", html), "no address outside this server, even in the page's script"
    return urls


FETCH_OUTSIDE = re.compile(r"""(?:\bsrc\s*[:=]\s*|\burl\(\s*|\bfetch\(\s*)["']?(?:https?:)?//""")


def test_nothing_the_server_serves_fetches_from_outside(client):
    """Every page the server serves names no other host, and no script or style it serves has the
    browser fetch an image, script or style from one (ReDoc's script fetched its maker's logo)."""
    pytest.importorskip("fastapi_offline", reason="/docs and /redoc need fastapi-offline: "
                                                  'pip install -c constraints.txt -e ".[serve]"')
    from qkv.serve.app import DOCS_FILES, docs_files

    pages = [r.path for r in client.app.routes if "GET" in getattr(r, "methods", ()) and "{" not in r.path]
    assert {"/", "/docs", "/redoc", "/models", "/openapi.json"} <= set(pages)
    for path in pages:
        answer = client.get(path)
        assert answer.status_code in (200, 204), path
        if answer.headers.get("content-type", "").startswith("text/html"):
            local_references(answer.text)
    files = [f"{DOCS_FILES}/{f.name}" for f in docs_files().iterdir() if f.suffix in (".js", ".css")]
    assert f"{DOCS_FILES}/redoc.standalone.js" in files and len(files) == 3
    for url in files:
        answer = client.get(url)
        assert answer.status_code == 200 and not FETCH_OUTSIDE.findall(answer.text), (url, FETCH_OUTSIDE.findall(
            answer.text))
    assert '"validatorUrl": null' in client.get("/docs").text  # Swagger UI's badge would come from its validator's site


@pytest.mark.parametrize("path,scripts", [("/docs", ["swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"]),
                                          ("/redoc", ["redoc.standalone.js", "favicon.png"])])
def test_api_docs_pages_are_served_from_local_files(client, path, scripts):
    pytest.importorskip("fastapi_offline", reason="/docs and /redoc need fastapi-offline: "
                                                  'pip install -c constraints.txt -e ".[serve]"')
    page = client.get(path)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    urls = local_references(page.text)
    assert "/openapi.json" in page.text
    assert sorted(u.rsplit("/", 1)[-1] for u in urls) == sorted(scripts)
    for url in urls:
        got = client.get(url)
        assert got.status_code == 200 and len(got.content) > 500, url
    if path == "/redoc":  # and should anything still try, the browser fetches images from here only
        assert page.headers["content-security-policy"] == "img-src 'self' data:"


def test_api_docs_pages_say_how_to_install_their_files(models, monkeypatch):
    monkeypatch.setattr("qkv.serve.app.docs_files", lambda: None)
    c = TestClient(create_app(models, SMALL), base_url=LOCAL)  # not entered: the shared models' batchers left running
    for path in ("/docs", "/redoc"):
        page = c.get(path)
        assert page.status_code == 404 and "fastapi-offline" in page.text and ".[serve]" in page.text
        local_references(page.text)
    assert "/translate" in ok(c.get("/openapi.json"))["paths"]


# --- refused requests: 4xx with a message, and the server still answers -------------------------------

BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b'{"texts": "red cat"}', 422, "texts"),
    (b'{"texts": [1, 2]}', 422, "texts.0"),
    (b'{"texts": ["red"], "beam_size": "four"}', 422, "beam_size"),
    (b'{"texts": ["red"], "beam_size": 10000}', 422, "beam_size 10000"),
    (b'{"texts": ["red"], "n_best": 5, "beam_size": 8}', 422, "n_best 5"),
    (b'{"texts": ["red"], "n_best": 3, "beam_size": 2}', 422, "n_best 3 is more than beam_size 2"),
    (b'{"texts": ["red"], "beam_size": 0}', 422, "beam_size"),
    (b'{"texts": []}', 422, "texts"),
    (b'{"texts": ["red"], "colour": "blue"}', 422, "colour"),
    (b'[1, 2]', 422, "dictionary"),
    (b'{"texts": ["\\ud800"]}', 422, "lone surrogate"),
    (b'{"texts": ["red"], "model": "nope"}', 404, "no model named 'nope'"),
    (b'\xff\xfe{"texts": []}', 400, "UTF-8"),
    (json.dumps({"texts": ["red"] * 17}).encode(), 413, "at most 16"),
    (json.dumps({"texts": ["red " * 60]}).encode(), 413, "characters"),
    (json.dumps({"texts": ["red cat " * 10]}).encode(), 413, "tokens"),
    (b'{"texts": ["' + b"x" * 30_000 + b'"]}', 413, "bytes"),
    (json.dumps({"texts": ["red"] * 5, "n_best": 4, "attention": True}).encode(), 413, "at most 16 per request"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[f"{i}-{s}" for i, (_, s, _) in enumerate(BAD)])
def test_bad_requests_are_refused_by_name(client, body, status, message):
    if b'"model"' not in body and body.startswith(b"{") and b"nope" not in body:
        body = body.replace(b"{", b'{"model": "translate-transformer", ', 1) if body != b"{not json" else body
    r = client.post("/translate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert ok(client.get("/health"))["status"] == "ok"


@pytest.mark.parametrize("path,body,status,message", [
    ("/classify", {"model": "translate-transformer", "texts": ["a"]}, 422, "serves /translate, /score, not /classify"),
    ("/translate", {"texts": ["a"]}, 422, "several models serve /translate"),
    ("/fill", {"texts": ["no mask here"]}, 422, "no [MASK]"),
    ("/score", {"model": "translate-transformer", "sources": ["a", "b"], "targets": ["a"]}, 422, "2 sources but 1"),
    ("/generate", {"prefix": "red", "max_new_tokens": 51}, 422, "max_new_tokens 51"),
    ("/generate", {"prefix": "red", "temperature": -1}, 422, "temperature"),
    ("/generate", {"prefix": "red", "top_p": 0}, 422, "top_p"),
    ("/generate", {"prefix": "red", "top_p": 1e-300}, 422, "top_p"),  # 0 in float32: nothing kept
    ("/generate", {"prefix": "red", "temperature": 1e-40}, 422, "temperature"),  # logits overflow
    ("/nowhere", {}, 404, "Not Found"),
])
def test_other_refusals(client, path, body, status, message):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert client.get("/translate").status_code == 405


@pytest.mark.parametrize("path,body,message", [
    ("/translate", {"model": "translate-transformer", "texts": ["red", ""]}, "text 2 is empty"),
    ("/translate", {"model": "translate-lstm-general", "texts": [" \t "]}, "text 1 is empty"),
    ("/translate", {"model": "prefix_lm-transformer", "texts": ["\n"]}, "text 1 is empty"),
    ("/translate", {"model": "translate-transformer", "texts": ["red"], "target_prefix": ""},
     "target_prefix 1 is empty"),
    ("/score", {"model": "translate-transformer", "sources": ["red", " "], "targets": ["a", "b"]}, "source 2 is empty"),
    ("/classify", {"texts": ["red", ""]}, "text 2 is empty"),
    ("/classify", {"texts": ["  "]}, "text 1 is empty"),
    ("/fill", {"texts": [""]}, "text 1 is empty"),
    ("/generate", {"prefix": "", "max_new_tokens": 5}, "prefix 1 is empty"),
    ("/generate", {"prefix": " ", "max_new_tokens": 5, "stream": True}, "prefix 1 is empty"),
])
def test_an_empty_text_is_refused_on_every_endpoint(client, path, body, message):
    """One rule for every endpoint (docs/serving.md): a text a model reads must hold more than spaces."""
    r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == f"{message}: every {message.split()[0]} must hold more than spaces"


def test_an_empty_target_is_scored(client, reference):
    """The exception: /score's target may be empty, the empty translation (its EOS alone)."""
    row = ok(client.post("/score", json={"model": "translate-transformer", "sources": ["red"], "targets": [""]}))
    assert row["results"][0]["tokens"] == ["</s>"]
    expected = reference["translate-transformer"].score(["red"], [""])[0]
    assert row["results"][0]["token_logprobs"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("field,value", [("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"),
                                         ("temperature", "-Infinity")])
def test_a_number_that_is_not_finite_is_named_so(client, field, value):
    r = client.post("/generate", content=f'{{"prefix": "red", "{field}": {value}}}'.encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"] == f"{field}: Input should be a finite number"


# --- batching ----------------------------------------------------------------------------------------

def test_concurrent_requests_are_batched_and_equal_one_at_a_time(models):
    """8 concurrent requests on a real server: fewer batches than requests, the same answers as
    the requests sent one at a time."""
    model = next(m for m in models if m.name == "translate-transformer")
    limits = Limits(batch_wait_ms=300, max_batch_tokens=10_000)
    served = load_models([str(FIXTURES / "translate-transformer")], limits)
    batches = []
    served[0].batcher.on_batch = lambda key, requests, items: batches.append(requests)
    texts = [[s] for s in SOURCES] + [SOURCES[:2], SOURCES[1:3], ["red"], ["tree cat"]]
    with BackgroundServer(create_app(served, limits)) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        one_at_a_time = [c.post("/translate", json={"texts": t, "n_best": 2}).json() for t in texts]
        assert len(batches) == len(texts)
        batches.clear()
        barrier = threading.Barrier(len(texts))

        def send(t):
            barrier.wait()
            return c.post("/translate", json={"texts": t, "n_best": 2}).json()

        with ThreadPoolExecutor(len(texts)) as pool:
            together = list(pool.map(send, texts))
        health = c.get("/health").json()["batching"]["translate-transformer"]
    assert sum(batches) == len(texts) and len(batches) < len(texts), batches
    assert health["largest_batch"] > 1
    for a, b in zip(one_at_a_time, together):
        assert [[h["text"] for h in r["hypotheses"]] for r in a["results"]] == \
            [[h["text"] for h in r["hypotheses"]] for r in b["results"]]
        assert [h["score"] for r in a["results"] for h in r["hypotheses"]] == \
            pytest.approx([h["score"] for r in b["results"] for h in r["hypotheses"]], abs=1e-5)
    assert model.batcher.stats.failed == 0


def test_settings_batch_separately_and_a_failing_request_fails_alone():
    """Requests with different settings run in different batches; a batch that raises is re-run one
    request at a time, so only the bad request gets the error; the batcher goes on."""
    calls = []

    def run(key, items):
        calls.append((key, list(items)))
        if "boom" in items:
            raise ValueError("boom")
        return [f"{key}:{x}" for x in items]

    async def scenario():
        b = Batcher(run, wait_ms=100)
        b.start()
        results = await asyncio.gather(b.submit("a", ["1"], 1), b.submit("b", ["2"], 1), b.submit("a", ["3", "4"], 2),
                                       b.submit("a", ["boom"], 1), return_exceptions=True)
        after = await b.submit("a", ["5"], 1)
        await b.stop()
        return results, after, b.stats

    results, after, stats = asyncio.run(scenario())
    assert results[:3] == [["a:1"], ["b:2"], ["a:3", "a:4"]]
    assert isinstance(results[3], ValueError) and after == ["a:5"]
    assert calls[0] == ("a", ["1", "3", "4", "boom"]) and ("b", ["2"]) in calls
    assert stats.failed == 1 and stats.requests == 4


def test_calls_outside_batches_count_against_max_queue():
    """Generations run on the worker thread outside the batches: they too are bounded by max_queue,
    and a refused streaming call ends its stream instead of leaving it waiting."""
    import threading

    from qkv.serve.batcher import Busy

    release = threading.Event()

    async def scenario():
        b = Batcher(lambda key, items: items, max_queue=2)
        b.start()
        first = asyncio.ensure_future(b.call(release.wait))
        second = asyncio.ensure_future(b.call(lambda: "second"))
        await asyncio.sleep(0.05)
        with pytest.raises(Busy):
            await b.call(lambda: "third")
        with pytest.raises(Busy):
            await b.submit("a", ["x"], 1)
        release.set()
        done = await asyncio.gather(first, second)
        after = await b.call(lambda: "after")
        await b.stop()
        return done, after

    done, after = asyncio.run(scenario())
    assert done == [True, "second"] and after == "after"


def test_a_model_error_is_a_500_for_that_request_only(models, monkeypatch):
    served = load_models([str(FIXTURES / "translate-transformer")], Limits(batch_wait_ms=200))
    translator = served[0].frontend
    real = translator.translate_rich

    def flaky(texts, **kw):
        if "blue" in texts:
            raise RuntimeError("the model broke")
        return real(texts, **kw)

    monkeypatch.setattr(translator, "translate_rich", flaky)
    with TestClient(create_app(served, Limits()), base_url=LOCAL) as c, ThreadPoolExecutor(3) as pool:
        rs = list(pool.map(lambda t: c.post("/translate", json={"texts": [t]}), ["red cat", "blue", "small tree"]))
        assert [r.status_code for r in rs] == [200, 500, 200]
        assert "the model broke" in rs[1].json()["error"]
        assert ok(c.post("/translate", json={"texts": ["red"]}))["results"]
        assert ok(c.get("/health"))["status"] == "ok"


def test_a_real_server_refuses_a_10_mb_body_and_stays_up():
    served = load_models([str(FIXTURES / "translate-transformer")], Limits())
    with BackgroundServer(create_app(served, Limits())) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        big = c.post("/translate", content=b'{"texts": ["' + b"a" * 10_000_000 + b'"]}',
                     headers={"content-type": "application/json"})
        assert big.status_code == 413 and "at most 1,000,000" in big.json()["error"]
        chunked = c.post("/translate", content=iter([b'{"texts": ["', b"a" * 1_500_000, b'"]}']),
                         headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        assert c.post("/translate", json={"texts": ["red cat"]}).status_code == 200


def answer_of(sock: socket.socket) -> tuple[bytes, dict]:
    """The status line and the JSON body of the answer on ``sock``, read until the server closes it
    (a server that keeps it open fails the test when the socket's own timeout runs out)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)


def test_a_client_that_sends_its_whole_oversize_body_before_reading_gets_the_413():
    """As curl or a plain socket client does: the whole 10 or 30 MB body, then read. The server reads
    and drops a refused body of up to 64 x --max-body-bytes before it answers; a server that answered
    and closed at once would leave unread data, and the client's system would reset the connection
    (ConnectionResetError) before the answer is read."""
    served = load_models([str(FIXTURES / "translate-transformer")], Limits())
    head = "POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n"
    with BackgroundServer(create_app(served, Limits())) as server:
        for mb in (10, 30):
            body = b'{"texts": ["' + b"one " * (mb * 250_000) + b'"]}'
            with socket.create_connection(server.sock.getsockname()[:2], timeout=30) as sock:
                sock.sendall(head.format(len(body)).encode() + body)
                status, answer = answer_of(sock)
            assert status == b"HTTP/1.1 413 Request Entity Too Large", (mb, status)
            assert "(its Content-Length)" in answer["error"] and "at most 1,000,000" in answer["error"]
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post("/translate", json={"texts": ["red cat"]}).status_code == 200


def test_a_declared_oversize_body_is_refused_before_it_arrives_and_a_stalled_body_times_out():
    """A Content-Length over --max-body-bytes is answered 413 at once, with nothing of the body sent;
    a body that stops halfway is answered 408 when --body-timeout (1 s here) runs out, and the connection
    closes; other clients are answered all the while."""
    limits = Limits(body_timeout=1.0)
    served = load_models([str(FIXTURES / "translate-transformer")], limits)
    head = "POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n"
    with BackgroundServer(create_app(served, limits)) as server:
        address = server.sock.getsockname()[:2]
        with socket.create_connection(address, timeout=8) as declared:
            declared.sendall(head.format(10**9).encode())
            start = time.monotonic()
            status, body = answer_of(declared)
            assert time.monotonic() - start < 3
        assert status == b"HTTP/1.1 413 Request Entity Too Large" and "1,000,000,000 bytes" in body["error"], body
        with socket.create_connection(address, timeout=20) as stalled, ThreadPoolExecutor(1) as pool:
            stalled.sendall(head.format(100).encode() + b'{"texts": ["red')
            start = time.monotonic()
            answer = pool.submit(lambda: (answer_of(stalled), time.monotonic() - start))
            with httpx.Client(base_url=server.url, timeout=30) as c:
                assert c.post("/translate", json={"texts": ["red cat"]}).status_code == 200
            (status, body), after = answer.result()
            assert 0.9 <= after < 15  # never: the socket's own timeout, 20 s
        assert status == b"HTTP/1.1 408 Request Timeout" and "did not arrive within 1 s" in body["error"], body
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post("/translate", json={"texts": ["red cat"]}).status_code == 200


def test_server_defaults_are_checked_before_it_serves(capsys, monkeypatch):
    """A decoding default that every request would trip over (a beam over --max-beam or over the
    vocabulary, a length penalty that overflows) is refused at start, in one line, before a socket is
    bound or a model loaded where the flags alone tell."""
    import qkv.serve.server as server

    monkeypatch.setattr(server, "bind", lambda *a: pytest.fail("the server started"))
    model = str(FIXTURES / "translate-transformer")
    for argv, needle in ((["--beam-size", "1000000"], "--beam-size must be a whole number from 1 to 4096"),
                         (["--beam-size", "100"], "--beam-size 100 is more than --max-beam 16"),
                         (["--nbest", "10", "--beam-size", "10"], "--nbest 10 is more than --max-nbest 8"),
                         (["--beam-size", "1000", "--max-beam", "1000"], "1000 is larger than the model's target vocabulary"),
                         (["--length-penalty", "1000"], "--length-penalty must be a number from 0 to 10")):
        assert main(["serve", model, "--port", "0", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and needle in err, (argv, err)


def closed_after(sock: socket.socket, since: float) -> float:
    """Seconds from ``since`` until the server closes ``sock`` (what it sends before is read and dropped);
    a server that keeps it open fails the test when the socket's own timeout runs out."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - since


def test_slow_clients_are_disconnected_while_others_are_answered():
    """Connections that send nothing, part of a request head (``GET /he``) or trickle one byte at a
    time are closed when the header timeout runs out (1 s here), not before; other clients are answered
    all the while, on connections kept alive between requests; an idle connection is closed after
    the keep-alive timeout."""
    limits = Limits(header_timeout=1.0, keep_alive_timeout=1.0)
    served = load_models([str(FIXTURES / "translate-transformer")], limits)
    heads = [b"", b"GET /he", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"]  # no blank line: never complete
    with BackgroundServer(create_app(served, limits)) as server:
        address = server.sock.getsockname()[:2]
        start = time.monotonic()
        slow = [socket.create_connection(address, timeout=8) for _ in range(6)]
        for i, sock in enumerate(slow):
            sock.sendall(heads[i % len(heads)])
        trickle = socket.create_connection(address, timeout=8)
        stop = threading.Event()

        def drip():  # 0.2 s a byte: each byte would restart a timer of the connection's idle time
            for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"x" * 40:
                if stop.wait(0.2):
                    return
                try:
                    trickle.sendall(bytes([byte]))
                except OSError:
                    return

        dripping = threading.Thread(target=drip)
        dripping.start()
        try:
            with ThreadPoolExecutor(len(slow) + 1) as pool:
                closing = [pool.submit(closed_after, sock, start) for sock in slow + [trickle]]
                with httpx.Client(base_url=server.url, timeout=30) as c:
                    for _ in range(3):  # one connection, kept alive: 0.5 s between requests, under both timeouts
                        assert c.post("/translate", json={"texts": ["red cat"]}).status_code == 200
                        time.sleep(0.5)
                times = [f.result() for f in closing]
        finally:
            stop.set()
            dripping.join()
            for sock in slow + [trickle]:
                sock.close()
        assert all(1.0 <= t < 7 for t in times), times
        with socket.create_connection(address, timeout=8) as idle:
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answered = time.monotonic()
            assert idle.recv(12) == b"HTTP/1.1 200"
            assert 0.9 <= closed_after(idle, answered) < 7
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.get("/health").json()["status"] == "ok"


def test_timeouts_are_flags(capsys):
    model = str(FIXTURES / "translate-transformer")
    assert main(["serve", model, "--header-timeout", "0"]) == 2
    assert "--header-timeout must be a number from 0.1 to 3600, got 0" in capsys.readouterr().err
    assert main(["serve", model, "--keep-alive-timeout", "nan"]) == 2
    assert "--keep-alive-timeout" in capsys.readouterr().err


# --- --engine ctranslate2 --------------------------------------------------------------------------------

needs_ct2 = pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None,
                               reason='--engine ctranslate2 needs ctranslate2: pip install -c constraints.txt -e ".[export]"')
TRAINED = FIXTURES.parent / "default-task"  # trained: CTranslate2's beam search gives qkv's outputs on it
NUMBERS = ["three hundred twenty-one", "forty-two", "seven", "nine thousand nine hundred ninety-nine"]
CT2_DECODE = {"length_norm": "length", "early_stopping": True}  # qkv serve --length-norm length --early-stopping


class Counting:
    """A ctranslate2.Translator that counts its translate_batch calls (what the server feeds it)."""

    def __init__(self, translator):
        self.translator, self.calls = translator, []

    def translate_batch(self, source, *args, **kwargs):
        self.calls.append(len(source))
        return self.translator.translate_batch(source, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.translator, name)


@pytest.fixture(scope="module")
def ct2_served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    shutil.copytree(TRAINED, root / "numbers")  # the conversion is cached beside the checkpoint
    shutil.copytree(FIXTURES / "lm-lstm", root / "lm")  # a recurrent LM: no CTranslate2 engine
    return root


@needs_ct2
def test_ctranslate2_engine_answers_as_qkv_engine(ct2_served):
    """The same requests to a server on each engine: equal texts, tokens and alignments, scores within
    0.01 (CTranslate2's log-probabilities leave out the special tokens); attention weights of every
    layer and head: 501 naming the engine that gives them; a beam search CTranslate2 cannot run as qkv
    does: 422 naming the flag."""
    path = str(ct2_served / "numbers")
    qkv_models = load_models([path], SMALL, decode=CT2_DECODE)
    ct2_models = load_models([path], SMALL, engine="ctranslate2", threads=1, decode=CT2_DECODE)
    assert ct2_models[0].frontend.engine == "ctranslate2"
    with TestClient(create_app(qkv_models, SMALL), base_url=LOCAL) as ours, \
            TestClient(create_app(ct2_models, SMALL), base_url=LOCAL) as theirs:
        for body in [{"beam_size": 1}, {"beam_size": 4, "n_best": 2, "alignments": True},
                     {"beam_size": 1, "target_prefix": "drei", "alignments": True}]:
            want = ok(ours.post("/translate", json={"texts": NUMBERS, **body}))["results"]
            got = ok(theirs.post("/translate", json={"texts": NUMBERS, **body}))["results"]
            for w, g in zip(want, got):
                for a, b in zip(w["hypotheses"], g["hypotheses"], strict=True):
                    assert (b["text"], b["tokens"], b.get("alignment")) == (a["text"], a["tokens"], a.get("alignment"))
                    assert b["score"] == pytest.approx(a["score"], abs=0.01)
                    assert b["token_logprobs"] == pytest.approx(a["token_logprobs"], abs=0.01)
                    n = len(b["token_logprobs"])  # greedy's too: its tokens' forced log-probabilities
                    assert b["logprob"] == pytest.approx(a["logprob"], abs=0.01 * n) and b["logprob"] < 0
                    if "target_prefix" not in body:  # (with one, logprob covers the tokens after it)
                        assert b["logprob"] == pytest.approx(sum(b["token_logprobs"]), abs=1e-4)
        pairs = {"sources": NUMBERS[:2], "targets": ["dreihunderteinundzwanzig", ""]}
        want, got = ok(ours.post("/score", json=pairs)), ok(theirs.post("/score", json=pairs))
        for a, b in zip(want["results"], got["results"]):
            assert b["tokens"] == a["tokens"] and b["token_logprobs"] == pytest.approx(a["token_logprobs"], abs=0.01)
        r = theirs.post("/translate", json={"texts": NUMBERS[:1], "attention": True})
        assert r.status_code == 501 and "--engine qkv" in r.json()["error"]
        r = theirs.post("/translate", json={"texts": NUMBERS[:1], "beam_size": 4, "target_prefix": "drei"})
        assert r.status_code == 422 and "--target-prefix" in r.json()["error"]
        listed = ok(theirs.get("/models"))["models"][0]
        assert listed["engine"] == "ctranslate2" and listed["cross_attention"] is False
    notes = []
    default = load_models([path], SMALL, engine="ctranslate2", log=notes.append)  # its saved beam 4, gnmt
    assert notes[0].startswith(f"note: {path}: requests that name no beam_size will be refused (422): --length-norm "
                               "gnmt"), notes  # said at start, before the model is loaded
    with TestClient(create_app(default, SMALL), base_url=LOCAL) as c:
        r = c.post("/translate", json={"texts": NUMBERS[:1]})
        assert r.status_code == 422 and "--length-norm gnmt" in r.json()["error"]
        assert ok(c.post("/translate", json={"texts": NUMBERS[:1], "beam_size": 1}))["results"][0]["hypotheses"][0][
            "text"] == "dreihunderteinundzwanzig"


@needs_ct2
def test_ctranslate2_engine_decodes_each_batch_in_one_call(ct2_served):
    """Concurrent requests are batched as with qkv's engine, and each batch is one translate_batch call."""
    limits = Limits(batch_wait_ms=300, max_batch_tokens=10_000)
    served = load_models([str(ct2_served / "numbers")], limits, engine="ctranslate2", decode={"beam_size": 1})
    served[0].frontend.ct2 = counting = Counting(served[0].frontend.ct2)
    batches = []
    served[0].batcher.on_batch = lambda key, requests, items: batches.append(items)
    texts = [[t] for t in NUMBERS] + [NUMBERS[:2], NUMBERS[1:]]
    with BackgroundServer(create_app(served, limits)) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        barrier = threading.Barrier(len(texts))

        def send(t):
            barrier.wait()
            return c.post("/translate", json={"texts": t}).json()

        with ThreadPoolExecutor(len(texts)) as pool:
            together = list(pool.map(send, texts))
    assert len(batches) < len(texts) and counting.calls == batches  # one call per batch, all its items
    want = qkv.load(ct2_served / "numbers").translate(NUMBERS, beam_size=1)
    assert [r["hypotheses"][0]["text"] for r in together[0]["results"] + together[1]["results"]] == want[:2]


@needs_ct2
def test_ctranslate2_engine_refuses_what_it_cannot_decode_by_name(ct2_served):
    with pytest.raises(QkvError, match="'lm' model .*--engine qkv"):
        load_models([str(ct2_served / "lm")], SMALL, engine="ctranslate2")
    with pytest.raises(QkvError, match="length_norm"):
        load_models([str(ct2_served / "numbers")], SMALL, decode={"length_norm": "other"})


@needs_ct2
def test_the_command_passes_engine_and_decoding_flags(ct2_served, capsys, monkeypatch):
    """qkv serve --engine ctranslate2 --length-norm ...: the flags reach the models before anything is served."""
    lm, numbers = str(ct2_served / "lm"), str(ct2_served / "numbers")
    assert main(["serve", lm, "--engine", "ctranslate2", "--port", "0"]) == 2
    assert "--engine ctranslate2 runs these Transformer models" in capsys.readouterr().err
    assert main(["serve", numbers, "--engine", "ctranslate2", "--length-norm", "other", "--port", "0"]) == 2
    assert f"{numbers}: invalid config field 'length_norm'" in capsys.readouterr().err
    seen = {}

    def run(self, sockets):  # as far as the server goes: what it would serve
        seen.update({m.name: (m.frontend.engine, m.frontend.decode_cfg) for m in self.config.app.state.models.values()})

    monkeypatch.setattr("uvicorn.Server.run", run)
    assert main(["serve", numbers, "--engine", "ctranslate2", "--threads", "1", "--length-norm", "length",
                 "--early-stopping", "--port", "0"]) == 0
    engine, cfg = seen["numbers"]
    assert engine == "ctranslate2" and (cfg.length_norm, cfg.early_stopping, cfg.beam_size) == ("length", True, 4)


# --- the command ---------------------------------------------------------------------------------------

def test_model_names():
    assert model_name("runs/ende/best") == ("ende", Path("runs/ende/best"))
    assert model_name("en=runs/x/last") == ("en", Path("runs/x/last"))
    assert model_name("exported/model") == ("model", Path("exported/model"))


def test_cli_errors_exit_2_without_a_traceback(capsys, monkeypatch):
    model = str(FIXTURES / "translate-transformer")
    assert main(["serve", str(FIXTURES / "missing")]) == 2
    assert "qkv serve: error:" in capsys.readouterr().err
    assert main(["serve", model, "--max-beam", "0"]) == 2
    assert "--max-beam" in capsys.readouterr().err
    assert main(["serve", model, "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", model, "--allowed-hosts", "http://a.example/"]) == 2
    assert "--allowed-hosts: 'http://a.example/' is not a host name" in capsys.readouterr().err
    from qkv.serve import bind

    taken = bind("127.0.0.1", 0)
    try:
        assert main(["serve", model, "--port", str(taken.getsockname()[1])]) == 2
        assert "in use" in capsys.readouterr().err
    finally:
        taken.close()
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if the serve extra were not installed
    assert main(["serve", model]) == 2
    assert 'pip install -c constraints.txt -e ".[serve]"' in capsys.readouterr().err


def test_the_command_serves_until_stopped(tmp_path):
    """``qkv serve MODEL --port 0`` in a process of its own: it says where it listens, answers, stops."""
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "serve", f"tt={FIXTURES / 'translate-transformer'}",
                             "--port", "0", "--threads", "1"], stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    try:
        url, start = None, time.monotonic()
        while url is None and time.monotonic() - start < 120:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/", line)
            url = m.group(1) if m else None
        assert url, "the server did not say where it listens"
        r = httpx.post(url + "/translate", json={"texts": ["red cat"]}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "tt"
    finally:
        proc.terminate()
        proc.wait(30)


# --- a CTranslate2 worker that dies or stops answering --------------------------------------------------

def stop_then_kill_in_a_call(worker_pid: int, send) -> "httpx.Response":
    """The answer to ``send()`` when the worker is killed while the request is being decoded (stopped
    first, so that the kill lands in the call)."""
    import os
    import signal

    os.kill(worker_pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send)
        time.sleep(1.0)
        os.kill(worker_pid, signal.SIGKILL)
        return answer.result(60)


@needs_ct2
def test_a_killed_worker_is_a_503_then_the_model_answers_again_and_health_follows(ct2_served):
    """kill -9 of the worker during a request: that request gets 503 with Retry-After (a server failure,
    never a 4xx), the next one is answered by a new worker. A worker that cannot be started again:
    503 with Retry-After for requests and for /health (and /health?model=NAME), until one starts."""
    from qkv.engines import worker as ct2_worker

    served = load_models([f"numbers={ct2_served / 'numbers'}", str(FIXTURES / "translate-transformer")], SMALL,
                         engine="ctranslate2", threads=1, decode={"beam_size": 1})
    worker = served[0].frontend.ct2
    body = {"model": "numbers", "texts": NUMBERS[:2]}
    with TestClient(create_app(served, SMALL), base_url=LOCAL) as c:
        want = ok(c.post("/translate", json=body))
        health = ok(c.get("/health"))
        assert health["status"] == "ok" and health["states"]["numbers"] == {"state": "ready", "engine": "ctranslate2",
                                                                            "restarts": 0}
        assert ok(c.get("/health", params={"model": "numbers"}))["states"].keys() == {"numbers"}
        assert c.get("/health", params={"model": "nobody"}).status_code == 404
        first = worker.pid
        r = stop_then_kill_in_a_call(first, lambda: c.post("/translate", json=body))
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert "ended (exit status -9) during this call" in r.json()["error"]
        assert ok(c.post("/translate", json=body)) == want and worker.pid != first
        health = ok(c.get("/health"))["states"]["numbers"]
        assert (health["state"], health["restarts"], health["problem"]) == ("ready", 1,
                                                                           "the worker ended (exit status -9)")
        # a worker that cannot be started again: the model is failing, and says so, until one starts
        good = worker.kwargs["model_path"]
        worker.kwargs["model_path"] = str(ct2_served / "gone")
        r = stop_then_kill_in_a_call(worker.pid, lambda: c.post("/translate", json=body))
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
        assert "no worker could be started" in r.json()["error"]
        for params in ({}, {"model": "numbers"}):
            h = c.get("/health", params=params)
            assert h.status_code == 503 and h.json()["status"] == "failing" and int(h.headers["Retry-After"]) >= 1
            assert h.json()["states"]["numbers"]["state"] == "failed"
        other = c.get("/health", params={"model": "translate-transformer"})  # the other model answers
        assert other.status_code == 200 and other.json()["states"]["translate-transformer"]["state"] == "ready"
        r = c.post("/translate", json=body)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert 0 < int(r.headers["Retry-After"]) <= ct2_worker.COOLDOWN_S
        worker.kwargs["model_path"], worker.failed_until = good, time.monotonic()  # the cool-down has passed
        assert ok(c.post("/translate", json=body)) == want
        assert ok(c.get("/health"))["states"]["numbers"]["state"] == "ready"


@needs_ct2
def test_a_stopped_worker_holds_up_no_other_model_and_its_request_times_out_to_a_503(ct2_served):
    """kill -STOP of model a's worker (each model's translator takes every core: threads 0): a request to
    b is answered while a's waits; a's gets 503 with Retry-After once --engine-timeout has passed, its
    worker is replaced, and a answers the next request."""
    import os
    import signal

    path = ct2_served / "numbers"
    served = load_models([f"a={path}", f"b={path}"], SMALL, engine="ctranslate2", decode={"beam_size": 1},
                         engine_timeout=8)
    a = served[0].frontend.ct2
    assert a.timeout == 8 and served[1].frontend.ct2.timeout == 8
    with BackgroundServer(create_app(served, SMALL)) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        want = ok(c.post("/translate", json={"model": "a", "texts": NUMBERS}))["results"]
        first = a.pid
        os.kill(first, signal.SIGSTOP)
        start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(lambda: (c.post("/translate", json={"model": "a", "texts": NUMBERS}),
                                         time.monotonic()))
            time.sleep(0.3)
            other = ok(c.post("/translate", json={"model": "b", "texts": NUMBERS}))["results"]
            answered = time.monotonic() - start
            assert c.get("/health").status_code == 200  # a's worker has not missed its bound yet
            r, at = stuck.result(60)
        assert other == want and answered < 7, answered  # before a's bound: its call held no core b needed
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert "did not answer this call within 8 s and was killed" in r.json()["error"]
        assert 8 <= at - start < 25
        assert a.pid != first and a.restarts == 1
        health = ok(c.get("/health"))["states"]
        assert health["a"]["problem"] == "the worker did not answer within 8 s" and health["b"]["restarts"] == 0
        assert ok(c.post("/translate", json={"model": "a", "texts": NUMBERS}))["results"] == want
