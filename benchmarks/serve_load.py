"""qkv serve under load: throughput and latency against concurrency, bad requests, a bounded soak.

    python benchmarks/serve_load.py [--model runs/serve-default/best] [--multi30k-model runs/serve-multi30k/best]
                                    [--concurrency 1,8,32,128] [--requests 128] [--soak-seconds 300] [--threads 2]
                                    [--engine qkv,ctranslate2] [--serve-flags "--beam-size 1"]

1. Models. ``--model``: the embedded default task's model; trained first with ``qkv train --out
   runs/serve-default`` when the directory does not exist. ``--multi30k-model``: a Transformer
   with the Multi30k preset's shapes (``recipes/multi30k/en-de.toml``: 4 + 4 layers, d_model 128,
   BPE 6000); when missing it is trained *briefly* (``--multi30k-train-seconds``, default 240 s on
   one thread) on ``--data``: a model of the right size and cost, not a good translator (its
   outputs read like "Ein Mann mit einem einem einem.").
   ``--multi30k-model none`` (``--model none``) leaves it out.
2. ``qkv serve`` runs as a process of its own on 127.0.0.1 (a free port), as a user runs it, once
   for each ``--engine`` in turn (``qkv serve --engine``), with ``--serve-flags`` (e.g. the decoding
   flags both engines must share: ``--beam-size 1``, or ``--length-norm length --early-stopping``);
   every engine's answers are compared with the first one's.
3. Load: for each concurrency c in ``--concurrency``, c clients (asyncio, one keep-alive HTTP/1.1
   connection each, opened before the clock starts; a hand-written client, because httpx's
   connection pool, not the server, limited throughput at 128 clients) send ``max(--requests, 4c)``
   one-sentence translation requests (the model's own beam) as fast as answers come back:
   requests/s, p50 and p99 latency, the server's mean batch size, and whether every answer equals
   the answer to the same sentence sent one request at a time (c = 1, the baseline);
   ``--multi30k-requests`` (default 32) for the slower Multi30k-shaped model.
4. Bad requests (malformed JSON, wrong types, a 10 MB body, 10,000 texts, beam 10,000, invalid
   UTF-8, an unknown model): each must get a 4xx with a message, and /health must answer after it
   (against the first engine's server).
5. Soak (the first engine's server; ``--soak-seconds 0`` leaves it out): ``--soak-clients`` clients send a mix (translations with random beam and n-best, scores,
   a bad request now and then) to both models for ``--soak-seconds``; requests sent, answered
   (the expected status), lost (no answer, or an unexpected status) -- lost must be 0 -- and the
   server's resident memory before and after.

Prints a Markdown table and writes JSON to benchmarks/results/serve-load-DATE.json (the server's own
log to runs/serve-load-server.log).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gzip
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def qkv(*args: str, threads: int = 1) -> list[str]:
    return [sys.executable, "-m", "qkv", *args, "--threads", str(threads)]


def environment(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}


def ensure_default(path: Path, threads: int) -> None:
    if path.exists():
        return
    log(f"training the embedded default task into {path.parent} (qkv train)")
    subprocess.run(qkv("train", "--out", str(path.parent), threads=threads), check=True, env=environment(threads))


def ensure_multi30k(path: Path, data: Path, seconds: float, threads: int) -> None:
    if path.exists():
        return
    log(f"a Multi30k-shaped Transformer, trained for {seconds:.0f} s only, into {path.parent}")
    files = {k: str(data / f"{name}.gz") for k, name in
             {"src-train": "train.en", "tgt-train": "train.de", "src-valid": "val.en", "tgt-valid": "val.de"}.items()}
    subprocess.run(qkv("train", "--config", str(ROOT / "recipes/multi30k/en-de.toml"),
                       *[x for k, v in files.items() for x in (f"--{k}", v)], "--max-time", str(seconds),
                       "--eval-every", "100000", "--eval-bleu-samples", "0", "--out", str(path.parent),
                       threads=threads), check=True, env=environment(threads))


class Server:
    """``qkv serve`` in a process of its own, on a free loopback port."""

    def __init__(self, models: list[str], threads: int, extra: list[str], log_file: Path):
        cmd = qkv("serve", *models, "--port", "0", *extra, threads=threads)
        self.log = open(log_file, "w")  # the access log; stderr is read to its end, so the server never blocks on it
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.PIPE, text=True, env=environment(threads))
        self.url = None
        start = time.monotonic()
        while self.url is None and time.monotonic() - start < 300:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise SystemExit(f"qkv serve stopped: exit {self.proc.returncode}")
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/", line)
            self.url = m.group(1) if m else None
        if self.url is None:
            raise SystemExit("qkv serve did not say where it listens")
        threading.Thread(target=lambda: [self.log.write(line) for line in self.proc.stderr], daemon=True).start()

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


class Connection:
    """One keep-alive HTTP/1.1 connection over asyncio streams: a client light enough that 128 of
    them in one process do not become the bottleneck (httpx's pool costs grow with its size)."""

    def __init__(self, url: str):
        self.host, self.port = url.removeprefix("http://").split(":")
        self.reader = self.writer = None

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))
        data = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await self.writer.drain()
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
        payload = await self.reader.readexactly(int(headers["content-length"]))
        if headers.get("connection", "").lower() == "close":
            self.writer.close()
            self.writer = None
        return status, json.loads(payload)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


async def load_level(url: str, model: str, sentences: list[str], concurrency: int, n: int) -> dict:
    """``n`` requests of one sentence each from ``concurrency`` clients; latencies and answers."""
    queue = list(range(n))
    latencies, answers, errors = [0.0] * n, [None] * n, []
    connections = [Connection(url) for _ in range(concurrency)]

    async def worker(conn: Connection):
        while queue:
            i = queue.pop()
            t = time.perf_counter()
            try:
                status, out = await conn.post("/translate", {"model": model, "texts": [sentences[i % len(sentences)]]})
                if status != 200:
                    errors.append(f"{status}: {out}")
                else:
                    answers[i] = out["results"][0]["hypotheses"][0]["text"]
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                errors.append(repr(e))
                conn.writer = None
            latencies[i] = time.perf_counter() - t

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        before = (await client.get("/health")).json()["batching"][model]
        await asyncio.gather(*(c.post("/score", {"model": model, "sources": ["x"], "targets": ["x"]})
                               for c in connections))  # the connections, opened before the clock starts
        before = (await client.get("/health")).json()["batching"][model]
        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in connections))
        wall = time.perf_counter() - start
        after = (await client.get("/health")).json()["batching"][model]
    for c in connections:
        await c.close()
    batches = after["batches"] - before["batches"]
    return {"concurrency": concurrency, "requests": n, "seconds": wall, "rps": n / wall,
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * percentile(latencies, 99),
            "batches": batches, "mean_batch": (after["requests"] - before["requests"]) / max(batches, 1),
            "errors": errors[:5], "n_errors": len(errors), "answers": answers}


def bad_requests(url: str, model: str) -> list[dict]:
    cases = [
        ("malformed JSON", b'{"texts": ["one",', {}),
        ("wrong types (texts a string)", json.dumps({"model": model, "texts": "one"}).encode(), {}),
        ("wrong types (beam_size a string)", json.dumps({"model": model, "texts": ["one"], "beam_size": "4"}).encode(), {}),
        ("10 MB body", b'{"texts": ["' + b"one " * 2_500_000 + b'"]}', {}),
        ("10,000 texts", json.dumps({"model": model, "texts": ["one"] * 10_000}).encode(), {}),
        ("beam 10,000", json.dumps({"model": model, "texts": ["one"], "beam_size": 10_000}).encode(), {}),
        ("invalid UTF-8", b'{"texts": ["\xff\xfe one"]}', {}),
        ("unknown model", json.dumps({"model": "nope", "texts": ["one"]}).encode(), {}),
        ("n_best over beam", json.dumps({"model": model, "texts": ["one"], "beam_size": 2, "n_best": 3}).encode(), {}),
    ]
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for what, body, _ in cases:
            t = time.perf_counter()
            r = c.post("/translate", content=body, headers={"content-type": "application/json"})
            message = r.json().get("error", "") if r.headers.get("content-type", "").startswith("application/json") else ""
            alive = c.get("/health").json()["status"] == "ok"
            out.append({"request": what, "status": r.status_code, "ms": 1000 * (time.perf_counter() - t),
                        "message": message, "ok": 400 <= r.status_code < 500 and bool(message) and alive})
    return out


async def soak(url: str, models: list[str], seconds: float, clients: int, sentences: dict[str, list[str]]) -> dict:
    counts = {"sent": 0, "answered": 0, "lost": 0, "bad_sent": 0}
    lost_examples: list[str] = []
    end = time.monotonic() + seconds

    async def worker(k: int):
        r_ = random.Random(k)
        conn = Connection(url)
        while time.monotonic() < end:
            model = r_.choice(models)
            pool = sentences[model]
            roll = r_.random()
            if roll < 0.05:  # a bad request: 4xx expected
                counts["bad_sent"] += 1
                path, body, expect = "/translate", {"model": model, "texts": [], "beam_size": "x"}, 422
            elif roll < 0.15:
                path, expect = "/score", 200
                body = {"model": model, "sources": [r_.choice(pool)], "targets": [r_.choice(pool)]}
            else:
                path, expect = "/translate", 200
                beam = r_.randint(1, 5)
                body = {"model": model, "texts": r_.sample(pool, r_.randint(1, 3)), "beam_size": beam,
                        "n_best": r_.randint(1, beam), "alignments": r_.random() < 0.3}
            counts["sent"] += 1
            try:
                status, out = await conn.post(path, body)
                if status == expect and (status != 200 or out.get("results")):
                    counts["answered"] += 1
                else:
                    counts["lost"] += 1
                    lost_examples.append(f"{path} {status}: {str(out)[:200]}")
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                counts["lost"] += 1
                lost_examples.append(repr(e))
                conn.writer = None
        await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(clients)))
    wall = time.perf_counter() - start
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        health = (await client.get("/health")).json()
    return {**counts, "seconds": wall, "clients": clients, "rps": counts["sent"] / wall,
            "lost_examples": lost_examples[:10], "health_after": health}


def read_lines(path: Path, n: int) -> list[str]:
    """The first ``n`` non-empty lines of ``path`` (gzip or plain), stripped."""
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as fh:
        return [line.strip() for line, _ in zip(fh, range(n)) if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/serve-default/best", help="the embedded default task's checkpoint")
    ap.add_argument("--multi30k-model", default="runs/serve-multi30k/best", help="a Multi30k-shaped checkpoint, or none")
    ap.add_argument("--data", default=str(ROOT.parent / "shared/data/multi30k"), help="Multi30k files (*.gz)")
    ap.add_argument("--multi30k-train-seconds", type=float, default=240.0)
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--requests", type=int, default=128, help="requests per concurrency level (at least 4c)")
    ap.add_argument("--multi30k-requests", type=int, default=32,
                    help="the same for the Multi30k-shaped model, whose decoding is much slower")
    ap.add_argument("--soak-seconds", type=float, default=300.0)
    ap.add_argument("--soak-clients", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="the server's threads (torch's, or CTranslate2's intra_threads)")
    ap.add_argument("--engine", default="qkv", help="comma-separated engines to serve in turn: qkv, ctranslate2")
    ap.add_argument("--serve-flags", default="", help="more qkv serve flags, e.g. '--beam-size 1'")
    ap.add_argument("--batch-wait-ms", default="5")
    ap.add_argument("--max-batch-tokens", default="4096")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = ap.parse_args()

    served, sentences = {}, {}
    if args.model != "none":
        default = Path(args.model)
        ensure_default(default, args.threads)
        served["default"] = str(default)
        sentences["default"] = [e for e, _ in __import__("qkv.data.toy", fromlist=["x"]).default_splits()["test"]]
    if args.multi30k_model != "none":
        m30k = Path(args.multi30k_model)
        ensure_multi30k(m30k, Path(args.data), args.multi30k_train_seconds, 1)
        served["multi30k"] = str(m30k)
        sentences["multi30k"] = read_lines(Path(args.data) / "test_2016_flickr.en.gz", 1000)
    load_before = os.getloadavg()
    (ROOT / "runs").mkdir(exist_ok=True)
    results: dict = {"levels": {}, "machine": {}, "command": " ".join(sys.argv)}
    engines = args.engine.split(",")
    first: dict[str, list] = {}  # the first engine's answers at c = 1, per model
    for engine in engines:
        server = Server([f"{k}={v}" for k, v in served.items()], args.threads,
                        ["--batch-wait-ms", args.batch_wait_ms, "--max-batch-tokens", args.max_batch_tokens,
                         "--engine", engine, *args.serve_flags.split()],
                        ROOT / "runs" / f"serve-load-server-{engine}.log")
        log(f"qkv serve --engine {engine} at {server.url}: {', '.join(served)}")
        try:
            for name in served:
                rows = []
                for c in [int(x) for x in args.concurrency.split(",")]:
                    n = max(args.multi30k_requests if name == "multi30k" else args.requests, 4 * c)
                    row = asyncio.run(load_level(server.url, name, sentences[name], c, n))
                    rows.append(row)
                    log(f"{name} ({engine}): c={c}: {row['rps']:.1f} req/s, p50 {row['p50_ms']:.0f} ms, "
                        f"p99 {row['p99_ms']:.0f} ms, mean batch {row['mean_batch']:.1f}, errors {row['n_errors']}")
                base = {i: a for i, a in enumerate(first.setdefault(name, rows[0]["answers"]))}
                for row in rows:
                    row["same_as_one_at_a_time"] = sum(a == base.get(i) for i, a in enumerate(row["answers"][:len(base)]))
                    row["compared"] = min(len(base), len(row["answers"]))
                    row.pop("answers")
                results["levels"][f"{name} ({engine})"] = rows
            if engine != engines[0]:
                continue
            results["bad_requests"] = bad_requests(server.url, next(iter(served)))
            for b in results["bad_requests"]:
                log(f"bad request: {b['request']}: {b['status']} {b['message'][:90]} ({'ok' if b['ok'] else 'NOT OK'})")
            if args.soak_seconds > 0:
                rss_before = server.rss_mb()
                results["soak"] = asyncio.run(soak(server.url, list(served), args.soak_seconds, args.soak_clients,
                                                   sentences))
                results["soak"].update(rss_mb_before=rss_before, rss_mb_after=server.rss_mb())
                log(f"soak: {json.dumps({k: v for k, v in results['soak'].items() if k != 'health_after'})}")
        finally:
            server.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip())
    import torch

    results["machine"] = {"nproc": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                          "torch": torch.__version__, "server_threads": args.threads, "engines": engines,
                          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "commit": commit + ("+dirty" if dirty else "")}
    out = Path(args.out) / f"serve-load-{datetime.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")

    print(f"| model (engine) | clients | requests | req/s | p50 ms | p99 ms | mean batch (requests) | same as "
          f"{engines[0]} one at a time | errors |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, rows in results["levels"].items():
        for r in rows:
            print(f"| {name} | {r['concurrency']} | {r['requests']} | {r['rps']:.1f} | {r['p50_ms']:.0f} | "
                  f"{r['p99_ms']:.0f} | {r['mean_batch']:.1f} | {r['same_as_one_at_a_time']}/{r['compared']} | "
                  f"{r['n_errors']} |")
    print("\n| bad request | status | message | server alive, 4xx with a message |\n| --- | --- | --- | --- |")
    for b in results["bad_requests"]:
        print(f"| {b['request']} | {b['status']} | {b['message'][:80]} | {'yes' if b['ok'] else 'NO'} |")
    s = results.get("soak", {"lost": 0})
    if "sent" in s:
        print(f"\nsoak: {s['seconds']:.0f} s, {s['clients']} clients: {s['sent']} sent, {s['answered']} answered "
              f"({s['bad_sent']} of them bad requests answered 4xx), {s['lost']} lost; {s['rps']:.1f} req/s; "
              f"server memory {s['rss_mb_before']:.0f} -> {s['rss_mb_after']:.0f} MB")
    m = results["machine"]
    print(f"\nmachine: nproc {m['nproc']} ({m['cpu']}), load average {m['loadavg_before'][0]:.2f} before, "
          f"{m['loadavg_after'][0]:.2f} after; server threads {m['server_threads']}; torch {m['torch']}; "
          f"{m['date']}; commit {m['commit']}")
    print(f"wrote {out}")
    ok = s["lost"] == 0 and all(b["ok"] for b in results["bad_requests"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
