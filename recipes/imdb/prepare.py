"""Split the IMDb training reviews into train (22,500) and validation (2,500), seeded.

    python recipes/imdb/prepare.py [--data data/imdb] [--out runs/imdb/data]

The shared train file is ordered by label, so the validation reviews are a seeded random
sample (seed 1), not the last lines. The test file is used as it is, once, at the end.
Writes OUT/train.jsonl.gz, OUT/valid.jsonl.gz and OUT/train.txt (the training texts alone,
one a line, for the masked-LM pretraining).
"""

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fetch import data_dir  # noqa: E402 (recipes/fetch.py)

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", default=str(data_dir("imdb")),
               help="folder with train.jsonl.gz (default: data/imdb in the clone, where fetch.py writes, or "
                    "../shared/data/imdb beside it where only that is present: %(default)s)")
p.add_argument("--out", default="runs/imdb/data")
p.add_argument("--valid-size", type=int, default=2500)
p.add_argument("--seed", type=int, default=1)
args = p.parse_args()

lines = gzip.open(Path(args.data) / "train.jsonl.gz", "rt", encoding="utf-8").read().split("\n")
lines = [line for line in lines if line.strip()]
order = list(range(len(lines)))
random.Random(args.seed).shuffle(order)
valid_ix = set(order[-args.valid_size:])
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
with gzip.open(out / "train.jsonl.gz", "wt", encoding="utf-8") as tr, \
        gzip.open(out / "valid.jsonl.gz", "wt", encoding="utf-8") as va, \
        open(out / "train.txt", "w", encoding="utf-8") as txt:
    for i, line in enumerate(lines):
        (va if i in valid_ix else tr).write(line + "\n")
        if i not in valid_ix:
            txt.write(" ".join(json.loads(line)["text"].replace("<br />", " ").split()) + "\n")
print(f"{len(lines) - len(valid_ix)} train, {len(valid_ix)} valid reviews in {out}")
