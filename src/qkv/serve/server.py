"""Running the application: ``qkv serve`` in the foreground, or a server in a thread (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from qkv.errors import QkvError
from qkv.serve import hosts
from qkv.serve.limits import Limits
from qkv.serve.optional import require


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), or a QkvError saying why not."""
    if not 0 <= port <= 65535:
        raise QkvError(f"--port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise QkvError(f"--host {host}: not an address this machine can listen on ({e})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "is in use (another server is listening there)" if e.errno == 98 else f"cannot be used: {e.strerror}"
        raise QkvError(f"{host}:{port} {why}; choose another --port") from None
    sock.set_inheritable(True)
    return sock


def header_deadline(seconds: float) -> type:
    """uvicorn's HTTP protocol with a deadline for a request's headers, which uvicorn lacks: a client
    that has not sent a whole request head ``seconds`` after it connected (or after the first byte of
    its next request) is disconnected, so slow or stalled clients cannot hold connections open. The
    body and the answer are not timed; uvicorn's keep-alive timeout covers the wait between requests."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadline(AutoHTTPProtocol):
        deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self.deadline = self.loop.call_later(seconds, self.too_slow)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self.deadline is None and (cycle is None or cycle.response_complete):  # a next request begins
                self.deadline = self.loop.call_later(seconds, self.too_slow)
            super().data_received(data)
            if self.cycle is not cycle:  # its head is complete: the request is the app's now
                self.end_deadline()

        def connection_lost(self, exc) -> None:
            self.end_deadline()
            super().connection_lost(exc)

        def end_deadline(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def too_slow(self) -> None:
            self.deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def config(app, log_level: str = "warning"):
    """uvicorn's settings for ``app`` (made by ``create_app``), with the timeouts of its limits."""
    uvicorn = require("uvicorn")
    limits: Limits = app.state.limits
    # keep-alive 30 s by default, not uvicorn's 5: under load the loop may take seconds to read a request
    # that is already sent, and a connection closed as idle then loses it
    return uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                          timeout_keep_alive=limits.keep_alive_timeout, http=header_deadline(limits.header_timeout))


def serve(paths: list[str], host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
          device: str = "cpu", threads: int = 0, log: Callable[[str], None] = print,
          allowed_hosts: list[str] = (), engine: str = "qkv", quantize: str | None = None,
          decode: dict | None = None, compile: bool = False, engine_timeout: float | None = None) -> None:
    """Load the checkpoints ``paths`` and serve them on ``host:port`` until interrupted, answering the
    loopback host names and ``allowed_hosts`` (``--allowed-hosts``; without it, any name when ``host``
    is not a loopback address). ``engine``: what decodes (qkv, or ctranslate2 for translation
    Transformers, with ``threads`` intra-op threads); ``decode``: DecodeConfig fields that replace
    each translation model's saved settings; ``compile``: translation Transformers search with their
    step compiled (:mod:`qkv.decoding.compiled`), any other model is refused by name; ``engine_timeout``:
    the seconds a CTranslate2 worker's call may go unanswered before the worker is replaced."""
    require("fastapi")
    uvicorn = require("uvicorn")
    import torch

    from qkv.serve.app import create_app
    from qkv.serve.service import load_models

    limits = (limits or Limits()).validate()
    names = hosts.allowed_hosts(host, allowed_hosts)
    if threads and engine == "qkv":
        torch.set_num_threads(threads)
    models = load_models(paths, limits, device, engine=engine, quantize=quantize, threads=threads, decode=decode,
                         log=log, compile=compile, engine_timeout=engine_timeout)
    sock = bind(host, port)
    app = create_app(models, limits, names)
    where = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    for m in models:
        log(f"{m.name}: {m.path} ({m.task}; {', '.join(m.endpoints)}; engine {m.frontend.engine})")
    if not hosts.is_loopback_host(host):
        log(f"warning: --host {host} lets other machines connect, and qkv serve has no authentication: anyone "
            f"who reaches {where} can use the models; put it behind a proxy that authenticates")
    if hosts.ANY not in names:
        log(f"answering requests for the host names {hosts.answered(names)} only (--allowed-hosts adds names)")
    log(f"serving {len(models)} model(s) on {where}/ (the page), {where}/docs (the API); Ctrl-C stops")
    uvicorn.Server(config(app, "info")).run(sockets=[sock])


class BackgroundServer:
    """The application on a free loopback port in a thread: ``with BackgroundServer(app) as s: s.url``.
    Leaving the block stops it (and its batchers)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        uvicorn = require("uvicorn")
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(config(app))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30) -> "BackgroundServer":
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["serve", "bind", "BackgroundServer"]
