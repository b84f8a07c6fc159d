#!/usr/bin/env bash
# fairseq-preprocess beside qkv preprocess: SentencePiece encoding into pieces (fairseq-preprocess
# reads text already split into tokens), then fairseq-preprocess --workers 2, each timed with
# /usr/bin/time -v and the summed RSS/PSS of its process tree (rss_tree.py).
#
#   benchmarks/peers/fairseq/setup.sh /tmp/fs/venv          # fairseq 0.12.2 in its own venv, once
#   SRC=/tmp/qkv-scale/3M SPM=/tmp/qkv-scale/3M/bin/spm.model WORK=/tmp/fs \
#       benchmarks/peers/fairseq/measure.sh                 # the whole of SRC/train.{en,de}
#   ... measure.sh 300000                                   # its first 300,000 lines
#
# SRC holds train.en, train.de, valid.en, valid.de (benchmarks/scale.py generate); SPM is the
# SentencePiece model qkv preprocess trained on it. Results: WORK/results/TAG/summary.json.
set -euo pipefail

N="${1:-}"
HERE="$(cd "$(dirname "$0")" && pwd)"
SRC="${SRC:?SRC: the directory of train.en/train.de/valid.en/valid.de}"
SPM="${SPM:-$SRC/bin/spm.model}"
WORKERS="${WORKERS:-2}"
WORK="${WORK:-/tmp/fs}"
VENV="${VENV:-$WORK/venv}"
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1   # keep torch import from spawning extra threads

if [[ -n "$N" ]]; then
  TAG="$N"; DATA=$WORK/data-$N; DEST=$WORK/data-bin-$N; RAW=$WORK/raw-$N
else
  TAG=full; DATA=$WORK/data; DEST=$WORK/data-bin; RAW=$SRC
fi
RES=$WORK/results/$TAG
rm -rf "$RES" "$DATA" "$DEST"
mkdir -p "$RES" "$DATA"

if [[ -n "$N" ]]; then           # prefix subset of the raw text (not timed)
  mkdir -p "$RAW"
  head -n "$N" "$SRC/train.en" > "$RAW/train.en"
  head -n "$N" "$SRC/train.de" > "$RAW/train.de"
  cp "$SRC/valid.en" "$SRC/valid.de" "$RAW/"
fi
PAIRS=$(wc -l < "$RAW/train.en")

# timed NAME CMD... : wall clock (date), /usr/bin/time -v, summed RSS/PSS of the process tree,
# /proc/loadavg before and after.
timed() {
  local name=$1; shift
  cat /proc/loadavg > "$RES/$name.load_start"
  local t0 t1
  t0=$(date +%s.%N)
  /usr/bin/time -v -o "$RES/$name.time" "$PY" "$HERE/rss_tree.py" "$@" \
      > "$RES/$name.stdout" 2> "$RES/$name.stderr"
  t1=$(date +%s.%N)
  cat /proc/loadavg > "$RES/$name.load_end"
  echo "$t1 - $t0" | bc -l > "$RES/$name.wall"
  printf '%-22s wall %8.2f s  maxrss(time -v) %7d KB  load %s -> %s\n' "$name" \
    "$(cat "$RES/$name.wall")" \
    "$(awk -F': ' '/Maximum resident/{print $2}' "$RES/$name.time")" \
    "$(cut -d' ' -f1-3 "$RES/$name.load_start")" "$(cut -d' ' -f1-3 "$RES/$name.load_end")"
}

# Wait (up to IDLE_WAIT_S, default 1200 s) for the machine to go quiet: 1-min load < 0.5.
IDLE_WAIT_S="${IDLE_WAIT_S:-1200}"; waited=0
while awk '{exit !($1 >= 0.5)}' /proc/loadavg && (( waited < IDLE_WAIT_S )); do
  sleep 10; waited=$((waited + 10))
done
echo "waited ${waited}s for idle; loadavg now: $(cat /proc/loadavg)" | tee "$RES/idle_wait"

# Background monitor: every 15 s log loadavg and the top CPU users (to spot contention).
( while true; do
    echo "== $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    ps -eo pid,pcpu,rss,etime,comm,args --sort=-pcpu | sed -n 2,6p | cut -c1-200
    sleep 15
  done ) > "$RES/monitor.log" 2>&1 &
MON=$!
trap 'kill $MON 2>/dev/null || true' EXIT

sync
# (a) SentencePiece -> space-separated pieces, $WORKERS processes per file
for side in en de; do
  timed "encode_train_$side" "$PY" "$HERE/spm_encode_par.py" --model "$SPM" \
      --input "$RAW/train.$side" --output "$DATA/train.$side" --workers "$WORKERS"
done
for side in en de; do
  timed "encode_valid_$side" "$PY" "$HERE/spm_encode_par.py" --model "$SPM" \
      --input "$RAW/valid.$side" --output "$DATA/valid.$side" --workers "$WORKERS"
done
for f in train.en train.de valid.en valid.de; do   # sanity: line counts preserved
  [[ $(wc -l < "$RAW/$f") == $(wc -l < "$DATA/$f") ]] || { echo "line count mismatch $f"; exit 1; }
done

# (b) fairseq-preprocess
sync
timed fairseq_preprocess fairseq-preprocess --source-lang en --target-lang de \
    --trainpref "$DATA/train" --validpref "$DATA/valid" --destdir "$DEST" \
    --joined-dictionary --workers "$WORKERS" --dataset-impl mmap

du -sb "$DEST" > "$RES/destdir.du_bytes"
ls -l "$DEST" > "$RES/destdir.ls"

# summary
"$PY" - "$RES" "$PAIRS" "$DEST" <<'EOF'
import json, os, re, sys
res, pairs, dest = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def rd(p): return open(os.path.join(res, p)).read()
out = {"pairs": pairs, "steps": {}}
for name in sorted({f.split(".")[0] for f in os.listdir(res) if f.endswith(".wall")}):
    t = rd(name + ".time"); e = rd(name + ".stderr")
    g = lambda pat, s: (lambda m: m and m.group(1))(re.search(pat, s))
    out["steps"][name] = {
        "wall_s": round(float(rd(name + ".wall")), 2),
        "user_s": float(g(r"User time \(seconds\): ([\d.]+)", t)),
        "sys_s": float(g(r"System time \(seconds\): ([\d.]+)", t)),
        "cpu_pct": g(r"Percent of CPU this job got: (\S+)", t),
        "maxrss_kb_time_v": int(g(r"Maximum resident set size \(kbytes\): (\d+)", t)),
        "tree_peak_rss_kb_sum": int(g(r"TREE_PEAK_RSS_KB (\d+)", e)),
        "tree_peak_pss_kb_sum": int(g(r"TREE_PEAK_PSS_KB (\d+)", e)),
        "tree_max_procs": int(g(r"TREE_MAX_PROCS (\d+)", e)),
        "load_start": rd(name + ".load_start").split()[:3],
        "load_end": rd(name + ".load_end").split()[:3],
        "exit": g(r"Exit status: (\d+)", t),
    }
s = out["steps"]
enc = sum(v["wall_s"] for k, v in s.items() if k.startswith("encode_"))
enc_train = s["encode_train_en"]["wall_s"] + s["encode_train_de"]["wall_s"]
fp = s["fairseq_preprocess"]["wall_s"]
out["encode_train_s"] = round(enc_train, 2)
out["encode_all_s"] = round(enc, 2)
out["fairseq_preprocess_s"] = fp
out["total_s"] = round(enc + fp, 2)
out["pairs_per_s"] = {"encode_all": round(pairs / enc, 1),
                      "fairseq_preprocess": round(pairs / fp, 1),
                      "total": round(pairs / (enc + fp), 1)}
out["destdir_bytes"] = int(rd("destdir.du_bytes").split()[0])
json.dump(out, open(os.path.join(res, "summary.json"), "w"), indent=1)
print(json.dumps(out, indent=1))
EOF
