#!/usr/bin/env bash
# The En->De distilled single-model row of docs/results.md in one command (about 12 hours on two CPU threads
# from nothing; each finished stage is kept and skipped when the script is run again):
#   recipes/multi30k/distill.sh
# 1. the teachers: recipes/multi30k/ensemble.sh (four seeds, their ensemble's length penalty chosen on val),
#    unless its result, runs/m30k-ende-ensemble4.json, is there already;
# 2. the distilled data: recipes/multi30k/distill.py has that ensemble translate the 29,000 training sources
#    (beam 5, the ensemble's alpha) into runs/m30k-ende-distilled-data, unless its train.de.gz is there;
# 3. the student: one model of the published size (tuning/en-de-fairseq-tiny-bpe10k-distill4.toml, the
#    teachers' vocabulary) trained on that data for 4,880 updates; it chooses its checkpoint and alpha on the
#    real val set and decodes test_2016_flickr once (recipes/multi30k/run.py); the scores are copied to
#    benchmarks/results/multi30k-en-de-fairseq-tiny-bpe10k-distill4-DATE.json.
# DATA=DIR reads Multi30k from DIR (default ../shared/data/multi30k); THREADS=N (default 2); VAL_ONLY=1 stops the
# student after its choice on val (OUT/val_choice.json), test not decoded.
set -euo pipefail
cd "$(dirname "$0")/../.."
data=${DATA:-../shared/data/multi30k}
threads=${THREADS:-2}
ensemble=runs/m30k-ende-ensemble4.json
distilled=runs/m30k-ende-distilled-data
student=runs/m30k-ende-fairseq-tiny-bpe10k-distill4
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
python recipes/multi30k/run.py en-de --config recipes/multi30k/tuning/en-de-fairseq-tiny-bpe10k-distill4.toml \
  --data "$distilled" --tokenizer-from "${members[0]}" --lowercase-tokenized --out "$student" \
  --threads "$threads" --max-steps 4880 --max-time 0 ${VAL_ONLY:+--val-only}
[ -n "${VAL_ONLY:-}" ] || cp "$student/scores.json" "benchmarks/results/multi30k-en-de-fairseq-tiny-bpe10k-distill4-$(date +%F).json"
