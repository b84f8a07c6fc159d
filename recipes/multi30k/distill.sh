#!/usr/bin/env bash
# The En->De distillation results (docs/results.md, docs/tuning-journal.md) in one command each (from nothing, on two CPU threads:
# about 10 hours, or 12 with scratch; each finished stage is kept and skipped when the script is run again):
#   recipes/multi30k/distill.sh            seed 1's model fine-tuned on the distilled data; test decoded (41.49)
#   recipes/multi30k/distill.sh scratch    a model trained from scratch on the distilled data; val only (42.40)
# 1. the teachers: recipes/multi30k/ensemble.sh (four seeds, their ensemble's length penalty chosen on val),
#    unless its result, runs/m30k-ende-ensemble4.json, is there already;
# 2. the distilled data: recipes/multi30k/distill.py has that ensemble translate the 29,000 training sources
#    (beam 5, the ensemble's alpha) into runs/m30k-ende-distilled-data, unless its train.de.gz is there;
# 3. the model, trained on that data with the real val and test sets (recipes/multi30k/run.py: it chooses the
#    checkpoint and alpha on val):
#    - default: seed 1's chosen model (the ensemble's first member) fine-tuned for 1,500 updates
#      (tuning/en-de-fairseq-tiny-bpe10k-distill4-ft.toml); it decodes test_2016_flickr once and its scores
#      are copied to benchmarks/results/multi30k-en-de-fairseq-tiny-bpe10k-distill4-ft-DATE.json;
#    - scratch: a fresh model of the same size with the teachers' vocabulary, 4,880 updates
#      (tuning/en-de-fairseq-tiny-bpe10k-distill4.toml), stopped after its choice on val (val_choice.json).
# DATA=DIR reads Multi30k from DIR (default: data/multi30k in the clone, where recipes/multi30k/fetch.py writes, or
# ../shared/data/multi30k beside it where only that is present); THREADS=N (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-finetune}
case "$mode" in
  finetune|scratch) ;;
  *) echo "distill.sh: expected no argument (fine-tune) or 'scratch', got '$mode'" >&2; exit 2 ;;
esac
root=$(pwd)  # the clone (cd above)
data=${DATA:-$root/data/multi30k}
if [ -z "${DATA:-}" ] && [ ! -e "$data" ] && [ -d "$root/../shared/data/multi30k" ]; then data=$root/../shared/data/multi30k; fi
threads=${THREADS:-2}
ensemble=runs/m30k-ende-ensemble4.json
distilled=runs/m30k-ende-distilled-data
if [ ! -f "$ensemble" ]; then
  DATA="$data" THREADS="$threads" OUT="$ensemble" recipes/multi30k/ensemble.sh
fi
field() { python -c 'import json, sys; d = json.load(open(sys.argv[1])); v = d[sys.argv[2]]; print(*v) if isinstance(v, list) else print(v)' "$@"; }
read -r -a members <<< "$(field "$ensemble" members)"
alpha=$(field "$ensemble" length_penalty)
if [ ! -f "$distilled/train.de.gz" ]; then
  python recipes/multi30k/distill.py "${members[@]}" --pair en-de --data "$data" --length-penalty "$alpha" \
    --out "$distilled" --threads "$threads"
fi
if [ "$mode" = scratch ]; then
  python recipes/multi30k/run.py en-de --config recipes/multi30k/tuning/en-de-fairseq-tiny-bpe10k-distill4.toml \
    --data "$distilled" --tokenizer-from "${members[0]}" --lowercase-tokenized \
    --out runs/m30k-ende-fairseq-tiny-bpe10k-distill4 --threads "$threads" --max-steps 4880 --max-time 0 --val-only
  exit 0
fi
config=recipes/multi30k/tuning/en-de-fairseq-tiny-bpe10k-distill4-ft.toml
start=$(python -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["train"]["init_from"])' "$config")
if [ "$start" != "${members[0]}" ]; then
  echo "distill.sh: $config starts from $start, but seed 1 chose ${members[0]} on val; set init_from to it" >&2
  exit 2
fi
student=runs/m30k-ende-fairseq-tiny-bpe10k-distill4-ft
python recipes/multi30k/run.py en-de --config "$config" --data "$distilled" --lowercase-tokenized --out "$student" \
  --threads "$threads" --max-time 0
cp "$student/scores.json" "benchmarks/results/multi30k-en-de-fairseq-tiny-bpe10k-distill4-ft-$(date +%F).json"
