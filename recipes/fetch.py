"""Download a recipe's public data set and check it by sha256: what every ``recipes/*/fetch.py`` uses.

A file is downloaded to ``NAME.part`` beside its place, its sha256 computed as it arrives, and renamed
to ``NAME`` only when the digest is the one pinned in the recipe's script; a wrong digest stops with an
error naming the file and both digests, and leaves nothing behind. A file already in place with the
right digest is not fetched again. ``--mirror URL`` fetches the same file names from another place (a
copy of the data on a local server, or ``file:///path/``); ``--out DIR`` chooses where they go, the
folder that the recipe's ``--data DIR`` then reads (default: ``data/NAME`` in the clone, see
:func:`data_dir`).

Every failure is one line on stderr, ``fetch: error: ...``, naming the file or the option: an HTTP
error, a URL that is not one, an ``--out`` that is a file, an archive that is truncated or not an
archive (removed: a file whose checksum is not pinned is kept only once what it unpacks to checks out),
a server too slow. Exit status 1 for a failed download or check, 2 for a bad option, 130 for Ctrl-C
or SIGTERM, which remove what was half-written. A download ends with an error when it passes
``--deadline`` seconds (all files together), when fewer than ``--min-rate`` bytes a second arrive over
``--rate-window`` seconds, or when nothing arrives for ``--timeout`` seconds: a server that sends a
byte every few seconds cannot hold a fetch for days.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"  # the clone's own data folder: where fetch.py writes without --out (ignored by git)
SHARED = ROOT.parent / "shared" / "data"  # where the project's machines keep their copies, read when present

DEADLINE_S = 6 * 3600.0  # the whole fetch: WMT 2014's 1.7 GB at 100 KB/s take under 5 hours
MIN_RATE = 1024.0  # bytes a second, on average over each RATE_WINDOW_S
RATE_WINDOW_S = 60.0
TIMEOUT_S = 60.0  # connecting, and any one read


def data_dir(name: str) -> Path:
    """Where the recipes read data set ``name`` from by default: ``data/NAME`` in the clone (where
    ``fetch.py`` writes it), or else ``../shared/data/NAME`` beside the clone where that is present
    (the project's machines); ``data/NAME`` when neither is there."""
    own = DATA / name
    if not own.exists() and (SHARED / name).is_dir():
        return SHARED / name
    return own


@dataclass(frozen=True)
class Source:
    """One file of a data set: its name on disk, the public URL it comes from, and its sha256 (None: an
    archive whose unpacked content the recipe checks instead)."""

    name: str
    url: str
    sha256: str | None


class FetchError(Exception):
    """A download that failed or did not match its checksum: the message names the file."""


class UsageError(FetchError):
    """A bad option (``--out``, ``--mirror``): exit status 2."""


@dataclass(frozen=True)
class Limits:
    """How long a fetch may take: ``deadline`` seconds for everything (from ``start``, a
    ``time.monotonic()``), at least ``min_rate`` bytes a second over each ``rate_window`` seconds, and
    ``timeout`` seconds at most for connecting or for any one read."""

    deadline: float = DEADLINE_S
    min_rate: float = MIN_RATE
    rate_window: float = RATE_WINDOW_S
    timeout: float = TIMEOUT_S
    start: float = 0.0

    def started(self) -> Limits:
        return Limits(self.deadline, self.min_rate, self.rate_window, self.timeout, time.monotonic())

    def left(self) -> float:
        return self.start + self.deadline - time.monotonic()


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_url(url: str, what: str) -> str:
    """``url`` if it is an http(s) URL with a host or a file: URL, else a UsageError naming ``what``."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError as e:
        raise UsageError(f"{what} {url!r}: not a URL ({e})") from None
    if parts.scheme in ("http", "https") and parts.hostname:
        return url
    if parts.scheme == "file" and parts.path:
        return url
    raise UsageError(f"{what} {url!r}: not a URL of the form http://HOST/..., https://HOST/... or file:///PATH")


def open_tar(path: Path):
    """``tarfile.open(path)``, or a FetchError naming the file if it is not a tar archive (plain,
    gzip, bzip2 or xz)."""
    import tarfile

    try:
        return tarfile.open(path)
    except (tarfile.TarError, EOFError, OSError):
        if path.is_file() and path.stat().st_size == 0:
            why = "an empty file"
        else:
            why = "not a readable tar archive (plain, gzip, bzip2 or xz): cut short, or not an archive at all"
        raise FetchError(f"{path.name}: {why}; removed, nothing was written") from None


def damaged(path: Path, e: BaseException) -> FetchError:
    """The error for a tar archive that ends early or is damaged inside, naming it."""
    detail = " ".join(str(e).split()) or type(e).__name__
    return FetchError(f"{path.name}: a truncated or damaged archive ({detail}); removed, nothing was written")


def _set_read_timeout(response, seconds: float) -> None:
    """The socket under an HTTP ``response`` waits at most ``seconds`` for its next bytes."""
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.settimeout(max(0.05, seconds))


@contextlib.contextmanager
def _alarm(limits: Limits):
    """In the main thread, a SIGALRM at the deadline interrupts whatever blocks (a name lookup, a
    connection, headers sent a byte at a time) with a FetchError; elsewhere the checks between reads
    and the socket's timeouts bound the wait."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def ring(signum, frame):
        raise FetchError(f"over the deadline of {limits.deadline:g} s (--deadline)")

    previous = signal.signal(signal.SIGALRM, ring)
    old_timer = signal.setitimer(signal.ITIMER_REAL, max(0.01, limits.left()))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_timer[0]:
            signal.setitimer(signal.ITIMER_REAL, *old_timer)


def _failure(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    if isinstance(e, TimeoutError) or type(e).__name__ == "timeout":
        return "no data arrived for the read timeout (--timeout)"
    if isinstance(e, http.client.IncompleteRead):
        return f"the connection closed after {len(e.partial):,} bytes, {e.expected:,} more were due"
    return str(e) or type(e).__name__


def download(url: str, dest: Path, sha256: str | None, timeout: float = TIMEOUT_S,
             limits: Limits | None = None) -> Path:
    """``url`` to ``dest``, checked: written as ``dest.part`` and renamed only if its sha256 is ``sha256``
    (None: not checked here). Bounded by ``limits`` (started now if it was not); any failure, Ctrl-C
    included, removes ``dest.part``."""
    if sha256 is not None and dest.is_file() and sha256_of(dest) == sha256:
        return dest
    limits = limits or Limits(timeout=timeout)
    if not limits.start:
        limits = limits.started()
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    received = 0
    try:
        with _alarm(limits):
            if limits.left() <= 0:
                raise FetchError(f"over the deadline of {limits.deadline:g} s (--deadline)")
            with urllib.request.urlopen(url, timeout=min(limits.timeout, max(0.05, limits.left()))) as response, \
                    open(part, "wb") as out:
                expected = response.headers.get("Content-Length") if hasattr(response, "headers") else None
                read = getattr(response, "read1", response.read)  # what has arrived, not a full megabyte
                window_start, window_bytes = time.monotonic(), 0
                while True:
                    _set_read_timeout(response, min(limits.timeout, limits.left()))
                    block = read(1 << 20)
                    now = time.monotonic()
                    if now - limits.start > limits.deadline:
                        raise FetchError(f"over the deadline of {limits.deadline:g} s (--deadline) after "
                                         f"{received:,} bytes")
                    if not block:
                        break
                    digest.update(block)
                    out.write(block)
                    received += len(block)
                    window_bytes += len(block)
                    if now - window_start >= limits.rate_window:
                        rate = window_bytes / (now - window_start)
                        if rate < limits.min_rate:
                            raise FetchError(f"{rate:.1f} bytes/s over the last {now - window_start:.0f} s, under "
                                             f"the minimum of {limits.min_rate:g} (--min-rate)")
                        window_start, window_bytes = now, 0
                if expected is not None and expected.isdigit() and received != int(expected):
                    raise FetchError(f"{received:,} bytes arrived, the server announced {int(expected):,}")
    except FetchError as e:
        part.unlink(missing_ok=True)
        raise FetchError(f"{dest.name}: cannot download {url}: {e}") from None
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError and HTTPError are OSErrors
        part.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is not None and str(e.filename) == str(part):
            raise FetchError(f"{part}: cannot write: {e.strerror}") from None
        raise FetchError(f"{dest.name}: cannot download {url}: {_failure(e)}") from None
    except BaseException:  # Ctrl-C, SIGTERM: nothing half-written stays
        part.unlink(missing_ok=True)
        raise
    if sha256 is not None and digest.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise FetchError(f"{dest.name}: sha256 {digest.hexdigest()} of {url} is not the pinned {sha256}; "
                         "nothing was written")
    os.replace(part, dest)
    return dest


def fetch(sources: list[Source], out: Path, mirror: str | None = None, log=print,
          limits: Limits | None = None) -> list[Path]:
    """Every source into ``out`` (from ``mirror`` + its name, where given), each checked by sha256,
    all within one ``limits`` (its deadline counts from here)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder")
    if mirror is not None:
        check_url(mirror, "--mirror")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot make the folder: {e.strerror or e}") from None
    limits = (limits or Limits()).started()
    written = []
    for s in sources:
        url = mirror.rstrip("/") + "/" + s.name if mirror else s.url
        log(f"{s.name}: {url}")
        written.append(download(url, out / s.name, s.sha256, limits=limits))
    return written


def _number(text: str, zero: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (0 <= value < float("inf")) or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be a positive number{' or 0' if zero else ''}, got {text}")
    return value


def _positive(text: str) -> float:
    return _number(text)


def _rate(text: str) -> float:
    return _number(text, zero=True)


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM stops the fetch as Ctrl-C does (in the main thread): the same clean-up, status 130."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(description: str, sources: list[Source], default_out: Path, after=None, argv: list[str] | None = None) -> int:
    """The command line of a recipe's fetch.py: ``--out DIR`` (default: ``default_out``), ``--mirror URL``,
    the limits (``--deadline``, ``--min-rate``, ``--rate-window``, ``--timeout``). ``after(out)`` runs once
    every file is in place and checked (e.g. to unpack an archive); if it fails, the files whose
    checksum is not pinned (archives checked by what they unpack to) are removed."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=default_out, help=f"where the files go (default: {default_out})")
    ap.add_argument("--mirror", help="fetch the same file names from this URL instead (e.g. file:///data/copy/)")
    ap.add_argument("--deadline", type=_positive, default=DEADLINE_S, metavar="SECONDS",
                    help="give up when the whole fetch takes longer (default: %(default)g)")
    ap.add_argument("--min-rate", type=_rate, default=MIN_RATE, metavar="BYTES_PER_S",
                    help="give up when fewer bytes a second arrive, on average over --rate-window "
                         "(default: %(default)g; 0: no minimum)")
    ap.add_argument("--rate-window", type=_positive, default=RATE_WINDOW_S, metavar="SECONDS",
                    help="the span --min-rate is averaged over (default: %(default)g)")
    ap.add_argument("--timeout", type=_positive, default=TIMEOUT_S, metavar="SECONDS",
                    help="give up when connecting, or waiting for any data, takes longer (default: %(default)g)")
    args = ap.parse_args(argv)
    limits = Limits(args.deadline, args.min_rate, args.rate_window, args.timeout)
    unpinned = [args.out / s.name for s in sources if s.sha256 is None]
    made = not args.out.exists()
    try:
        with _sigterm_as_interrupt():
            try:
                fetch(sources, args.out, args.mirror, limits=limits)
                if after is not None:
                    after(args.out)
            except BaseException as e:
                if not isinstance(e, UsageError):
                    for path in unpinned:  # checked by nothing else: never left to be read or trusted
                        path.unlink(missing_ok=True)
                    if made and args.out.is_dir() and not any(args.out.iterdir()):
                        args.out.rmdir()  # the folder this run made, empty
                raise
    except UsageError as e:
        print(f"fetch: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except FetchError as e:
        print(f"fetch: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except OSError as e:  # the output folder cannot be made or written
        where = f"{e.filename}: " if e.filename else ""
        print(f"fetch: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fetch: interrupted: nothing half-written was kept", file=sys.stderr)
        return 130
    print(f"done: {args.out}")
    return 0
