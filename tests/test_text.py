"""Plain text for language modelling: Gutenberg stripping, the held-out split, streams and windows."""

from pathlib import Path

import pytest
import torch

from qkv.config import EOS
from qkv.data.text import batchify, holdout_split, lm_windows, read_text, strip_gutenberg, token_stream
from qkv.errors import CorpusError, QkvError
from qkv.bptt import bptt_windows

BOOK = """The Project Gutenberg EBook of A Tiny Book
Release Date: never

*** START OF THIS PROJECT GUTENBERG EBOOK A TINY BOOK ***


The first line of the book.
The last line of the book.

*** END OF THIS PROJECT GUTENBERG EBOOK A TINY BOOK ***
*** START: FULL LICENSE ***
Licence text that must not be kept.
"""

TIMEMACHINE = next((p for p in (Path(__file__).resolve().parents[1] / "data" / "timemachine" / "timemachine.txt",
                                 Path(__file__).resolve().parents[2] / "shared" / "data" / "timemachine" / "timemachine.txt",
                                 Path("/work/shared/data/timemachine/timemachine.txt")) if p.is_file()),
                   Path(__file__).resolve().parents[1] / "data" / "timemachine" / "timemachine.txt")


def test_strip_gutenberg_keeps_only_the_book(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text(BOOK, encoding="utf-8")
    assert strip_gutenberg(read_text(f), str(f)) == ["The first line of the book.", "The last line of the book."]


def test_missing_markers_are_clear_errors(tmp_path):
    with pytest.raises(CorpusError, match=r"book.txt: no line starting with '\*\*\* START'"):
        strip_gutenberg(["just text"], "book.txt")
    with pytest.raises(CorpusError, match=r"book.txt:2: .*no '\*\*\* END' line"):
        strip_gutenberg(["x", "*** START OF IT ***", "text"], "book.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(CorpusError, match="empty.txt: no text"):
        read_text(empty)
    with pytest.raises(CorpusError, match="not found|does not exist|no such"):
        read_text(tmp_path / "missing.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xff\xfe oops\n")
    with pytest.raises(CorpusError, match="bad.txt:2: invalid UTF-8"):
        read_text(bad)


def test_holdout_keeps_the_last_ten_percent_at_a_line_boundary():
    lines = [f"line {i:02d} " + "x" * 10 for i in range(20)]  # 20 lines of equal length
    train, valid = holdout_split(lines, 0.1)
    assert train == lines[:18] and valid == lines[18:]
    assert train + valid == lines
    # unequal lines: the boundary nearest to 90% of the characters (newlines counted)
    lines = ["a" * 49, "b" * 39, "c" * 9]  # sizes 50, 40, 10 of 100: the cut after line 2 is exact
    assert holdout_split(lines, 0.1) == (lines[:2], lines[2:])
    with pytest.raises(QkvError, match="too short"):
        holdout_split(["only one line"], 0.1)


def test_token_stream_ends_each_line_with_eos():
    encode = lambda lines: [[10 + len(w) for w in line.split()] for line in lines]  # noqa: E731
    assert token_stream(["ab c", "", "d"], encode) == [12, 11, EOS, EOS, 11, EOS]


def test_lm_windows_inputs_and_shifted_targets():
    w = lm_windows(list(range(10)), 3)  # 9 // 3 = 3 windows of 4
    assert w.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert lm_windows([1, 2, 3], 8).tolist() == [[1, 2, 3]]


def test_batchify_rows_are_contiguous_and_bptt_windows_follow_in_time():
    rows = batchify(list(range(20)), 3)  # 6 per row, 2 dropped
    assert rows.tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    wins = list(bptt_windows(rows, 2))  # the rows feed truncated BPTT: windows follow in time
    assert [w.inputs.tolist()[1] for w in wins] == [[6, 7], [8, 9], [10]]
    assert torch.equal(torch.cat([w.targets for w in wins], 1), rows[:, 1:])


@pytest.mark.skipif(not TIMEMACHINE.is_file(), reason=f"{TIMEMACHINE} is absent (the shared data set)")
def test_the_time_machine_strips_and_splits():
    body = strip_gutenberg(read_text(TIMEMACHINE), str(TIMEMACHINE))
    assert body[0].startswith("The Time Machine")  # the header is gone
    assert not any(line.startswith("***") or "Section 1." in line for line in body)  # markers and licence too
    train, valid = holdout_split(body, 0.1)
    share = sum(len(v) + 1 for v in valid) / sum(len(v) + 1 for v in body)
    assert abs(share - 0.1) < 0.01
