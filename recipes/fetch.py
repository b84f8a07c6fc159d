"""Download a recipe's public data set and check it by sha256: what every ``recipes/*/fetch.py`` uses.

A file is downloaded to ``NAME.part`` beside its place, its sha256 computed as it arrives, and renamed
to ``NAME`` only when the digest is the one pinned in the recipe's script; a wrong digest stops with an
error naming the file and both digests, and leaves nothing behind. A file already in place with the
right digest is not fetched again. ``--mirror URL`` fetches the same file names from another place (a
copy of the data on a local server, or ``file:///path/``); ``--out DIR`` chooses where they go, the
folder that the recipe's ``--data DIR`` then reads.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"  # where the project's machines keep their copies


@dataclass(frozen=True)
class Source:
    """One file of a data set: its name on disk, the public URL it comes from, and its sha256 (None: an
    archive whose unpacked content the recipe checks instead)."""

    name: str
    url: str
    sha256: str | None


class FetchError(Exception):
    """A download that failed or did not match its checksum: the message names the file."""


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def download(url: str, dest: Path, sha256: str | None, timeout: float = 60.0) -> Path:
    """``url`` to ``dest``, checked: written as ``dest.part`` and renamed only if its sha256 is ``sha256``
    (None: not checked here)."""
    if sha256 is not None and dest.is_file() and sha256_of(dest) == sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
            for block in iter(lambda: response.read(1 << 20), b""):
                digest.update(block)
                out.write(block)
    except OSError as e:  # URLError and HTTPError are OSErrors
        part.unlink(missing_ok=True)
        raise FetchError(f"{dest.name}: cannot download {url}: {getattr(e, 'reason', e)}") from None
    if sha256 is not None and digest.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise FetchError(f"{dest.name}: sha256 {digest.hexdigest()} of {url} is not the pinned {sha256}; "
                         "nothing was written")
    os.replace(part, dest)
    return dest


def fetch(sources: list[Source], out: Path, mirror: str | None = None, log=print) -> list[Path]:
    """Every source into ``out`` (from ``mirror`` + its name, where given), each checked by sha256."""
    written = []
    for s in sources:
        url = mirror.rstrip("/") + "/" + s.name if mirror else s.url
        log(f"{s.name}: {url}")
        written.append(download(url, out / s.name, s.sha256))
    return written


def main(description: str, sources: list[Source], default_out: Path, after=None, argv: list[str] | None = None) -> int:
    """The command line of a recipe's fetch.py: ``--out DIR`` (default: ``default_out``), ``--mirror URL``.
    ``after(out)`` runs once every file is in place and checked (e.g. to unpack an archive)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=default_out, help=f"where the files go (default: {default_out})")
    ap.add_argument("--mirror", help="fetch the same file names from this URL instead (e.g. file:///data/copy/)")
    args = ap.parse_args(argv)
    try:
        fetch(sources, args.out, args.mirror)
        if after is not None:
            after(args.out)
    except FetchError as e:
        print(f"fetch: error: {e}", file=sys.stderr)
        return 1
    print(f"done: {args.out}")
    return 0
