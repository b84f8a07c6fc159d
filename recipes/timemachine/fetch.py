"""Fetch The Time Machine (H. G. Wells) from Project Gutenberg and check it by sha256.

    python recipes/timemachine/fetch.py [--out DIR] [--mirror URL]

Source: Project Gutenberg eBook #35, its UTF-8 plain text (with Gutenberg's header and licence, which
`--strip-gutenberg` drops in training), saved as DIR/timemachine.txt (default DIR: data/timemachine
in the clone, where `recipes/timemachine/run.sh` looks first, then ../shared/data/timemachine beside
it where that is present; give it another file as its first argument). Project Gutenberg revises its
files now and then: a revised file fails the check, by name, and is not kept. The limits on a slow
server (--deadline, --min-rate, --timeout) are recipes/fetch.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fetch  # noqa: E402 (recipes/fetch.py)

URL = "https://www.gutenberg.org/files/35/35-0.txt"
SOURCES = [fetch.Source("timemachine.txt", URL, "f420d93bbee1c250eea28cccc3289955277182b7158d6b66d13a2f7d382f8670")]

if __name__ == "__main__":
    sys.exit(fetch.main(__doc__, SOURCES, fetch.DATA / "timemachine"))
