"""Plain text for language modelling: reading, Gutenberg stripping, the held-out split, and the
token stream cut into training windows.

A language model reads one long text. Here it is kept as lines (read by
:func:`qkv.data.corpus.read_lines`, so a missing file or invalid UTF-8 names the file and line)
and turned into one token stream, each line followed by EOS, the convention of WikiText-style
corpora: EOS marks the end of a line, and a generated EOS prints as a newline.

    "the time\\nmachine"  ->  [t h e ▁ t i m e] EOS [m a c h i n e] EOS      (character level)

Training cuts the stream two ways:

* Transformer (:func:`lm_windows`): non-overlapping windows of ``n + 1`` tokens, each an input
  ``x_1..x_n`` and its targets ``x_2..x_{n+1}`` (shuffled between batches; no state crosses them);
* RNN (:func:`batchify`, then :func:`qkv.bptt.bptt_windows`): the stream is cut into B
  contiguous rows ``(B, N)``, and consecutive windows ``(B, bptt)`` of those rows follow each other in time,
  so the recurrent state at the end of one window is the right initial state of the next
  (truncated backpropagation through time).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from qkv.config import EOS
from qkv.data.corpus import read_lines
from qkv.errors import CorpusError, QkvError

GUTENBERG_START = "*** START"
GUTENBERG_END = "*** END"


def read_text(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file (plain or gzip); a file without any text is an error."""
    lines = read_lines(path)
    if not any(line.strip() for line in lines):
        raise CorpusError(f"{path}: no text in the file (it is empty or all blank lines)")
    return lines


def strip_gutenberg(lines: Sequence[str], source: str = "text") -> list[str]:
    """The book without Project Gutenberg's header and licence: the lines strictly between the
    first line starting with ``*** START`` and the first line after it starting with ``*** END``.
    Leading and trailing blank lines of the book are dropped."""
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith(GUTENBERG_START)), None)
    if start is None:
        raise CorpusError(f"{source}: no line starting with '{GUTENBERG_START}' (is it a Project Gutenberg "
                          "text? leave out --strip-gutenberg for other files)")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith(GUTENBERG_END)), None)
    if end is None:
        raise CorpusError(f"{source}:{start + 1}: '{GUTENBERG_START}' line has no '{GUTENBERG_END}' line after it")
    body = list(lines[start + 1 : end])
    while body and not body[0].strip():
        body.pop(0)
    while body and not body[-1].strip():
        body.pop()
    if not body:
        raise CorpusError(f"{source}: no text between the '{GUTENBERG_START}' and '{GUTENBERG_END}' lines")
    return body


def holdout_split(lines: Sequence[str], fraction: float = 0.1) -> tuple[list[str], list[str]]:
    """Hold out the end of a text: ``(train, valid)`` where valid is the last lines holding
    ``fraction`` of the characters (newlines counted), cut at the line boundary nearest to it."""
    if not 0 < fraction < 1:
        raise QkvError(f"the held-out fraction must be in (0, 1), got {fraction}")
    sizes = [len(line) + 1 for line in lines]  # + the newline
    total = sum(sizes)
    target = total * (1 - fraction)
    done, cut = 0, 0
    for i, size in enumerate(sizes):  # the boundary before line i is at `done` characters
        if abs(done + size - target) >= abs(done - target):
            break
        done, cut = done + size, i + 1
    train, valid = list(lines[:cut]), list(lines[cut:])
    if not any(t.strip() for t in train) or not any(v.strip() for v in valid):
        raise QkvError(f"a text of {len(lines)} line(s) is too short to hold out {fraction:.0%} of it")
    return train, valid


def token_stream(lines: Sequence[str], encode) -> list[int]:
    """One stream of ids: each line's tokens followed by EOS. ``encode`` maps a list of lines
    to lists of ids (e.g. :meth:`qkv.data.tokenizer.Tokenizer.encode`)."""
    stream: list[int] = []
    for ids in encode(list(lines)):
        stream.extend(ids)
        stream.append(EOS)
    return stream


def lm_windows(stream: Sequence[int], length: int) -> torch.Tensor:
    """Non-overlapping windows ``(W, length + 1)``: row w is ``stream[w·length : (w+1)·length + 1]``;
    its first ``length`` tokens are the input and its last ``length`` the targets. The tail that
    does not fill a window is dropped (a stream shorter than ``length + 1`` gives one short window)."""
    if length < 1:
        raise QkvError(f"window length must be >= 1, got {length}")
    ids = torch.as_tensor(list(stream), dtype=torch.long)
    if ids.numel() < 2:
        raise QkvError(f"a token stream of {ids.numel()} token(s) is too short for a language model")
    n = (ids.numel() - 1) // length
    if n == 0:
        return ids[None]  # (1, len): one short window
    return ids[: n * length + 1].unfold(0, length + 1, length)  # (W, length + 1); windows share one token


def batchify(stream: Sequence[int], batch_size: int) -> torch.Tensor:
    """Cut the stream into ``batch_size`` contiguous rows ``(B, N)``: row b is the b-th consecutive
    chunk of N = len // B tokens (the remainder is dropped), so each row reads on in time."""
    ids = torch.as_tensor(list(stream), dtype=torch.long)
    n = ids.numel() // batch_size
    if n < 2:
        raise QkvError(f"a token stream of {ids.numel()} tokens is too short for {batch_size} rows of at least 2 tokens")
    return ids[: n * batch_size].view(batch_size, n)  # (B, N)
