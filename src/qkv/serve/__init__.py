"""``qkv serve``: checkpoints behind an HTTP API and a web page, with dynamic batching.

    qkv serve runs/default/best --port 8000
    curl -s localhost:8000/translate -H 'content-type: application/json' \\
         -d '{"texts": ["three hundred twenty-one"], "n_best": 2}'

=========================  ======================================================================
part                       what it holds
=========================  ======================================================================
``limits.Limits``          the bounds of one request and the batching settings (the CLI's flags)
``batcher.Batcher``        concurrent requests to one model gathered into batches on one thread
``service.Served``         one model: its checks, its requests, the batch it runs
``schemas``                the request bodies (pydantic)
``app.create_app``         the FastAPI application: endpoints, errors, the page (``page.html``)
``server``                 ``serve`` (the command) and ``BackgroundServer`` (a server in a thread)
=========================  ======================================================================

FastAPI and uvicorn are optional (``pip install -c constraints.txt -e ".[serve]"``): this module
imports without them, and ``serve`` says how to install them.
"""

from qkv.serve.limits import Limits
from qkv.serve.optional import INSTALL, require
from qkv.serve.server import BackgroundServer, bind, serve

__all__ = ["Limits", "serve", "BackgroundServer", "bind", "require", "INSTALL"]
