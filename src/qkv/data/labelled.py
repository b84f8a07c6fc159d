"""Reading one-sided data: labelled text for classification, plain text for language models.

Formats (plain or gzip, UTF-8, told apart by the file name, else by the first line):

* JSONL (``*.jsonl``, ``*.json``): one JSON object a line, e.g. ``{"text": "...", "label": "pos"}``;
  the keys are ``text_field`` and ``label_field``;
* TSV (``*.tsv``): a header line naming the columns, then one example a line, tab-separated;
* plain text (anything else, for the unlabelled tasks): one text a line; empty lines are skipped.

Every problem is a :class:`~qkv.errors.CorpusError` naming the file and line: invalid UTF-8, a
line that is not a JSON object, a missing field, a wrong number of TSV columns, an empty text.
HTML line breaks (``<br />``, as in the IMDb reviews) become spaces (:func:`clean_text`) unless the
run's ``clean_html`` is off; the model records it, and the same cleaning is applied to what it reads
later (an imported model reads texts as given).
"""

from __future__ import annotations

from dataclasses import dataclass

import json
import re
from pathlib import Path

from qkv.data.corpus import read_lines
from qkv.errors import CorpusError

_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)
_SPACES = re.compile(r"[ \t]{2,}")


def clean_text(text: str, html: bool = True) -> str:
    """``<br />`` -> a space; runs of spaces squeezed; surrounding whitespace stripped. ``html=False``
    (a model trained without the cleaning, or an imported one): the text as given."""
    return _SPACES.sub(" ", _BR.sub(" ", text)).strip() if html else text


def file_format(path: str | Path, first_line: str | None = None) -> str:
    """'jsonl', 'tsv' or 'text': by the file name (``.gz`` ignored), else by the first line."""
    name = Path(path).name.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".tsv"):
        return "tsv"
    if first_line is not None and first_line.lstrip().startswith("{"):
        return "jsonl"
    return "text"


def _records(path: str | Path, fields: list[str]) -> tuple[list[list[str]], list[int], str]:
    """The requested fields of every non-blank line, their line numbers, and the format."""
    lines = read_lines(path)
    first = next((line for line in lines if line.strip()), None)
    fmt = file_format(path, first)
    rows: list[list[str]] = []
    numbers: list[int] = []
    if fmt == "jsonl":
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{n}: not a JSON object (JSONL needs one per line): {e.msg}") from None
            if not isinstance(obj, dict):
                raise CorpusError(f"{path}:{n}: expected a JSON object like {{\"{fields[0]}\": ...}}, got {line[:40]!r}")
            row = []
            for f in fields:
                if f not in obj:
                    raise CorpusError(f"{path}:{n}: no field {f!r} (the line has: {', '.join(map(str, obj)) or 'none'}); "
                                      f"choose it with --{'text' if f == fields[0] else 'label'}-field")
                v = obj[f]
                if isinstance(v, (dict, list)) or v is None:
                    raise CorpusError(f"{path}:{n}: field {f!r} must be a string or a number, got {v!r}")
                row.append(v if isinstance(v, str) else json.dumps(v))
            rows.append(row)
            numbers.append(n)
    elif fmt == "tsv":
        header_at = next((i for i, line in enumerate(lines) if line.strip()), None)
        if header_at is None:
            return [], [], fmt
        header = lines[header_at].split("\t")
        missing = [f for f in fields if f not in header]
        if missing:
            raise CorpusError(f"{path}:{header_at + 1}: the TSV header has no column {missing[0]!r} "
                              f"(columns: {', '.join(header)})")
        cols = [header.index(f) for f in fields]
        for n, line in enumerate(lines[header_at + 1:], start=header_at + 2):
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != len(header):
                raise CorpusError(f"{path}:{n}: {len(parts)} tab-separated columns, the header has {len(header)}")
            rows.append([parts[c] for c in cols])
            numbers.append(n)
    else:
        if len(fields) > 1:
            raise CorpusError(f"{path}: labelled data must be JSONL (*.jsonl) or TSV with a header (*.tsv); "
                              f"this file is neither (first line: {first[:60]!r})" if first else f"{path}: empty file")
        for n, line in enumerate(lines, start=1):
            if line.strip():
                rows.append([line])
                numbers.append(n)
    return rows, numbers, fmt


@dataclass
class TextData:
    """One-sided examples: texts, with a label each for classification."""

    texts: list[str]
    labels: list[str] | None = None
    name: str = "data"
    line_numbers: list[int] | None = None  # 1-based line of each example in its file

    def __len__(self) -> int:
        return len(self.texts)

    def line(self, i: int) -> int:
        return self.line_numbers[i] if self.line_numbers else i + 1



def read_labelled(path: str | Path, text_field: str = "text", label_field: str = "label", clean: bool = True):
    """Labelled examples of a JSONL or TSV file -> :class:`TextData` (texts cleaned unless ``clean`` is
    False: :func:`clean_text`)."""
    rows, numbers, _ = _records(path, [text_field, label_field])
    texts, labels = [], []
    for (text, label), n in zip(rows, numbers):
        text = clean_text(text, clean)
        if not text.strip():
            raise CorpusError(f"{path}:{n}: empty text in field {text_field!r}")
        if not label.strip():
            raise CorpusError(f"{path}:{n}: empty label in field {label_field!r}")
        texts.append(text)
        labels.append(label.strip())
    if not texts:
        raise CorpusError(f"{path}: no examples")
    return TextData(texts, labels, str(path), numbers)


def read_texts(path: str | Path, text_field: str = "text", clean: bool = True):
    """Unlabelled texts: plain lines, or the ``text_field`` of JSONL/TSV -> TextData (empty ones skipped;
    cleaned unless ``clean`` is False)."""
    rows, numbers, fmt = _records(path, [text_field])
    texts, kept = [], []
    for (text,), n in zip(rows, numbers):
        text = clean_text(text, clean)
        if text.strip():
            texts.append(text)
            kept.append(n)
        elif fmt != "text":
            raise CorpusError(f"{path}:{n}: empty text in field {text_field!r}")
    if not texts:
        raise CorpusError(f"{path}: no text")
    return TextData(texts, None, str(path), kept)
