"""Fetch the WMT 2014 English-German training data and write wmt14/train.en, wmt14/train.de.

    python recipes/wmt14/fetch.py [--out DIR] [--mirror URL]

Source: the WMT 2014 news translation task's parallel training archives at statmt.org (Europarl v7,
Common Crawl, News Commentary v9: about 1.7 GB together), their German-English files concatenated
line-aligned into DIR/train.en and DIR/train.de (default DIR: wmt14), 4,520,620 lines each; the line
counts are checked, each archive's sha256 is printed (none is pinned: the project's machines hold
no copy of these archives to pin them against); on any failure the archives are removed, as nothing
but the line counts checks them. The validation and test sets (newstest2013, the full newstest2014)
come through sacreBLEU: see recipes/wmt14/README.md, step 0. The limits on a slow server
(--deadline, --min-rate, --timeout) are recipes/fetch.py's.
"""

from __future__ import annotations

import sys
import tarfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fetch  # noqa: E402 (recipes/fetch.py)

ARCHIVES = {  # archive -> its German-English file stem, and the lines of each side
    "training-parallel-europarl-v7.tgz": ("https://www.statmt.org/wmt13/", "europarl-v7.de-en", 1_920_209),
    "training-parallel-commoncrawl.tgz": ("https://www.statmt.org/wmt13/", "commoncrawl.de-en", 2_399_123),
    "training-parallel-nc-v9.tgz": ("https://www.statmt.org/wmt14/", "news-commentary-v9.de-en", 201_288),
}
SOURCES = [fetch.Source(name, base + name, None) for name, (base, _, _) in ARCHIVES.items()]


def concatenate(out: Path) -> None:
    """The de-en files of every archive in DIR, concatenated into DIR/train.en and DIR/train.de (each
    written beside its place and renamed when complete; a damaged archive is an error naming it)."""
    parts = [out / f"train.{lang}.part" for lang in ("en", "de")]
    try:
        for lang, part in zip(("en", "de"), parts):
            with open(part, "wb") as dest:
                for name, (_, stem, lines) in ARCHIVES.items():
                    print(f"{name}: sha256 {fetch.sha256_of(out / name)} (not pinned)")
                    try:
                        with fetch.open_tar(out / name) as tar:
                            member = next((m for m in tar if m.name.endswith(f"{stem}.{lang}")), None)
                            if member is None:
                                raise fetch.FetchError(f"{name}: no {stem}.{lang} in the archive")
                            data = tar.extractfile(member).read()
                    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
                        raise fetch.damaged(out / name, e) from None
                    n = data.count(b"\n")
                    if n != lines:
                        raise fetch.FetchError(f"{name}: {stem}.{lang} has {n:,} lines, not {lines:,}")
                    dest.write(data)
        for lang, part in zip(("en", "de"), parts):
            part.replace(out / f"train.{lang}")
    finally:
        for part in parts:
            part.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(fetch.main(__doc__, SOURCES, Path("wmt14"), after=concatenate))
