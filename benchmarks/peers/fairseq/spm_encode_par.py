#!/usr/bin/env python
"""Encode a text file to space-separated SentencePiece pieces with N processes.

The input is split into N contiguous byte ranges at newline boundaries; each
worker encodes its range (single-threaded) into OUT.partK; parts are then
concatenated in order into OUT. Line count is preserved exactly."""
import argparse, os, sys, time
from multiprocessing import Process

def worker(model, inp, start, end, out):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=model)
    with open(inp, "rb") as f, open(out, "w", encoding="utf-8") as fo:
        f.seek(start)
        data = f.read(end - start)
        lines = data.decode("utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        B = 10000
        for i in range(0, len(lines), B):
            enc = sp.encode(lines[i:i + B], out_type=str)
            fo.write("".join(" ".join(p) + "\n" for p in enc))

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    size = os.path.getsize(a.input)
    bounds = [0]
    with open(a.input, "rb") as f:
        for k in range(1, a.workers):
            f.seek(max(size * k // a.workers, bounds[-1]))
            f.readline()
            bounds.append(min(f.tell(), size))
    bounds.append(size)
    parts = [f"{a.output}.part{k}" for k in range(a.workers)]
    ps = [Process(target=worker, args=(a.model, a.input, bounds[k], bounds[k + 1], parts[k]))
          for k in range(a.workers)]
    for p in ps: p.start()
    for p in ps:
        p.join()
        if p.exitcode != 0:
            sys.exit(f"worker failed: {p.exitcode}")
    with open(a.output, "wb") as fo:
        for pt in parts:
            with open(pt, "rb") as fi:
                while True:
                    buf = fi.read(1 << 24)
                    if not buf: break
                    fo.write(buf)
            os.remove(pt)

if __name__ == "__main__":
    main()
