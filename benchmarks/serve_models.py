"""One model or two behind one ``qkv serve --engine ctranslate2``: does a second model slow the first?

    python benchmarks/serve_models.py --model runs/m30k/best [--threads 1,2] [--concurrency 8] [--requests 256]

For each thread count: ``qkv serve a=MODEL`` (one model), then ``qkv serve a=MODEL b=MODEL`` (the
same checkpoint twice: two translators), as a user starts it (its own process on 127.0.0.1,
``--engine ctranslate2 --beam-size 1 --threads T``). Measured with ``serve_load.py``'s client
(``--concurrency`` keep-alive clients, ``--requests`` one-sentence translation requests of
test_2016_flickr, as fast as answers come back):

- ``one``: requests/s of model a, served alone;
- ``a, b loaded``: of model a while b is loaded and has answered (b idle), then of b while a idles;
- ``a and b at once``: both loaded at the same time, each with its own clients: per model and total.

The target (a model's throughput in a two-model server within 10% of one model's) is checked on
``a, b loaded``: at once, two models share the same cores, so each gets about half. Each level is
run ``--rounds`` times, the servers alternating, and the median kept. Prints a Markdown table and
writes JSON to benchmarks/results/serve-models-DATE.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers.common import cpu_name, git_commit  # noqa: E402
from serve_load import Server, load_level, read_lines  # noqa: E402

TEST_SET = Path("/work/shared/data/multi30k/test_2016_flickr.de.gz")


def measure(server: Server, models: list[str], sentences: list[str], concurrency: int, n: int) -> dict[str, float]:
    async def run():
        return await asyncio.gather(*(load_level(server.url, m, sentences, concurrency, n) for m in models))
    results = asyncio.run(run())
    for r in results:
        if r["n_errors"]:
            raise SystemExit(f"errors: {r['errors']}")
    return {m: r["rps"] for m, r in zip(models, results)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a translation Transformer checkpoint")
    p.add_argument("--src", default=str(TEST_SET), help="source sentences (plain or gzip), in the model's source language")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--concurrency", type=int, default=8, help="clients per model")
    p.add_argument("--requests", type=int, default=256, help="requests per model and level")
    p.add_argument("--rounds", type=int, default=3, help="rounds (the median is reported)")
    p.add_argument("--json", help="where to write the results (default benchmarks/results/serve-models-DATE.json)")
    args = p.parse_args(argv)
    sentences = read_lines(Path(args.src), 500)
    flags = ["--engine", "ctranslate2", "--beam-size", "1"]
    logs = HERE.parent / "runs"
    logs.mkdir(exist_ok=True)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        one = Server([f"a={args.model}"], threads, flags, logs / "serve-models-one.log")
        two = Server([f"a={args.model}", f"b={args.model}"], threads, flags, logs / "serve-models-two.log")
        got: dict[str, list[float]] = {k: [] for k in ("one", "a_loaded", "b_loaded", "a_at_once", "b_at_once")}
        try:
            for server, models in ((one, ["a"]), (two, ["a"]), (two, ["b"])):  # warm every translator
                measure(server, models, sentences, args.concurrency, 32)
            for r in range(args.rounds):
                got["one"].append(measure(one, ["a"], sentences, args.concurrency, args.requests)["a"])
                got["a_loaded"].append(measure(two, ["a"], sentences, args.concurrency, args.requests)["a"])
                got["b_loaded"].append(measure(two, ["b"], sentences, args.concurrency, args.requests)["b"])
                both = measure(two, ["a", "b"], sentences, args.concurrency, args.requests)
                got["a_at_once"].append(both["a"])
                got["b_at_once"].append(both["b"])
                print(f"threads {threads} round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items()),
                      file=sys.stderr, flush=True)
        finally:
            one.stop()
            two.stop()
        med = {k: statistics.median(v) for k, v in got.items()}
        rows.append({"threads": threads, "rps": med, "rps_per_round": got,
                     "a_loaded_vs_one": med["a_loaded"] / med["one"], "b_loaded_vs_one": med["b_loaded"] / med["one"],
                     "at_once_total_vs_one": (med["a_at_once"] + med["b_at_once"]) / med["one"]})
    import ctranslate2

    result = {"model": args.model, "concurrency": args.concurrency, "requests": args.requests, "rounds": args.rounds,
              "rows": rows, "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                                        "ctranslate2": ctranslate2.__version__, "load_average": os.getloadavg()},
              "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())}
    print(f"{result['machine']['cpu']}, load average {result['machine']['load_average'][0]:.1f}, commit "
          f"{result['commit']}; requests/s, median of {args.rounds} rounds, {args.concurrency} clients per model\n")
    print("| threads | one model | a (b loaded) | b (a loaded) | a and b at once | within 10% of one model |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        m = r["rps"]
        ok = min(r["a_loaded_vs_one"], r["b_loaded_vs_one"]) >= 0.9
        print(f"| {r['threads']} | {m['one']:.1f} | {m['a_loaded']:.1f} ({r['a_loaded_vs_one']:.2f}×) | "
              f"{m['b_loaded']:.1f} ({r['b_loaded_vs_one']:.2f}×) | {m['a_at_once']:.1f} + {m['b_at_once']:.1f} = "
              f"{m['a_at_once'] + m['b_at_once']:.1f} ({r['at_once_total_vs_one']:.2f}×) | {'yes' if ok else 'no'} |")
    path = Path(args.json) if args.json else HERE / "results" / f"serve-models-{result['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"written: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
