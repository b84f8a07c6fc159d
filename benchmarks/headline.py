"""The embedded default task's headline figures, kept in one place: docs/headline.json.

    python benchmarks/headline.py            # list every quote in the pages that disagrees with it
    python benchmarks/headline.py --write    # rewrite those quotes from docs/headline.json

The pages quote the figures in three forms, and only in these forms:

- ``95.8% exact match`` (the overall held-out exact match, as `qkv train` prints it);
- ``about 2 minutes on an idle 2-core machine`` (the wall time, end to end, in whole minutes);
- ``108 s end to end`` (the same wall time, in seconds).

Pages: README.md and docs/*.md (not the tuning journal, which keeps the history of the figure).
tests/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "docs" / "headline.json"
PLACEHOLDER = "TO BE MEASURED"

# each form: the pattern of the quoted number, and how the headline writes it
FORMS = {
    "exact match": (re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?=%\s+exact\s+match)"),
                    lambda h: f"{h['exact_match_percent']:.1f}"),
    "minutes": (re.compile(r"(?<=[Aa]bout )\d+(?:\.\d+)?(?=\s+minutes?\s+on\s+an\s+idle\s+2-core\s+machine)"),
                lambda h: f"{round(h['wall_time_s'] / 60)}"),
    "seconds": (re.compile(r"(?<![\d.])\d+(?=\s+s\s+end\s+to\s+end)"), lambda h: f"{h['wall_time_s']:.0f}"),
}


def headline() -> dict:
    return json.loads(SOURCE.read_text(encoding="utf-8"))


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "tuning-journal.md")]


def disagreements(h: dict | None = None) -> list[str]:
    """``page:line: form: quoted X, headline Y`` for every quote that differs from the headline."""
    h = h or headline()
    found = []
    for page in pages():
        text = page.read_text(encoding="utf-8")  # whole: a quote may wrap across lines
        for form, (pattern, write) in FORMS.items():
            for m in pattern.finditer(text):
                if m.group() != write(h):
                    number = text.count("\n", 0, m.start()) + 1
                    found.append(f"{page.relative_to(ROOT)}:{number}: {form}: quoted {m.group()}, "
                                 f"docs/headline.json gives {write(h)}")
    return found


def rewrite(h: dict | None = None) -> list[Path]:
    """Rewrite every quote from the headline; returns the pages changed."""
    h = h or headline()
    changed = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = text
        for pattern, write in FORMS.values():
            new = pattern.sub(write(h), new)
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed.append(page)
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite the quotes from docs/headline.json")
    args = ap.parse_args()
    h = headline()
    for name in ("exact_match_percent", "wall_time_s"):
        if not isinstance(h.get(name), (int, float)):
            print(f"docs/headline.json: '{name}' must be a number, got {h.get(name)!r}", file=sys.stderr)
            return 2
    if args.write:
        for page in rewrite(h):
            print(f"rewrote {page.relative_to(ROOT)}")
        return 0
    found = disagreements(h)
    print("\n".join(found) if found else "every quote agrees with docs/headline.json")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
