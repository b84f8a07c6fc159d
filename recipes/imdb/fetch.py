"""Fetch the Large Movie Review Dataset (IMDb, v1.0) and write it as JSON lines, checked by sha256.

    python recipes/imdb/fetch.py [--out DIR] [--mirror URL]

Source: aclImdb_v1.tar.gz from the Stanford AI Lab (Maas et al., 2011, "Learning Word Vectors for
Sentiment Analysis"): 25,000 training and 25,000 test reviews, balanced. The archive's own sha256 is
not pinned here; what it unpacks to is: DIR/README (the data set's own) and DIR/train.jsonl.gz,
DIR/test.jsonl.gz, a review a line, {"id", "rating", "label": "neg"/"pos", "text"}, the negative
reviews first, each label by id (the unlabelled reviews are left out). Their text (uncompressed) must
have the pinned sha256, or nothing is kept (nor the archive: a truncated or damaged one, or a file
that is not a tar archive, is an error naming it, and removed). Default DIR: data/imdb in the clone,
where the recipe looks first (then ../shared/data/imdb beside it, where that is present);
`DATA=DIR recipes/imdb/run.sh ...` reads another. The limits on a slow server (--deadline,
--min-rate, --timeout) are recipes/fetch.py's.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import sys
import tarfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fetch  # noqa: E402 (recipes/fetch.py)

ARCHIVE = "aclImdb_v1.tar.gz"
URL = "https://ai.stanford.edu/~amaas/data/sentiment/" + ARCHIVE
README_SHA256 = "8997da3508dfb0d2274dce886966cf353f32e62c504b9504102e8a8bcf3eb034"
JSONL_SHA256 = {"train": "5941bbdb96caf6137ac476c522b32f125fc4b4449ab4e081eab6bc1803ad0038", "test": "e1c14b73ed3d1a13bfa178ca52d16c8bd0e5c967b878ae9f7a20de5f7e2eb913"}  # of the uncompressed text


def read_archive(archive: Path) -> dict[str, bytes]:
    """README and the labelled reviews of each split in ``archive``, one pass: {"README": bytes, "train":
    JSON lines, "test": JSON lines}, each split's reviews neg then pos, each by id."""
    readme, records = b"", {split: [] for split in JSONL_SHA256}
    try:
        with fetch.open_tar(archive) as tar:
            for member in tar:
                m = re.fullmatch(r"aclImdb/(train|test)/(neg|pos)/(\d+)_(\d+)\.txt", member.name)
                if m:
                    text = tar.extractfile(member).read().decode("utf-8")
                    records[m.group(1)].append((m.group(2), int(m.group(3)), int(m.group(4)), text))
                elif member.name == "aclImdb/README":
                    readme = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:  # cut short, or damaged inside
        raise fetch.damaged(archive, e) from None
    except UnicodeDecodeError as e:
        raise fetch.FetchError(f"{archive.name}: a review is not UTF-8 ({e.reason}); removed, nothing was written") from None
    texts = {"README": readme}
    for split, rows in records.items():
        rows.sort(key=lambda r: (r[0] != "neg", r[1]))
        texts[split] = "".join(json.dumps({"id": i, "rating": rating, "label": label, "text": text},
                                          ensure_ascii=False) + "\n" for label, i, rating, text in rows).encode("utf-8")
    return texts


def unpack(out: Path) -> None:
    """DIR/ARCHIVE -> README, train.jsonl.gz, test.jsonl.gz, each checked; the archive is removed after."""
    archive = out / ARCHIVE
    texts = read_archive(archive)
    readme = texts["README"]
    pinned = {"README": README_SHA256, **JSONL_SHA256}
    for name, data in texts.items():
        digest = hashlib.sha256(data).hexdigest()
        if digest != pinned[name]:
            raise fetch.FetchError(f"{name} of {ARCHIVE}: sha256 {digest} is not the pinned {pinned[name]}; "
                                   "nothing was written")
    parts = {out / "README": out / "README.part"}
    parts.update({out / f"{split}.jsonl.gz": out / f"{split}.jsonl.gz.part" for split in JSONL_SHA256})
    try:  # every file written in full beside its place, then all renamed: never a half-written set
        parts[out / "README"].write_bytes(readme)
        for split in JSONL_SHA256:
            with open(parts[out / f"{split}.jsonl.gz"], "wb") as raw, \
                    gzip.GzipFile(f"{split}.jsonl", "wb", 6, raw, mtime=0) as gz:
                gz.write(texts[split])
        for dest, part in parts.items():
            os.replace(part, dest)
    finally:
        for part in parts.values():
            part.unlink(missing_ok=True)
    archive.unlink()


if __name__ == "__main__":
    sys.exit(fetch.main(__doc__, [fetch.Source(ARCHIVE, URL, None)], fetch.DATA / "imdb", after=unpack))
