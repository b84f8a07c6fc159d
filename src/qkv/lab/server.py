"""``qkv lab``: the lab's application on 127.0.0.1 until interrupted; every run it started stops with it."""

from __future__ import annotations

from collections.abc import Callable

from qkv.lab.runs import Lab, LabLimits, Task
from qkv.serve.optional import require
from qkv.serve.server import bind, config

HOST = "127.0.0.1"  # the lab starts processes for whoever reaches it: this machine only, never an option


def lab(root: str = "lab-runs", port: int = 8001, limits: LabLimits | None = None, files: Task | None = None,
        log: Callable[[str], None] = print) -> None:
    """Serve the lab of run directory ``root`` on 127.0.0.1:``port`` until interrupted (Ctrl-C), then stop
    its runs (each commits last/ first)."""
    require("fastapi")
    uvicorn = require("uvicorn")
    import torch

    from qkv.lab.app import create_app

    torch.set_num_threads(1)  # the page's requests; the runs have threads of their own
    laboratory = Lab(root, limits, files)
    laboratory.warm()  # runs start forked from a process with torch imported (qkv.lab.zygote)
    sock = bind(HOST, port)
    app = create_app(laboratory)
    where = f"http://{HOST}:{sock.getsockname()[1]}/"
    lim = laboratory.limits
    log(f"qkv lab on {where} (runs in {laboratory.root}/; at most {lim.max_runs} training at once, "
        f"{lim.run_threads} thread(s) and {lim.max_time:g} s each); Ctrl-C stops it and its runs")
    uvicorn.Server(config(app, "warning")).run(sockets=[sock])


__all__ = ["lab", "HOST"]
