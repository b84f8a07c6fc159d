#!/usr/bin/env bash
# One IMDb row: train (time-capped, one CPU thread), then score the test set once.
#   recipes/imdb/run.sh bilstm | transformer | mlm-classify     (mlm-classify runs mlm first if needed)
# Data: python recipes/imdb/prepare.py (seeded 22,500 / 2,500 split of the training reviews).
set -euo pipefail
row=${1:?usage: recipes/imdb/run.sh bilstm|transformer|mlm-classify}
data=${DATA:-$(cd "$(dirname "$0")/../.." && pwd)/../shared/data/imdb}
export OMP_NUM_THREADS=1
[ -f runs/imdb/data/train.jsonl.gz ] || python recipes/imdb/prepare.py --data "$data"
if [ "$row" = mlm-classify ] && [ ! -d runs/imdb/mlm/best ]; then
  qkv train --config recipes/imdb/mlm.toml --train runs/imdb/data/train.txt \
            --valid runs/imdb/data/valid.jsonl.gz --out runs/imdb/mlm
fi
qkv train --config "recipes/imdb/$row.toml" --train runs/imdb/data/train.jsonl.gz \
          --valid runs/imdb/data/valid.jsonl.gz --out "runs/imdb/$row"
qkv evaluate "runs/imdb/$row/best" --test "$data/test.jsonl.gz"
