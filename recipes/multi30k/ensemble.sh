#!/usr/bin/env bash
# The En->De ensemble row of docs/results.md in one command (about 9 hours on two CPU threads from nothing):
#   recipes/multi30k/ensemble.sh
# 1. trains the four seeds of recipes/multi30k/tuning/en-de-fairseq-tiny-bpe10k*.toml for 4,880 updates each,
#    each choosing its own model on val (--val-only; a run with its val_choice.json is kept as it is, an
#    interrupted one resumes from its newest checkpoint);
# 2. decodes val with the four chosen models as one ensemble for each length penalty, keeps the best, and
#    decodes test_2016_flickr once (benchmarks/multi30k_ensemble.py).
# DATA=DIR reads Multi30k from DIR (default: data/multi30k in the clone, where recipes/multi30k/fetch.py writes, or
# ../shared/data/multi30k beside it where only that is present); THREADS=N (default 2); OUT=FILE writes the
# result there (default benchmarks/results/multi30k-en-de-fairseq-tiny-bpe10k-ensemble4-DATE.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)  # the clone (cd above)
data=${DATA:-$root/data/multi30k}
if [ -z "${DATA:-}" ] && [ ! -e "$data" ] && [ -d "$root/../shared/data/multi30k" ]; then data=$root/../shared/data/multi30k; fi
threads=${THREADS:-2}
result=${OUT:-benchmarks/results/multi30k-en-de-fairseq-tiny-bpe10k-ensemble4-$(date +%F).json}
members=()
for seed in 1 2 3 4; do
  suffix=$([ "$seed" = 1 ] && echo "" || echo "-seed$seed")
  out="runs/m30k-ende-fairseq-tiny-bpe10k$suffix"
  if [ ! -f "$out/val_choice.json" ]; then
    python recipes/multi30k/run.py en-de --config "recipes/multi30k/tuning/en-de-fairseq-tiny-bpe10k$suffix.toml" \
      --data "$data" --lowercase-tokenized --out "$out" --threads "$threads" --max-steps 4880 --max-time 0 --val-only
  fi
  members+=("$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["path"])' "$out/val_choice.json")")
done
python benchmarks/multi30k_ensemble.py "${members[@]}" --data "$data" --threads "$threads" \
  --length-penalties 0.6,1.0,1.5,2.0,2.5,3.0 --test \
  --out "$result"
