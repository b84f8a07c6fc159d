"""The web application of ``qkv lab`` (FastAPI): the page, and the API it calls.

    GET  /                          the page (page.html, with the concept panels inlined at <!-- PANELS -->)
    GET  /api/lab                   the tasks, the architecture presets, the fields set by hand, their legal
                                    values (choices) and bounds
    GET  /api/runs                  every run: its settings and status
    POST /api/runs                  start a run: {"name", "task", "preset", "model": {...}, "train": {...}}
    POST /api/runs/NAME/stop        stop it (SIGTERM: last/ is committed, then the process exits)
    DELETE /api/runs/NAME           delete its directory (409 while it trains: stop it first)
    GET  /api/runs/NAME/metrics     its metrics.jsonl records from ?since=N on, and the next N
    POST /api/runs/NAME/inside      {"text"}: the newest checkpoint's step, output, attention, hidden-state norms
    POST /api/runs/NAME/steps       one attention computation step by step (qkv.lab.lecture), and /gates, /gradients
                                    (/inside, /steps, /gates, /gradients: one at a time per run, at most
                                    --run-queue at once per run, 429 with Retry-After beyond)
    GET  /api/panels/...            the concept panels (qkv.lab.panels)

The Host-header check and the body bound are ``qkv serve``'s; every error is JSON ``{"error": message}``
(a fault of the lab's own too: 500).
"""

from __future__ import annotations

import contextlib
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from qkv import __version__
from qkv.config import TrainConfig
from qkv.errors import QkvError
from qkv.lab import lecture
from qkv.lab.inside import Checkpoints
from qkv.lab.runs import (CHOICES, MAX_PARAMETERS, MODEL_FIELDS, PRESETS, SIZE_BOUNDS, SOLVED, TRAIN, TRAIN_FIELDS, Lab,
                          LabError)
from qkv.serve.app import BodyLimit, HostCheck, error, validation_message

MARKER = "<!-- PANELS -->"
PLOT = "<!-- PLOT -->"  # where page.html takes plot.js, the charts every figure of the page draws with


class StartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=40, description="the run's name: its directory under the lab's root")
    task: str = Field(description="a task of GET /api/lab")
    preset: str = Field("transformer", description="an architecture preset of GET /api/lab")
    model: dict[str, Any] = Field(default_factory=dict, description="ModelConfig fields over the preset's")
    train: dict[str, Any] = Field(default_factory=dict, description="TrainConfig fields over the preset's")
    threads: int | None = Field(None, ge=1, description="torch threads of the run (at most --run-threads)")
    stop_when_solved: bool = Field(True, description="stop the run at its first validation exact match >= 99%")


class InsideRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(description="the input to run through the run's newest checkpoint")


def default_panels() -> Path | None:
    """``panels.html`` beside this module, where it exists."""
    path = Path(str(resources.files("qkv.lab") / "panels.html"))
    return path if path.is_file() else None


def page_html(panels: Path | None) -> str:
    """page.html with the charts' script (plot.js) at ``PLOT`` and the panels' fragment at ``MARKER``."""
    files = resources.files("qkv.lab")
    page = files.joinpath("page.html").read_text(encoding="utf-8")
    fragment = panels.read_text(encoding="utf-8") if panels is not None and panels.is_file() else ""
    plot = files.joinpath("plot.js").read_text(encoding="utf-8")
    return page.replace(PLOT, f"<script>\n{plot}</script>").replace(MARKER, fragment)


def add_panels(app: FastAPI) -> None:
    """The concept panels' routes (:func:`qkv.lab.panels.register`)."""
    from qkv.lab import panels

    panels.register(app)


def create_app(lab: Lab, allowed_hosts: tuple[str, ...] = (), panels: Path | None | str = "default") -> FastAPI:
    """The lab's application over ``lab``; its runs are stopped when the application shuts down.
    ``panels``: the HTML fragment inlined at the page's marker (``"default"``: the package's own)."""
    limits = lab.limits
    fragment = default_panels() if panels == "default" else panels
    checkpoints = Checkpoints(queue=limits.run_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(lab.stop_all)

    app = FastAPI(title="qkv lab", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Train, watch and compare Transformers and RNNs. Every error is JSON "
                              "{\"error\": message} with a 4xx status.")
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout)
    app.add_middleware(HostCheck, allowed=allowed_hosts, hint="")  # the outermost: checked first; loopback only
    app.state.limits, app.state.lab = limits, lab

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        errors = e.errors()
        return error(400 if any(x.get("type") == "json_invalid" for x in errors) else 422, validation_message(errors))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error(e.status_code, str(e.detail))

    @app.exception_handler(QkvError)
    async def refused(request, e: QkvError):
        response = error(getattr(e, "status", 422), str(e))
        if getattr(e, "retry_after", None):
            response.headers["Retry-After"] = str(e.retry_after)
        return response

    @app.exception_handler(Exception)
    async def broken(request, e: Exception):  # a fault of the lab's own: JSON too, never a plain-text page
        return error(500, f"the lab failed: {type(e).__name__}: {e}")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return HTMLResponse(page_html(fragment))

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():
        return Response(status_code=204)

    @app.get("/api/lab", summary="the tasks, presets, fields set by hand and bounds")
    async def about():
        return {"tasks": [t.describe() for t in lab.tasks.values()],
                "presets": {name: {"model": m, "train": {**TRAIN, **t}} for name, (m, t) in PRESETS.items()},
                "model_fields": MODEL_FIELDS, "train_fields": TRAIN_FIELDS, "choices": CHOICES,
                "bounds": {name: {"low": b.low, "high": b.high, "text": b.text()} for name, b in SIZE_BOUNDS.items()},
                "max_parameters": MAX_PARAMETERS, "solved": SOLVED,
                "train_defaults": {**{f: getattr(TrainConfig(), f) for f in TRAIN_FIELDS}, "max_time": limits.max_time},
                "limits": {"max_runs": limits.max_runs, "run_threads": limits.run_threads,
                           "max_time": limits.max_time, "max_chars": limits.max_chars,
                           "run_queue": limits.run_queue},
                "root": str(lab.root)}

    @app.get("/api/runs", summary="every run: its settings and status")
    async def runs():
        return {"runs": [lab.describe(n) for n in lab.names()], "training": len(lab.running())}

    @app.post("/api/runs", status_code=201, summary="start a run (qkv train in a child process)")
    async def start(req: StartRequest):
        return await run_in_threadpool(lab.start, req.name, req.task, req.preset, req.model, req.train, req.threads,
                                       req.stop_when_solved)

    @app.post("/api/runs/{name}/stop", summary="stop a run: it saves last/ and exits")
    async def stop(name: str):
        return lab.stop(name)

    @app.delete("/api/runs/{name}", summary="delete a run's directory (refused while it trains: stop it first)")
    async def delete(name: str):
        run_dir = lab.run_dir(name)
        out = await run_in_threadpool(lab.delete, name)
        checkpoints.forget(run_dir)
        return out

    @app.get("/api/runs/{name}/metrics", summary="the run's metrics.jsonl records from ?since=N on")
    async def metrics(name: str, since: int = 0):
        if since < 0:
            raise LabError(422, f"since must be >= 0, got {since}")
        status = lab.status(name)  # before reading: a run that has ended has written all it will
        return {**lab.metrics(name, since), "status": status}

    @app.post("/api/runs/{name}/inside", summary="the newest checkpoint's output, attention and hidden norms")
    async def inside(name: str, req: InsideRequest):
        run_dir = lab.run_dir(name)
        if len(req.text) > limits.max_chars:
            raise LabError(413, f"the text has {len(req.text)} characters; this lab takes at most {limits.max_chars}")
        step = await run_in_threadpool(lab.checkpoint_step, name)  # last/'s update, as the look starts
        return {"run": name, "step": step, **await run_in_threadpool(checkpoints.look, run_dir, req.text)}

    add_panels(app)
    lecture.register(app, lab, checkpoints)  # /api/runs/NAME/steps, /gates, /gradients
    return app


__all__ = ["create_app", "page_html", "add_panels", "StartRequest", "InsideRequest", "MARKER", "PLOT"]
