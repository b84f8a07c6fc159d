"""Reading and validating corpora: one sentence per line, plain text or gzip, UTF-8.

Every problem with a corpus file is a :class:`~qkv.errors.CorpusError` whose message names the
file (and the line where there is one): a missing file, a directory, invalid UTF-8, a corrupt
gzip stream, a line so long it cannot be a sentence, or parallel files of different lengths.
Sentence pairs that are merely unusable (an empty side, too many tokens) are skipped, and a
:class:`CorpusReport` counts them with their original line numbers.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qkv.errors import CorpusError

# A "sentence" longer than this (in characters) means a wrong file: binary data, no newlines...
MAX_LINE_CHARS = 100_000

_GZIP_MAGIC = b"\x1f\x8b"


def read_lines(path: str | Path) -> list[str]:
    """Read a UTF-8 text file (plain or gzip, told apart by magic bytes) into a list of lines.

    Line endings (``\\n`` or ``\\r\\n``) are stripped; nothing else is. Lines are split on
    ``\\n`` only (not on the other separators ``str.splitlines`` knows, such as U+2028), so
    that line numbers agree with ``wc -l`` and with the other side of a parallel corpus.
    A UTF-8 byte-order mark at the start of the file is dropped.
    """
    return decode_lines(_read_bytes(Path(path)), str(path))


def decode_lines(data: bytes, path: str = "<stdin>") -> list[str]:
    """The lines of UTF-8 ``data`` as :func:`read_lines` splits them; errors name ``path``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1)
        raise CorpusError(
            f"{path}:{line}: invalid UTF-8 at byte {column} of the line "
            f"(byte {e.start} of the file): {e.reason}"
        ) from None
    text = text.removeprefix("\ufeff")
    lines = text.split("\n")
    if lines[-1] == "":  # the newline that ends the last line (or an empty file)
        lines.pop()
    lines = [line.removesuffix("\r") for line in lines]
    for number, line in enumerate(lines, start=1):
        if len(line) > MAX_LINE_CHARS:
            raise CorpusError(
                f"{path}:{number}: line of {len(line)} characters (limit {MAX_LINE_CHARS}); "
                "is this a text file with one sentence per line?"
            )
    return lines


def _read_bytes(path: Path) -> bytes:
    """The file's content, decompressed if it is gzip."""
    if not path.exists():
        raise CorpusError(f"{path}: no such file")
    if path.is_dir():
        raise CorpusError(f"{path}: is a directory, expected a text file")
    try:
        with path.open("rb") as fh:
            data = fh.read()
    except OSError as e:
        raise CorpusError(f"{path}: cannot read: {e.strerror or e}") from None
    if data.startswith(_GZIP_MAGIC):
        try:
            return gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise CorpusError(f"{path}: corrupt gzip file: {e}") from None
    return data


@dataclass
class CorpusReport:
    """What reading (and length-filtering) a parallel corpus kept and skipped.

    ``skipped_empty`` and ``skipped_long`` hold 1-based line numbers of the original files.
    ``max_len`` is the token limit ``filter_by_length`` applied (None before filtering).
    """

    paths: list[str]
    n_lines: int
    skipped_empty: list[int] = field(default_factory=list)
    skipped_long: list[int] = field(default_factory=list)
    max_len: int | None = None

    @property
    def n_pairs(self) -> int:
        """Pairs kept: all lines minus the skipped ones."""
        return self.n_lines - len(self.skipped_empty) - len(self.skipped_long)

    def summary(self) -> str:
        """One human line, e.g.
        ``train.en/train.de: 29000 pairs, skipped 3 empty (lines 4, 9, 12), 1 over 256 tokens (line 77)``.
        """
        names = "/".join(Path(p).name for p in self.paths)
        text = f"{names}: {self.n_pairs} pairs"
        skipped = []
        if self.skipped_empty:
            skipped.append(f"{len(self.skipped_empty)} empty ({_lines(self.skipped_empty)})")
        if self.skipped_long:
            skipped.append(f"{len(self.skipped_long)} over {self.max_len} tokens ({_lines(self.skipped_long)})")
        if skipped:
            text += ", skipped " + ", ".join(skipped)
        return text


def _lines(numbers: list[int], show: int = 10) -> str:
    """'line 7' / 'lines 4, 9, 12' / 'lines 1, 2, ..., 10 and 5 more'."""
    if len(numbers) == 1:
        return f"line {numbers[0]}"
    text = "lines " + ", ".join(str(n) for n in numbers[:show])
    if len(numbers) > show:
        text += f" and {len(numbers) - show} more"
    return text


@dataclass
class ParallelText:
    """Aligned sentence pairs; ``line_numbers[i]`` is the 1-based line pair ``i`` came from."""

    src: list[str]
    tgt: list[str]
    line_numbers: list[int]
    report: CorpusReport

    def __len__(self) -> int:
        return len(self.src)


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> ParallelText:
    """Read two line-aligned files. Pairs with an empty (or blank) side are skipped and counted."""
    src_lines = read_lines(src_path)
    tgt_lines = read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise CorpusError(
            f"parallel files differ in length: {src_path} has {len(src_lines)} lines, "
            f"{tgt_path} has {len(tgt_lines)} lines"
        )
    report = CorpusReport(paths=[str(src_path), str(tgt_path)], n_lines=len(src_lines))
    src, tgt, line_numbers = [], [], []
    for number, (s, t) in enumerate(zip(src_lines, tgt_lines), start=1):
        if not s.strip() or not t.strip():
            report.skipped_empty.append(number)
            continue
        src.append(s)
        tgt.append(t)
        line_numbers.append(number)
    return ParallelText(src, tgt, line_numbers, report)


def filter_by_length(
    src_ids: Sequence[Sequence[int]],
    tgt_ids: Sequence[Sequence[int]],
    max_len: int,
    line_numbers: Sequence[int] | None = None,
    report: CorpusReport | None = None,
) -> list[int]:
    """Indices of the pairs whose both sides have at most ``max_len`` tokens.

    Lengths count the tokenizer's output only, not the BOS/EOS that ``collate`` adds.
    The line numbers (``line_numbers[i]``, default ``i + 1``) of the dropped pairs are added
    to ``report.skipped_long`` when a report is given.
    """
    kept = []
    for i, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)):
        if len(s) <= max_len and len(t) <= max_len:
            kept.append(i)
        elif report is not None:
            report.skipped_long.append(line_numbers[i] if line_numbers is not None else i + 1)
    if report is not None:
        report.max_len = max_len
    return kept


def _open_binary(path: Path):
    """A binary file handle, decompressing if the file is gzip (told apart by its magic bytes)."""
    if not path.exists():
        raise CorpusError(f"{path}: no such file")
    if path.is_dir():
        raise CorpusError(f"{path}: is a directory, expected a text file")
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise CorpusError(f"{path}: cannot read: {e.strerror or e}") from None
    if fh.read(2) == _GZIP_MAGIC:
        fh.close()
        return gzip.open(path, "rb")
    fh.seek(0)
    return fh


def stream_lines(path: str | Path) -> Iterator[bytes]:
    """The raw lines of a text file (plain or gzip) without their line endings, read in a stream.
    A UTF-8 byte-order mark at the start is dropped; lines are decoded where they are used."""
    path = Path(path)
    fh = _open_binary(path)
    try:
        first = True
        for raw in fh:
            if first:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
                first = False
            yield raw.removesuffix(b"\n").removesuffix(b"\r")
    except (OSError, EOFError) as e:
        raise CorpusError(f"{path}: cannot read (corrupt gzip?): {e}") from None
    finally:
        fh.close()


def decode_line(raw: bytes, path: str, number: int) -> str:
    """One line as text; invalid UTF-8 or an absurd length is a CorpusError naming ``path:number``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}:{number}: invalid UTF-8 at byte {e.start} of the line: {e.reason}") from None
    if len(text) > MAX_LINE_CHARS:
        raise CorpusError(f"{path}:{number}: line of {len(text)} characters (limit {MAX_LINE_CHARS}); "
                          "is this a text file with one sentence per line?")
    return text


def count_lines(path: str | Path) -> int:
    """The lines of a text file (plain or gzip), counted in a stream (for a progress bar's total)."""
    n, last = 0, b"\n"
    fh = _open_binary(Path(path))
    try:
        while block := fh.read(1 << 22):
            n += block.count(b"\n")
            last = block[-1:]
    finally:
        fh.close()
    return n + (last != b"\n")


def input_chunks(texts: list[str] | None, path: str | None, size: int) -> Iterator[list[str]]:
    """:func:`read_inputs` in a stream: the lines in lists of at most ``size``, the file (or stdin)
    read as they are needed, never whole; invalid UTF-8 is a CorpusError naming the file and line."""
    if texts:
        yield list(texts)
        return
    import sys

    if path and path != "-":
        raw, name = stream_lines(path), str(path)
    else:
        raw, name = (line.removesuffix(b"\n").removesuffix(b"\r") for line in sys.stdin.buffer), "<stdin>"
    chunk: list[str] = []
    for number, line in enumerate(raw, start=1):
        chunk.append(decode_line(line.removeprefix(b"\xef\xbb\xbf") if number == 1 else line, name, number))
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def read_inputs(texts: list[str] | None, path: str | None) -> list[str]:
    """Texts given as arguments, else the lines of ``path``, else of stdin (``path`` "-" or None)."""
    import sys

    if texts:
        return list(texts)
    if path and path != "-":
        return read_lines(path)
    return decode_lines(sys.stdin.buffer.read(), "<stdin>")
