#!/bin/sh
# The Time Machine, character-level language models (docs/results.md): the vanilla RNN,
# the GRU, the LSTM and the decoder-only Transformer at about the same parameter count, each
# trained for 7 minutes on one CPU thread, validated on the held-out last 10% of the book; then
# a seeded sample continuation of "the time traveller" from each, and the held-out perplexity.
#
#   sh recipes/timemachine/run.sh [TEXT] [OUT]
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TEXT=${1:-$ROOT/data/timemachine/timemachine.txt}  # where fetch.py writes; else the shared copy, where present
if [ -z "${1:-}" ] && [ ! -e "$TEXT" ] && [ -f "$ROOT/../shared/data/timemachine/timemachine.txt" ]; then
  TEXT=$ROOT/../shared/data/timemachine/timemachine.txt
fi
OUT=${2:-runs/timemachine}
HERE=$(dirname "$0")
for m in rnn gru lstm transformer; do
  if [ ! -d "$OUT/$m/last" ]; then
    python -m qkv train --config "$HERE/$m.toml" --train "$TEXT" --strip-gutenberg --valid-fraction 0.1 \
      --out "$OUT/$m" 2> "$OUT.$m.log" || { tail "$OUT.$m.log"; exit 1; }
  fi
done
for m in rnn gru lstm transformer; do
  echo "== $m"
  python -m qkv evaluate "$OUT/$m/best" --test "$TEXT" --strip-gutenberg --last-fraction 0.1
  python -m qkv generate "$OUT/$m/best" --prefix "the time traveller" --max-new-tokens 200 \
    --temperature 0.8 --top-k 0 --top-p 0.95 --seed 1
  echo
done
