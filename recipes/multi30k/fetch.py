"""Fetch Multi30k (task 1, raw: English, German, French, Czech image captions) and check it by sha256.

    python recipes/multi30k/fetch.py [--out DIR] [--mirror URL]

Source: the public repository of the data set, github.com/multi30k/dataset, folder data/task1/raw
(Elliott et al., 2016, "Multi30K: Multilingual English-German Image Descriptions"): train (29,000
sentences), val (1,014) and test_2016_flickr (1,000) of each language, gzip, one sentence a line.
The files go to DIR (default: data/multi30k in the clone, where the recipe looks first, then
../shared/data/multi30k beside it where that is present); `python recipes/multi30k/run.py en-de --data
DIR` reads them from anywhere else. The limits on a slow server (--deadline, --min-rate, --timeout)
are recipes/fetch.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fetch  # noqa: E402 (recipes/fetch.py)

URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
SHA256 = [  # of each file as the project's machines hold it (../shared/data/multi30k)
    ("test_2016_flickr.cs.gz", "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1"),
    ("test_2016_flickr.de.gz", "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8"),
    ("test_2016_flickr.en.gz", "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"),
    ("test_2016_flickr.fr.gz", "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90"),
    ("train.cs.gz", "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077"),
    ("train.de.gz", "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6"),
    ("train.en.gz", "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f"),
    ("train.fr.gz", "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c"),
    ("val.cs.gz", "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc"),
    ("val.de.gz", "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a"),
    ("val.en.gz", "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28"),
    ("val.fr.gz", "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9"),
]
SOURCES = [fetch.Source(name, URL + name, digest) for name, digest in SHA256]

if __name__ == "__main__":
    sys.exit(fetch.main(__doc__, SOURCES, fetch.DATA / "multi30k"))
