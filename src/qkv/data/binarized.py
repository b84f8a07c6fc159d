"""Binarized corpora: token ids in memory-mapped numpy arrays, written once by ``qkv preprocess``.

fairseq-preprocess's role for qkv. A parallel corpus is tokenized once, in worker processes, in one
streaming pass over the files (chunks of lines; no file is ever held whole in memory), into a
directory that training maps into memory instead of reading and encoding text again::

    DIR/manifest.json            what is here: counts, filters, tokenizer, sha256 of every file
    DIR/spm.model                the SentencePiece model (spm.src.model + spm.tgt.model if separate)
    DIR/train.src.tokens.npy     every kept source sentence's ids, one after the other (uint16, or
                                 int32 for vocabularies of 65536 pieces or more)
    DIR/train.src.offsets.npy    int64: where sentence i starts in the tokens array
    DIR/train.src.lengths.npy    its length in tokens (uint16, or int32 past 65535)
    DIR/train.tgt.*.npy          the same for the target side
    DIR/train.index.npy          the pair indices sorted by (source length, target length): the
                                 order batching reads (int32, int64 past 2**31 pairs)
    DIR/train.buckets.npy        int64 rows (source length, target length, count): the lengths'
                                 table, in the order of train.index.npy
    DIR/valid.*                  the validation split, the same way, and its text (valid.src.txt,
                                 valid.tgt.txt) for the BLEU of validation

Sentence i of a side is ``tokens[offsets[i] : offsets[i] + lengths[i]]``. :func:`open_corpus` reads
the manifest and checks the files (sizes always, sha256 when asked); a split's arrays are opened,
not read: a batch's sentences and its entries of the index are read when it is made (with ``pread``,
see :class:`TokenArray` and :class:`~qkv.data.buckets.LengthIndex`), and processes that read the
same files (DDP ranks) share the operating system's page cache. What training holds in memory is
the bucket table and the batch boundaries, not anything a pair long.

The plain-file path of training builds the same :class:`TokenArray` in memory
(:meth:`TokenArray.from_lists`), so batching and collation are one code path for both.

Filters, each counted in the manifest (a pair is counted under the first it fails, in this order):
``empty`` (a blank side), ``identical`` (source equal to target), ``too_long`` (a side over
``max_len`` tokens), ``ratio`` (one side more than ``max_ratio`` times as long as the other, in
tokens). Bad input is a :class:`~qkv.errors.CorpusError` naming the file and line: a missing file,
invalid UTF-8, files of different line counts. Output goes to a temporary directory beside it,
``.DIR.tmp-PID``, renamed to ``DIR`` at the end: a failed or interrupted run (Ctrl-C, SIGTERM)
leaves no half-written corpus, and the temporary directory of a run killed outright (``kill -9``)
is removed by the next run on that ``DIR`` (never one of a process that is still running).

Worker processes: no more than the cores this process may use and the chunks of work a split makes
(:func:`capped_workers`); each ends with the main process, however that ends (:func:`_die_with_parent`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qkv.data.buckets import LengthIndex, index_dtype
from qkv.data.corpus import decode_line, stream_lines
from qkv.data.tokenizer import Tokenizer, TokenizerPair
from qkv.errors import CorpusError, QkvError
from qkv.files import remove_stale_temps, sha256_file

MANIFEST = "manifest.json"
FORMAT = "qkv-binarized"
VERSION = 2  # 2: the length index (NAME.index.npy, NAME.buckets.npy); version 1 directories build it in memory
FILTERS = ("empty", "identical", "too_long", "ratio")
SIDES = ("src", "tgt")
_HEADER = 128  # bytes reserved for the .npy header, written once the array's length is known


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocabularies under 65536 pieces), else int32."""
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.int32)


# --- arrays --------------------------------------------------------------------------------------------


@dataclass
class TokenArray:
    """The sentences of one side: ``tokens[offsets[i] : offsets[i] + lengths[i]]`` is sentence i.
    In memory (:meth:`from_lists`) or memory-mapped (:meth:`load`); the same either way.

    A loaded array reads a sentence's offset and tokens with ``pread`` from its files (``files``), not
    through the memory maps: a page fault on a mapped file maps the pages around it that are in the page
    cache as well (the kernel's fault-around), so reading a sentence at a time through the maps would
    fill the process's resident memory with the files' pages, growing with the corpus; ``pread`` reads
    the bytes it asks for and maps nothing."""

    tokens: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    files: dict = field(default_factory=dict, repr=False, compare=False)  # part -> (open file, byte offset)

    def __len__(self) -> int:
        return len(self.lengths)

    def _read(self, part: str, array: np.ndarray, start: int, count: int) -> np.ndarray:
        opened = self.files.get(part)
        if opened is None:
            return array[start : start + count]
        fh, base = opened
        size = count * array.dtype.itemsize
        data = os.pread(fh.fileno(), size, base + start * array.dtype.itemsize)
        if len(data) != size:
            raise CorpusError(f"{fh.name}: {len(data)} bytes where {size} were expected at element {start} "
                              "(the file changed after it was opened)")
        return np.frombuffer(data, dtype=array.dtype)

    def __getitem__(self, i: int) -> list[int]:
        if "offsets" not in self.files:
            start = int(self.offsets[i])
            return self.tokens[start : start + int(self.lengths[i])].tolist()
        # where sentence i starts and the next begins (the end of the tokens, for the last): the
        # lengths array is not read, so none of its pages come into the process
        bounds = self._read("offsets", self.offsets, i, 2 if i + 1 < len(self.offsets) else 1)
        start = int(bounds[0])
        end = int(bounds[1]) if len(bounds) == 2 else len(self.tokens)
        return self._read("tokens", self.tokens, start, end - start).tolist()

    def rows(self, indices: Sequence[int]) -> list[list[int]]:
        return [self[i] for i in indices]

    def tolist(self) -> list[list[int]]:
        return self.rows(range(len(self)))

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]], vocab_size: int = 2**16 - 1) -> "TokenArray":
        """An in-memory array of the same layout as the files :func:`preprocess` writes."""
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows), dtype=np.int64)
        if len(rows) > 1:
            np.cumsum(lengths[:-1], out=offsets[1:])
        tokens = np.fromiter((t for r in rows for t in r), dtype=token_dtype(vocab_size), count=int(lengths.sum()))
        return cls(tokens, offsets, lengths.astype(_length_dtype(lengths)))

    @classmethod
    def load(cls, directory: Path, prefix: str) -> "TokenArray":
        """Map ``DIR/PREFIX.{tokens,offsets,lengths}.npy`` read-only (nothing is read yet)."""
        arrays, files = [], {}
        for part in ("tokens", "offsets", "lengths"):
            path = directory / f"{prefix}.{part}.npy"
            try:
                arrays.append(np.load(path, mmap_mode="r"))
            except (OSError, ValueError) as e:
                raise CorpusError(f"{path}: cannot map the array: {e}") from None
            if part != "lengths":  # read a sentence at a time, in random order: no read-ahead around it
                _advise_random(arrays[-1])
                if isinstance(arrays[-1], np.memmap) and hasattr(os, "pread"):  # and read with pread (above)
                    files[part] = (open(path, "rb", buffering=0), int(arrays[-1].offset))
        return cls(*arrays, files=files)


def _advise_random(array: np.ndarray) -> None:
    """madvise(MADV_RANDOM) on a memory-mapped array where the platform has it: the kernel then
    maps the pages a batch touches, not the read-ahead window around each (which would fill the
    process's resident memory with sentences it never reads)."""
    import mmap

    m = getattr(array, "_mmap", None)
    if m is not None and hasattr(m, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        try:
            m.madvise(mmap.MADV_RANDOM)
        except OSError:
            pass


def _length_dtype(lengths: np.ndarray) -> np.dtype:
    return np.dtype(np.uint16 if not len(lengths) or int(lengths.max()) < 2**16 else np.int32)


class _NpyWriter:
    """A 1-D .npy file written in pieces: a header of fixed size is rewritten with the length at the end."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.n = path, np.dtype(dtype), 0
        self.fh = open(path, "wb")
        self.fh.write(b"\0" * _HEADER)

    def write(self, values: np.ndarray) -> None:
        self.fh.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.n += len(values)

    def close(self) -> None:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                      "fortran_order": False, "shape": (self.n,)})
        data = header.getvalue()
        if len(data) != _HEADER:  # numpy pads 1-D headers to 128 bytes; anything else would misalign
            raise QkvError(f"{self.path}: unexpected .npy header of {len(data)} bytes")
        self.fh.seek(0)
        self.fh.write(data)
        self.fh.close()


# --- reading text, streaming ----------------------------------------------------------------------------


def paired_chunks(src: Path, tgt: Path, size: int) -> Iterator[tuple[int, list[bytes], list[bytes]]]:
    """``(first line number, source lines, target lines)`` of at most ``size`` pairs; files of
    different lengths are a CorpusError naming the shorter file and the line it lacks."""
    a, b = stream_lines(src), stream_lines(tgt)
    number, chunk_s, chunk_t = 1, [], []
    start = 1
    while True:
        s = next(a, None)
        t = next(b, None)
        if s is None or t is None:
            if s is not None or t is not None:
                short, long_ = (src, tgt) if s is None else (tgt, src)
                raise CorpusError(f"parallel files differ in length: {short} has {number - 1} lines, {long_} "
                                  f"has a line {number} (and perhaps more)")
            break
        chunk_s.append(s)
        chunk_t.append(t)
        number += 1
        if len(chunk_s) == size:
            yield start, chunk_s, chunk_t
            start, chunk_s, chunk_t = number, [], []
    if chunk_s:
        yield start, chunk_s, chunk_t


# --- encoding, in workers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """What preprocessing drops from the training split (validation: only empty pairs)."""

    max_len: int = 256  # tokens per side
    max_ratio: float = 9.0  # longer side / shorter side, in tokens (0: off)
    drop_identical: bool = True


@dataclass
class ChunkResult:
    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    skipped: dict[str, list[int]]  # filter -> line numbers
    texts: tuple[list[str], list[str]] | None = None  # the kept text (validation only)


_worker_tokenizers: TokenizerPair | None = None


def _init_worker(src_model: bytes, tgt_model: bytes) -> None:
    global _worker_tokenizers
    src = Tokenizer(src_model)
    _worker_tokenizers = TokenizerPair(src, src if tgt_model == src_model else Tokenizer(tgt_model))


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM that come during the block take effect when it ends: the interrupt they
    raise would otherwise strike inside ``os.fork``'s hooks, where it is printed and ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in caught[:1]:
            signal.raise_signal(signum)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def capped_workers(workers: int, chunks: int, cores: int | None = None) -> int:
    """``workers`` no more than the cores and no more than the chunks of work there are (at least 1)."""
    return max(1, min(workers, available_cores() if cores is None else cores, chunks))


def count_chunks(path: Path, chunk_lines: int, limit: int) -> int:
    """How many chunks of ``chunk_lines`` lines ``path`` makes, counted only up to ``limit`` chunks."""
    lines = sum(1 for _ in itertools.islice(stream_lines(path), limit * chunk_lines))
    return -(-lines // chunk_lines)


PARENT_POLL_S = 0.5  # how often a worker looks whether its parent is still there (where prctl is not)


def _die_with_parent(parent: int) -> None:
    """End this process when the process ``parent`` ends, however it ends (``kill -9`` included):
    on Linux the kernel sends SIGKILL (``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon thread looks
    at the parent's pid every :data:`PARENT_POLL_S` seconds. A parent already gone ends it at once."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_S)
            os._exit(1)

        threading.Thread(target=watch, name="qkv-parent-watch", daemon=True).start()


def _init_pool_worker(src_model: bytes, tgt_model: bytes, parent: int | None = None) -> None:
    """A worker process of the pool: the tokenizers, and signals left to the main process, which
    stops the pool (Ctrl-C reaches the whole process group; SIGTERM ends a worker quietly). A worker
    ends with its parent: a main process killed outright (``kill -9``) leaves no worker behind."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if parent is not None:
        _die_with_parent(parent)
    _init_worker(src_model, tgt_model)


def encode_chunk(job: tuple) -> ChunkResult:
    """Decode, filter and encode one chunk of line pairs (in a worker process)."""
    start, src_lines, tgt_lines, paths, filters, train = job
    tok = _worker_tokenizers
    assert tok is not None
    skipped: dict[str, list[int]] = {f: [] for f in FILTERS}
    kept_s, kept_t, numbers = [], [], []
    for k, (rs, rt) in enumerate(zip(src_lines, tgt_lines)):
        n = start + k
        s, t = decode_line(rs, paths[0], n), decode_line(rt, paths[1], n)
        if not s.strip() or not t.strip():
            skipped["empty"].append(n)
        elif train and filters.drop_identical and s.strip() == t.strip():
            skipped["identical"].append(n)
        else:
            kept_s.append(s)
            kept_t.append(t)
            numbers.append(n)
    ids_s, ids_t = tok.src.encode(kept_s), tok.tgt.encode(kept_t)
    keep = []
    for i, (a, b) in enumerate(zip(ids_s, ids_t)):
        la, lb = len(a), len(b)
        if train and (la > filters.max_len or lb > filters.max_len):
            skipped["too_long"].append(numbers[i])
        elif train and filters.max_ratio and max(la, lb) > filters.max_ratio * max(1, min(la, lb)):
            skipped["ratio"].append(numbers[i])
        else:
            keep.append(i)
    dtype = token_dtype(max(tok.src.vocab_size, tok.tgt.vocab_size))
    out_tokens, out_lengths = {}, {}
    for side, ids in (("src", ids_s), ("tgt", ids_t)):
        rows = [ids[i] for i in keep]
        out_lengths[side] = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        out_tokens[side] = np.fromiter((x for r in rows for x in r), dtype=dtype, count=int(out_lengths[side].sum()))
    texts = None if train else ([kept_s[i] for i in keep], [kept_t[i] for i in keep])
    return ChunkResult(out_tokens, out_lengths, skipped, texts)


# --- preprocessing --------------------------------------------------------------------------------------


@dataclass
class SplitCounts:
    lines: int = 0
    pairs: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: {"src": 0, "tgt": 0})
    max_length: dict[str, int] = field(default_factory=lambda: {"src": 0, "tgt": 0})
    skipped: dict[str, int] = field(default_factory=lambda: {f: 0 for f in FILTERS})
    skipped_lines: dict[str, list[int]] = field(default_factory=lambda: {f: [] for f in FILTERS})

    def add(self, n_lines: int, r: ChunkResult) -> None:
        self.lines += n_lines
        self.pairs += len(r.lengths["src"])
        for side in SIDES:
            self.tokens[side] += int(r.lengths[side].sum())
            if len(r.lengths[side]):
                self.max_length[side] = max(self.max_length[side], int(r.lengths[side].max()))
        for f, numbers in r.skipped.items():
            self.skipped[f] += len(numbers)
            room = 20 - len(self.skipped_lines[f])  # the first 20 line numbers of each, for the report
            self.skipped_lines[f].extend(numbers[:room])

    def summary(self, name: str) -> str:
        skipped = ", ".join(f"{n} {f.replace('_', ' ')}" for f, n in self.skipped.items() if n)
        return f"{name}: {self.lines} lines, {self.pairs} pairs kept" + (f"; skipped {skipped}" if skipped else "")


def _training_sentences(src: Path, tgt: Path, sides: str) -> Iterator[str]:
    """The lines the tokenizer may learn from, streamed: source and target interleaved (``both``),
    or one side (``src``/``tgt``). Invalid UTF-8 stops it with the file and line."""
    if sides == "both":
        for number, (s, t) in enumerate(zip(stream_lines(src), stream_lines(tgt)), start=1):
            yield decode_line(s, str(src), number)
            yield decode_line(t, str(tgt), number)
    else:
        path = src if sides == "src" else tgt
        for number, s in enumerate(stream_lines(path), start=1):
            yield decode_line(s, str(path), number)


def train_tokenizers(src: Path, tgt: Path, vocab_size: int, model_type: str, joint: bool,
                     sample: int, seed: int = 1) -> TokenizerPair:
    """SentencePiece on a random sample of ``sample`` sentences (its reservoir sampling over the
    streamed corpus: ``input_sentence_size`` with ``shuffle_input_sentence``), with byte fallback."""
    opts = dict(vocab_size=vocab_size, model_type=model_type, byte_fallback=True, input_sentence_size=sample,
                seed=seed)

    def train(sides: str) -> Tokenizer:
        failed: list[CorpusError] = []

        def sentences() -> Iterator[str]:
            try:
                yield from _training_sentences(src, tgt, sides)
            except CorpusError as e:  # SentencePiece would turn it into its own RuntimeError
                failed.append(e)
                raise

        try:
            return Tokenizer.train(sentences(), **opts)
        except QkvError:
            if failed:
                raise failed[0] from None
            raise

    if joint:
        shared = train("both")
        return TokenizerPair(shared, shared)
    return TokenizerPair(train("src"), train("tgt"))


def _file_entries(directory: Path, names: Sequence[str], workers: int = 2) -> dict[str, dict]:
    with ThreadPoolExecutor(max(1, workers)) as pool:  # hashlib releases the GIL on large blocks
        digests = list(pool.map(lambda n: sha256_file(directory / n), names))
    return {n: {"size": (directory / n).stat().st_size, "sha256": d} for n, d in zip(names, digests)}


def _progress(total: int | None, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, dynamic_ncols=True,
                leave=False, disable=not sys.stderr.isatty())


def _write_split(tmp: Path, name: str, src: Path, tgt: Path, tokenizers: TokenizerPair, filters: Filters,
                 train: bool, workers: int, chunk_lines: int) -> SplitCounts:
    """Stream one split through the workers into ``tmp/NAME.{src,tgt}.{tokens,lengths,offsets}.npy``."""
    import multiprocessing as mp
    from collections import deque

    dtype = token_dtype(max(tokenizers.src.vocab_size, tokenizers.tgt.vocab_size))
    tokens = {s: _NpyWriter(tmp / f"{name}.{s}.tokens.npy", dtype) for s in SIDES}
    lengths = {s: _NpyWriter(tmp / f"{name}.{s}.lengths.raw", np.int32) for s in SIDES}
    texts = {s: open(tmp / f"{name}.{s}.txt", "w", encoding="utf-8") for s in SIDES} if not train else None
    counts = SplitCounts()
    paths = (str(src), str(tgt))

    def take(n_lines: int, r: ChunkResult) -> None:
        counts.add(n_lines, r)
        for s in SIDES:
            tokens[s].write(r.tokens[s])
            lengths[s].write(r.lengths[s])
        if texts is not None and r.texts is not None:
            for s, lines in zip(SIDES, r.texts):
                texts[s].writelines(line + "\n" for line in lines)

    total = sum(p.stat().st_size for p in (src, tgt))
    jobs = ((start, a, b, paths, filters, train) for start, a, b in paired_chunks(src, tgt, chunk_lines))
    with _progress(total, f"preprocess {name}") as bar:
        if workers <= 1:
            _init_worker(tokenizers.src.model_bytes, tokenizers.tgt.model_bytes)
            for job in jobs:
                take(len(job[1]), encode_chunk(job))
                bar.update(sum(map(len, job[1])) + sum(map(len, job[2])) + 2 * len(job[1]))
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with contextlib.ExitStack() as stack:
                with _signals_deferred():  # while the workers are forked
                    pool = stack.enter_context(ctx.Pool(workers, _init_pool_worker, (
                        tokenizers.src.model_bytes, tokenizers.tgt.model_bytes, os.getpid())))
                pending: deque = deque()  # at most 2 chunks per worker in flight: memory stays bounded
                for job in jobs:
                    pending.append((job, pool.apply_async(encode_chunk, (job,))))
                    while len(pending) > 2 * workers:
                        done, result = pending.popleft()
                        take(len(done[1]), result.get())
                        bar.update(sum(map(len, done[1])) + sum(map(len, done[2])) + 2 * len(done[1]))
                while pending:
                    done, result = pending.popleft()
                    take(len(done[1]), result.get())
    for s in SIDES:
        tokens[s].close()
        lengths[s].close()
        if texts is not None:
            texts[s].close()
        # lengths in their narrow type, offsets from their running sum, a million at a time
        raw = np.load(tmp / f"{name}.{s}.lengths.raw", mmap_mode="r")
        narrow = _NpyWriter(tmp / f"{name}.{s}.lengths.npy", np.uint16 if counts.max_length[s] < 2**16 else np.int32)
        offsets = _NpyWriter(tmp / f"{name}.{s}.offsets.npy", np.int64)
        at = 0
        for i in range(0, len(raw), 1 << 20):
            block = np.asarray(raw[i : i + (1 << 20)], dtype=np.int64)
            narrow.write(block)
            offsets.write(at + np.concatenate([[0], np.cumsum(block[:-1])]))
            at += int(block.sum())
        narrow.close()
        offsets.close()
        del raw
        (tmp / f"{name}.{s}.lengths.raw").unlink()
    write_length_index(tmp, name)
    return counts


def _split_workers(splits: list[tuple[str, Path, Path]], workers: int, chunk_lines: int,
                   log: Callable[[str], None]) -> dict[str, int]:
    """The worker processes of each split: ``workers`` capped by the cores this process may use and by
    the split's chunks of ``chunk_lines`` lines (a process more than there are chunks would idle);
    the cap on the training split is said through ``log``."""
    if workers <= 1:
        return {name: 1 for name, _, _ in splits}
    cores = available_cores()
    want = min(workers, cores)
    chunks = {name: count_chunks(a, chunk_lines, want) for name, a, _ in splits}
    used = {name: capped_workers(workers, n, cores) for name, n in chunks.items()}
    name, src, _ = splits[0]
    if used[name] < workers:
        why = []
        if cores < workers:
            why.append(f"this process may use {cores} core{'s' * (cores != 1)}")
        if chunks[name] < want:
            why.append(f"{src} makes {chunks[name]} chunk{'s' * (chunks[name] != 1)} of up to {chunk_lines:,} lines")
        log(f"--workers {workers}: {used[name]} worker process{'es' * (used[name] != 1)} used ({'; '.join(why)})")
    return used


def write_length_index(directory: Path, name: str) -> LengthIndex:
    """Write ``NAME.index.npy`` and ``NAME.buckets.npy`` from the split's lengths arrays: the pairs
    sorted by length pair (a counting sort written into the file's memory map) and the bucket table."""
    lengths = [np.load(directory / f"{name}.{s}.lengths.npy", mmap_mode="r") for s in SIDES]
    n = len(lengths[0])
    order = np.lib.format.open_memmap(directory / f"{name}.index.npy", mode="w+", dtype=index_dtype(n), shape=(n,))
    index = LengthIndex.build(*lengths, out=order)
    order.flush()
    del order, lengths
    np.save(directory / f"{name}.buckets.npy", index.table)
    return index


def preprocess(
    src_train: str | Path,
    tgt_train: str | Path,
    out: str | Path,
    src_valid: str | Path | None = None,
    tgt_valid: str | Path | None = None,
    tokenizer_from: str | Path | None = None,
    vocab_size: int = 8000,
    model_type: str = "bpe",
    joint: bool = True,
    sample: int = 1_000_000,
    filters: Filters = Filters(),
    workers: int = 1,
    chunk_lines: int = 20_000,
    log: Callable[[str], None] = print,
) -> dict:
    """Binarize a parallel corpus into ``out`` (a new directory); returns the manifest written.

    The tokenizer is ``tokenizer_from`` (a checkpoint or preprocessed directory, or a SentencePiece
    ``.model``) or trained on a sample of the training text (:func:`train_tokenizers`).
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QkvError(f"{out} exists: give a new directory for the preprocessed corpus (or delete it)")
    if bool(src_valid) != bool(tgt_valid):
        raise QkvError("give both --src-valid and --tgt-valid (or neither)")
    if workers < 1:
        raise QkvError(f"--workers must be at least 1, got {workers}")
    if sample < 1:
        raise QkvError(f"--sample must be at least 1 sentence, got {sample}")
    if vocab_size < 1:
        raise QkvError(f"--vocab-size must be positive, got {vocab_size}")
    if filters.max_len < 1:
        raise QkvError(f"--max-len must be at least 1 token, got {filters.max_len}")
    if not (filters.max_ratio == 0 or 1 <= filters.max_ratio < float("inf")):
        raise QkvError(f"--max-ratio must be 0 (off) or a finite number >= 1, got {filters.max_ratio}")
    splits = [("train", Path(src_train), Path(tgt_train))]
    if src_valid:
        splits.append(("valid", Path(src_valid), Path(tgt_valid)))
    for _, a, b in splits:
        for p in (a, b):
            if not p.is_file():
                raise CorpusError(f"{p}: no such file" if not p.exists() else f"{p}: is not a file")
    split_workers = _split_workers(splits, workers, chunk_lines, log)
    for stale in remove_stale_temps(out.parent, re.escape(f".{out.name}.tmp-") + r"(?P<pid>\d+)"):
        log(f"removed {stale}, left by an interrupted run")
    if tokenizer_from:
        tokenizers = tokenizer_of(tokenizer_from)
        log(f"tokenizer: {tokenizer_from} ({tokenizers!r})")
    else:
        log(f"training a {model_type} tokenizer ({'joint' if joint else 'separate'} vocabulary, up to {vocab_size} "
            f"pieces, byte fallback) on a sample of up to {sample} sentences of {src_train} and {tgt_train}")
        tokenizers = train_tokenizers(Path(src_train), Path(tgt_train), vocab_size, model_type, joint, sample)
        log(f"tokenizer: {tokenizers!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        manifest: dict = {"format": FORMAT, "version": VERSION, "task": "translate",
                          "filters": {"max_len": filters.max_len, "max_ratio": filters.max_ratio,
                                      "drop_identical": filters.drop_identical},
                          "tokenizer": {"files": tokenizers.files(), "joint": tokenizers.joint,
                                        "src_vocab_size": tokenizers.src.vocab_size,
                                        "tgt_vocab_size": tokenizers.tgt.vocab_size,
                                        "dtype": str(token_dtype(max(tokenizers.src.vocab_size,
                                                                     tokenizers.tgt.vocab_size)))},
                          "splits": {}}
        for name, a, b in splits:
            counts = _write_split(tmp, name, a, b, tokenizers, filters, name == "train", split_workers[name],
                                  chunk_lines)
            log(counts.summary(f"{name} ({a} / {b})"))
            if counts.pairs == 0:
                raise QkvError(f"{a} / {b}: no pairs left after the filters ({counts.summary(name)})")
            manifest["splits"][name] = {"source": [str(a), str(b)], "lines": counts.lines, "pairs": counts.pairs,
                                        "tokens": counts.tokens, "max_length": counts.max_length,
                                        "skipped": counts.skipped, "skipped_lines": counts.skipped_lines}
        tokenizers.save(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        manifest["files"] = _file_entries(tmp, names, min(workers, available_cores()))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()  # an empty directory given as the output
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}")
    return manifest


def is_corpus(path: str | Path) -> bool:
    """True for a directory written by :func:`preprocess` (its manifest says so)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def tokenizer_of(path: str | Path) -> TokenizerPair:
    """A tokenizer to reuse: a preprocessed directory, a checkpoint or tokenizer directory, a .model."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        try:
            manifest = json.loads((p / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            manifest = {}
        files = manifest.get("tokenizer", {}).get("files") if manifest.get("format") == FORMAT else None
        if files is None and isinstance(manifest.get("files"), dict):  # a checkpoint: only the files it lists
            files = list(manifest["files"])
        return TokenizerPair.load(p, files)
    return TokenizerPair.from_path(p)


# --- reading a preprocessed directory --------------------------------------------------------------------


@dataclass
class BinarizedCorpus:
    """A directory :func:`preprocess` wrote, opened: its manifest, tokenizers and (mapped) splits."""

    path: Path
    manifest: dict

    @property
    def fingerprint(self) -> str:
        """A digest of the files' checksums: what a run records, and ``--resume`` compares."""
        files = json.dumps(self.manifest["files"], sort_keys=True).encode()
        return hashlib.sha256(files).hexdigest()[:32]

    def has(self, split: str) -> bool:
        return split in self.manifest.get("splits", {})

    def pairs(self, split: str) -> int:
        return int(self.manifest["splits"][split]["pairs"])

    def tokenizers(self) -> TokenizerPair:
        return TokenizerPair.load(self.path, self.manifest["tokenizer"]["files"])

    def side(self, split: str, side: str) -> TokenArray:
        return TokenArray.load(self.path, f"{split}.{side}")

    def length_index(self, split: str) -> LengthIndex:
        """The split's :class:`~qkv.data.buckets.LengthIndex`, its order read from ``SPLIT.index.npy``
        with ``pread``; a directory of format version 1 has none, and gets one built in memory from
        its lengths arrays (4 bytes a pair; ``qkv preprocess`` again writes it)."""
        order_path, table_path = self.path / f"{split}.index.npy", self.path / f"{split}.buckets.npy"
        if f"{split}.index.npy" not in self.manifest["files"]:
            return LengthIndex.build(*(np.load(self.path / f"{split}.{s}.lengths.npy", mmap_mode="r") for s in SIDES))
        try:
            order = np.load(order_path, mmap_mode="r")
            table = np.load(table_path)
        except (OSError, ValueError) as e:
            raise CorpusError(f"{order_path}: cannot read the length index: {e}") from None
        if table.ndim != 2 or table.shape[1] != 3 or not int(table[:, 2].sum()) == len(order) == self.pairs(split):
            raise CorpusError(f"{table_path}: a bucket table of shape {table.shape} does not describe the "
                              f"{len(order)} pairs of {order_path} (run qkv preprocess again)")
        _advise_random(order)
        file = (open(order_path, "rb", buffering=0), int(order.offset)) if hasattr(os, "pread") else None
        return LengthIndex(order, table[:, 0], table[:, 1], table[:, 2], file=file)

    def texts(self, split: str) -> tuple[list[str], list[str]]:
        """The kept text of a validation split (for its BLEU)."""
        from qkv.data.corpus import read_lines

        return read_lines(self.path / f"{split}.src.txt"), read_lines(self.path / f"{split}.tgt.txt")

    def verify(self, checksums: bool = True) -> None:
        """Every file the manifest lists is there with its size (and, with ``checksums``, its sha256)."""
        for name, entry in self.manifest["files"].items():
            p = self.path / name
            if not p.is_file():
                raise CorpusError(f"{p}: listed in {self.path / MANIFEST} but missing (run qkv preprocess again)")
            if p.stat().st_size != entry["size"]:
                raise CorpusError(f"{p}: {p.stat().st_size} bytes, the manifest says {entry['size']}: the file "
                                  "changed after qkv preprocess wrote it (run qkv preprocess again)")
        if checksums:
            names = list(self.manifest["files"])
            with ThreadPoolExecutor(2) as pool:
                digests = list(pool.map(lambda n: sha256_file(self.path / n), names))
            for name, digest in zip(names, digests):
                if digest != self.manifest["files"][name]["sha256"]:
                    raise CorpusError(f"{self.path / name}: sha256 checksum mismatch (manifest "
                                      f"{self.manifest['files'][name]['sha256'][:12]}..., file {digest[:12]}...): "
                                      "the file changed after qkv preprocess wrote it (run qkv preprocess again)")


def open_corpus(path: str | Path, checksums: bool = True) -> BinarizedCorpus:
    """Open a directory written by :func:`preprocess`: read its manifest and check its files."""
    p = Path(path)
    if not p.is_dir():
        raise CorpusError(f"{p}: no such directory (make it with qkv preprocess)")
    try:
        manifest = json.loads((p / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorpusError(f"{p}: no {MANIFEST}: not a directory written by qkv preprocess") from None
    except (OSError, ValueError) as e:
        raise CorpusError(f"{p / MANIFEST}: unreadable: {e}") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CorpusError(f"{p / MANIFEST}: not a qkv preprocess manifest")
    if manifest.get("version", 0) > VERSION:
        raise CorpusError(f"{p}: written by a newer qkv (format version {manifest['version']}); update qkv")
    corpus = BinarizedCorpus(p, manifest)
    corpus.verify(checksums)
    return corpus


__all__ = ["TokenArray", "Filters", "preprocess", "open_corpus", "BinarizedCorpus", "tokenizer_of", "is_corpus",
           "write_length_index", "token_dtype", "MANIFEST"]
