"""The web application of ``qkv serve`` (FastAPI): the endpoints, their errors, the page.

    POST /translate  POST /score  POST /classify  POST /fill  POST /generate (stream: server-sent events)
    GET /models  GET /health  GET / (the page)  GET /openapi.json
    GET /docs (Swagger UI)  GET /redoc (ReDoc): their scripts served from here too, nothing fetched from outside

Every error is JSON ``{"error": message}``: a 4xx status for what the request got wrong (a malformed
or oversized body, a wrong type, a bound passed, a model that does not serve the endpoint); 5xx for
what the server could not do: a model failing on one request (500 for that request only), a full
queue or an engine whose worker ended or did not answer (503 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import re
import threading
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from qkv import __version__
from qkv.errors import QkvError, Unavailable
from qkv.serve.batcher import Busy
from qkv.serve.hosts import answered, host_allowed
from qkv.serve.limits import Limits
from qkv.serve.optional import INSTALL
from qkv.serve.schemas import (ClassifyRequest, EmbedRequest, FillRequest, GenerateRequest, ScoreRequest,
                               TranslateRequest)
from qkv.serve.service import ENDPOINTS, RequestError, Served


def error(status: int, message: str, **extra) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def closing(response: JSONResponse) -> JSONResponse:
    """``response`` with ``Connection: close``: the server closes the connection once it is sent (the
    rest of a body it refused unread is not waited for)."""
    response.headers["Connection"] = "close"
    return response


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413. Where its Content-Length says so, the
    answer comes at once if the body would be over ``DRAIN`` × ``max_bytes`` (nothing of it is read),
    else once the body has come, read and dropped: a server that answers and closes while the client
    is still sending makes the client's system reset the connection, and the client never reads the
    answer. A body without a length gets 413 once ``max_bytes`` have come (read on a little, for the
    same reason). A body not whole ``timeout`` seconds after the request's head gets 408 (a client
    that stalls cannot hold the connection); all three close the connection. A body that is not UTF-8
    gets 400; others reach the app whole."""

    DRAIN = 64  # a refused body up to this many times max_bytes is read (and dropped) before the answer

    def __init__(self, app, max_bytes: int, timeout: float = 30.0):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        if declared.isdigit() and int(declared) > self.max_bytes:
            too_big = closing(error(413, f"the request body is {int(declared):,} bytes (its Content-Length); this "
                                         f"server takes at most {self.max_bytes:,}"))
            more = int(declared) <= self.DRAIN * self.max_bytes
            while more:  # read and drop the body, so that the client is done sending when the answer comes
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
                except asyncio.TimeoutError:
                    break
                if message["type"] == "http.disconnect":
                    return
                more = message.get("more_body", False)
            return await too_big(scope, receive, send)
        body, size, more = bytearray(), 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                return await closing(error(408, f"the request body did not arrive within {self.timeout:g} s "
                                                f"({size:,} bytes came); send it whole, at once"))(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_bytes:
                body += chunk
            more = message.get("more_body", False)
            if size > self.DRAIN * self.max_bytes:  # enough read: answer and let the connection close
                break
        if size > self.max_bytes:
            return await error(413, f"the request body is {size:,}{'+' if more else ''} bytes; this server takes at "
                                    f"most {self.max_bytes:,}")(scope, receive, send)
        try:
            bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            return await error(400, f"the request body is not valid UTF-8 (byte {e.start})")(scope, receive, send)
        done = False

        async def replay():
            nonlocal done
            if not done:
                done = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class HostCheck:
    """ASGI middleware: a request whose ``Host`` header names neither this machine's loopback (localhost,
    127.x.x.x, [::1]) nor one of ``allowed`` (``*``: any) gets 400, so that a web page cannot reach the
    server through a name of its own that it points here (DNS rebinding). ``hint``: how to widen it,
    said in the refusal (none for a server that cannot be widened)."""

    def __init__(self, app, allowed: tuple[str, ...] = (), hint: str = "qkv serve --allowed-hosts adds names"):
        self.app, self.allowed, self.hint = app, tuple(allowed), hint

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        if host_allowed(host, self.allowed):
            return await self.app(scope, receive, send)
        what = f"the host name {host!r}" if host else "a request without a Host header"
        hint = f" ({self.hint})" if self.hint else ""
        return await error(400, f"this server does not answer {what}: it answers {answered(self.allowed)}{hint}"
                           )(scope, receive, send)


def validation_message(errors: list[dict]) -> str:
    parts = []
    for e in errors:
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
                         + (f" (at character {e['loc'][1]})" if len(e.get("loc", ())) > 1 else ""))
            continue
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "the body"
        parts.append(f"{where}: {e.get('msg')}")
    return "; ".join(parts)


DOCS_FILES = "/static/docs"  # where Swagger UI's and ReDoc's scripts are served


def docs_files() -> Path | None:
    """The folder of Swagger UI's and ReDoc's scripts and styles that the fastapi-offline package
    ships (the serve extra), or None where it is not installed."""
    try:
        folder = Path(str(resources.files("fastapi_offline") / "static"))
    except ModuleNotFoundError:
        return None
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


@functools.cache
def redoc_without_logo(folder: Path) -> str:
    """ReDoc's script, less the address of its maker's logo (an image on the maker's site, which it
    would fetch): with none, ReDoc shows no logo and fetches nothing."""
    return re.sub(r'src:"https?://[^"]*"', 'src:""', (folder / "redoc.standalone.js").read_text(encoding="utf-8"))


def add_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) for ``/openapi.json``, with their scripts, styles
    and icon served by this app from local files, so that both work where nothing outside can be
    reached. Without those files both answer 404 with a page that says how to install them."""
    folder = docs_files()
    if folder is None:
        missing = (f"<!doctype html><title>qkv: no API docs</title><p>The API docs pages need the fastapi-offline "
                   f"package, which is not installed: <code>{INSTALL}</code>. The OpenAPI description itself is "
                   f"at <a href=\"openapi.json\">/openapi.json</a>.</p>")

        @app.get("/docs", include_in_schema=False)
        @app.get("/redoc", include_in_schema=False)
        async def no_docs():
            return HTMLResponse(missing, status_code=404)
        return

    @app.get(f"{DOCS_FILES}/redoc.standalone.js", include_in_schema=False)
    async def redoc_script():
        return Response(redoc_without_logo(folder), media_type="text/javascript")

    app.mount(DOCS_FILES, StaticFiles(directory=folder), name="docs-files")

    def urls(request: Request) -> tuple[str, str]:
        root = request.scope.get("root_path", "").rstrip("/")  # behind a proxy that serves the app under a path
        return root + app.openapi_url, root + DOCS_FILES

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request):
        openapi, files = urls(request)
        return get_swagger_ui_html(openapi_url=openapi, title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{files}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{files}/swagger-ui.css",
                                   swagger_favicon_url=f"{files}/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})  # no badge from the validator's site

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        openapi, files = urls(request)
        page = get_redoc_html(openapi_url=openapi, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{files}/redoc.standalone.js", redoc_favicon_url=f"{files}/favicon.png",
                              with_google_fonts=False)
        page.headers["Content-Security-Policy"] = "img-src 'self' data:"  # should anything try: images from here only
        return page


def create_app(models: list[Served], limits: Limits, allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    """The application serving ``models`` (each with its batcher, started and stopped with the app), to
    requests for a loopback host name or one of ``allowed_hosts`` (``*``: any)."""
    by_name = {m.name: m for m in models}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        for m in models:
            m.batcher.start()
        yield
        for m in models:
            await m.batcher.stop()

    app = FastAPI(title="qkv", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Translation, scoring, classification and generation with qkv checkpoints. "
                              "Every error is JSON {\"error\": message}: 4xx for what a request got wrong, 5xx "
                              "for what the server could not do (503 with Retry-After: try again).")
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout)
    app.add_middleware(HostCheck, allowed=allowed_hosts)  # the outermost: checked first
    app.state.models, app.state.limits = by_name, limits
    add_docs(app)

    def pick(name: str | None, offer: str) -> Served:
        if name is not None:
            if name not in by_name:
                raise RequestError(404, f"no model named {name!r}; this server has: {', '.join(by_name)}")
            return by_name[name]
        able = [m for m in models if offer in m.frontend.offers]
        if len(models) == 1 or len(able) == 1:
            return able[0] if able else models[0]
        if not able:
            raise RequestError(422, f"no model here serves {ENDPOINTS[offer]} (GET /models)")
        raise RequestError(422, f"several models serve {ENDPOINTS[offer]}: give \"model\", one of "
                                f"{', '.join(m.name for m in able)}")

    @app.exception_handler(RequestError)
    async def refused(request, e: RequestError):
        return error(e.status, str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        errors = e.errors()
        status = 400 if any(x.get("type") == "json_invalid" for x in errors) else 422
        return error(status, validation_message(errors),
                     detail=[{"loc": list(x.get("loc", ())), "msg": x.get("msg"), "type": x.get("type")}
                             for x in errors])

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error(e.status_code, str(e.detail))

    @app.exception_handler(QkvError)
    async def model_refused(request, e: QkvError):
        return error(422, str(e))

    @app.exception_handler(Busy)
    async def busy(request, e: Busy):
        return JSONResponse({"error": str(e)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(Unavailable)
    async def unavailable(request, e: Unavailable):  # the engine failed (a worker ended or did not answer)
        return JSONResponse({"error": str(e)}, status_code=503,
                            headers={"Retry-After": str(max(math.ceil(e.retry_after), 1))})

    @app.exception_handler(Exception)
    async def failed(request, e: Exception):
        return error(500, f"the model failed on this request: {type(e).__name__}: {e}")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return HTMLResponse(resources.files("qkv.serve").joinpath("page.html").read_text(encoding="utf-8"))

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():
        return Response(status_code=204)

    @app.get("/health", summary="can every model answer (503 while one cannot): each model's state and batching "
                                "so far; ?model=NAME: that model's alone")
    async def health(model: str | None = None):
        if model is not None and model not in by_name:
            raise RequestError(404, f"no model named {model!r}; this server has: {', '.join(by_name)}")
        chosen = [by_name[model]] if model is not None else models
        states = {m.name: m.health() for m in chosen}
        ready = all(s["state"] == "ready" for s in states.values())
        waits = [s.get("retry_after", 1) for s in states.values() if s["state"] != "ready"]
        return JSONResponse({"status": "ok" if ready else "failing", "models": len(chosen), "states": states,
                             "batching": {m.name: m.batcher.stats.as_dict() for m in chosen}},
                            status_code=200 if ready else 503,
                            headers={} if ready else {"Retry-After": str(max(min(waits), 1))})

    @app.get("/models", summary="the models served: name, task, endpoints, what they offer")
    async def list_models():
        return {"models": [m.describe() for m in models], "limits": limits.__dict__}

    @app.post("/translate", summary="translate texts: n-best hypotheses, scores, token log-probabilities, "
                                    "alignments, cross-attention")
    async def translate(req: TranslateRequest):
        return await pick(req.model, "translate").translate(req.texts, req.beam_size, req.n_best, req.target_prefix,
                                                            req.alignments, req.attention)

    @app.post("/score", summary="log-probabilities of given translations, per sentence and per token")
    async def score(req: ScoreRequest):
        if len(req.sources) != len(req.targets):
            raise RequestError(422, f"{len(req.sources)} sources but {len(req.targets)} targets")
        return await pick(req.model, "score").score(list(zip(req.sources, req.targets)))

    @app.post("/classify", summary="the label of each text and the probability of every label")
    async def classify(req: ClassifyRequest):
        return await pick(req.model, "classify").classify(req.texts)

    @app.post("/embed", summary="sentence embeddings of texts (encoder models: mean or <cls> pooling)")
    async def embed(req: EmbedRequest):
        return await pick(req.model, "embed").embed(req.texts, req.pooling)

    @app.post("/fill", summary="the most probable pieces for each [MASK] (masked language models)")
    async def fill(req: FillRequest):
        return await pick(req.model, "fill").fill(req.texts, req.k)

    @app.post("/generate", summary="continue a text with a language model (stream: server-sent events)")
    async def generate(req: GenerateRequest):
        model = pick(req.model, "generate")
        model.check_generate(req.prefix, req.max_new_tokens)
        args = (req.prefix, req.max_new_tokens, req.temperature, req.top_k, req.top_p, req.seed)
        if not req.stream:
            text = await model.batcher.call(lambda: "".join(model.generation(*args, threading.Event())))
            return {"model": model.name, "prefix": req.prefix, "text": text}
        model.batcher.check_room()  # a 503 now, not an error event inside the stream
        return StreamingResponse(stream_generation(model, args), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def stream_generation(model: Served, args: tuple):
    """Server-sent events: ``data: {"text": piece}`` as pieces come from the worker thread, then
    ``event: done`` (or ``event: error`` with the message)."""
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    end = object()

    def produce():
        try:
            for piece in model.generation(*args, stop):
                loop.call_soon_threadsafe(pieces.put_nowait, piece)
        except Exception as e:  # noqa: BLE001 - sent to the client as an error event
            loop.call_soon_threadsafe(pieces.put_nowait, e)
        finally:
            loop.call_soon_threadsafe(pieces.put_nowait, end)

    job = asyncio.ensure_future(model.batcher.call(produce))
    # a call refused or cancelled before produce() ran would otherwise leave the stream waiting
    job.add_done_callback(lambda j: pieces.put_nowait(j.exception() if not j.cancelled() and j.exception()
                                                      else end))
    failed = False
    try:
        while (piece := await pieces.get()) is not end:
            if isinstance(piece, Exception):
                failed = True
                yield f"event: error\ndata: {json.dumps({'error': f'{type(piece).__name__}: {piece}'})}\n\n"
                break
            yield f"data: {json.dumps({'text': piece}, ensure_ascii=False)}\n\n"
        if not failed:
            yield "event: done\ndata: {}\n\n"
    finally:
        stop.set()  # the client went away: the worker stops at its next piece
        job.add_done_callback(lambda j: j.cancelled() or j.exception())  # nothing left unretrieved


__all__ = ["create_app", "BodyLimit", "HostCheck", "add_docs", "docs_files"]
