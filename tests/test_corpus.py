"""Tests for qkv.data.corpus: reading plain/gzip UTF-8 files and every corpus error."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from qkv.data.corpus import MAX_LINE_CHARS, CorpusReport, filter_by_length, read_lines, read_parallel
from qkv.errors import CorpusError, QkvError


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_plain_lines_and_newline_handling(tmp_path: Path) -> None:
    p = write(tmp_path / "a.txt", "eins\nzwei drei\n\n  vier  \n".encode())
    assert read_lines(p) == ["eins", "zwei drei", "", "  vier  "]
    # no newline at the end of the last line
    assert read_lines(write(tmp_path / "b.txt", b"x\ny")) == ["x", "y"]
    assert read_lines(write(tmp_path / "empty.txt", b"")) == []


def test_crlf_and_bom(tmp_path: Path) -> None:
    p = write(tmp_path / "win.txt", b"\xef\xbb\xbfGr\xc3\xbc\xc3\x9fe\r\nzwei\r\n")
    assert read_lines(p) == ["Grüße", "zwei"]


def test_only_newline_splits_lines(tmp_path: Path) -> None:
    # U+2028 and form feed are characters inside a sentence, not line breaks
    p = write(tmp_path / "sep.txt", "a\u2028b\nc\x0cd\n".encode())
    assert read_lines(p) == ["a\u2028b", "c\x0cd"]


def test_gzip_detected_by_magic_bytes(tmp_path: Path) -> None:
    content = "ein Haus\nzwei Häuser\n".encode()
    assert read_lines(write(tmp_path / "x.gz", gzip.compress(content))) == ["ein Haus", "zwei Häuser"]
    # a gzip file without the .gz suffix is still recognised
    assert read_lines(write(tmp_path / "x.de", gzip.compress(content))) == ["ein Haus", "zwei Häuser"]


def test_corrupt_gzip(tmp_path: Path) -> None:
    good = gzip.compress(("satz\n" * 1000).encode())
    truncated = write(tmp_path / "cut.gz", good[: len(good) // 2])
    with pytest.raises(CorpusError, match=r"cut\.gz: corrupt gzip"):
        read_lines(truncated)
    flipped = bytearray(good)
    flipped[-8] ^= 0xFF  # damage the CRC
    with pytest.raises(CorpusError, match=r"crc\.gz: corrupt gzip"):
        read_lines(write(tmp_path / "crc.gz", bytes(flipped)))


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"nothere\.en: no such file"):
        read_lines(tmp_path / "nothere.en")
    with pytest.raises(CorpusError, match="is a directory"):
        read_lines(tmp_path)
    assert issubclass(CorpusError, QkvError)


def test_invalid_utf8_names_file_line_and_byte(tmp_path: Path) -> None:
    p = write(tmp_path / "latin1.txt", b"fine\nalso fine\nGr\xfc\xdfe\n")
    with pytest.raises(CorpusError, match=re.escape(f"{p}:3: invalid UTF-8 at byte 2 of the line (byte 17 ")):
        read_lines(p)
    # the same inside a gzip file: positions refer to the decompressed text
    gz = write(tmp_path / "latin1.gz", gzip.compress(b"ok\n\xe9t\xe9\n"))
    with pytest.raises(CorpusError, match=re.escape(f"{gz}:2: invalid UTF-8 at byte 0 of the line")):
        read_lines(gz)


def test_overlong_line(tmp_path: Path) -> None:
    ok = "a" * MAX_LINE_CHARS
    assert read_lines(write(tmp_path / "ok.txt", f"x\n{ok}\n".encode())) == ["x", ok]
    p = write(tmp_path / "long.txt", f"x\ny\n{ok}b\n".encode())
    with pytest.raises(CorpusError, match=re.escape(f"{p}:3: line of {MAX_LINE_CHARS + 1} characters")):
        read_lines(p)


def test_read_parallel_skips_empty_pairs(tmp_path: Path) -> None:
    src = write(tmp_path / "train.en", b"one\n\ntwo\nthree\n \nfour\n")
    tgt = write(tmp_path / "train.de", b"eins\nzwei\n\ndrei\nfuenf\nvier\n")
    data = read_parallel(src, tgt)
    assert data.src == ["one", "three", "four"]
    assert data.tgt == ["eins", "drei", "vier"]
    assert data.line_numbers == [1, 4, 6]
    assert len(data) == 3
    assert data.report.n_lines == 6
    assert data.report.skipped_empty == [2, 3, 5]
    assert data.report.summary() == "train.en/train.de: 3 pairs, skipped 3 empty (lines 2, 3, 5)"


def test_read_parallel_line_count_mismatch(tmp_path: Path) -> None:
    src = write(tmp_path / "a.en", b"1\n2\n3\n")
    tgt = write(tmp_path / "a.de", b"1\n2\n")
    with pytest.raises(CorpusError) as err:
        read_parallel(src, tgt)
    message = str(err.value)
    assert f"{src} has 3 lines" in message and f"{tgt} has 2 lines" in message


def test_filter_by_length_records_line_numbers() -> None:
    src_ids = [[5] * 3, [5] * 4, [5] * 2, [5] * 1]
    tgt_ids = [[6] * 3, [6] * 1, [6] * 5, [6] * 3]
    report = CorpusReport(paths=["t.en", "t.de"], n_lines=7, skipped_empty=[2])
    kept = filter_by_length(src_ids, tgt_ids, max_len=3, line_numbers=[1, 3, 6, 7], report=report)
    assert kept == [0, 3]  # pair 1 has 4 source tokens, pair 2 has 5 target tokens
    assert report.skipped_long == [3, 6]
    assert report.n_pairs == 4
    assert report.summary() == "t.en/t.de: 4 pairs, skipped 1 empty (line 2), 2 over 3 tokens (lines 3, 6)"


def test_summary_shortens_long_lists() -> None:
    report = CorpusReport(paths=["a", "b"], n_lines=100, skipped_empty=list(range(1, 13)))
    assert report.summary() == "a/b: 88 pairs, skipped 12 empty (lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 2 more)"
    assert CorpusReport(paths=["a", "b"], n_lines=5).summary() == "a/b: 5 pairs"
