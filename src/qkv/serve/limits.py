"""What one request may ask of ``qkv serve``, how requests are gathered into batches, and how long
a connection may keep the server waiting.

Each field is a ``qkv serve`` flag (``max_texts`` -> ``--max-texts``) with its help as metadata;
a request past a bound is refused with a 4xx status and a message naming the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from qkv.bounds import Bound
from qkv.errors import ConfigError


def bound(default, help: str, low: float = 1, high: float = 10**9):
    return field(default=default, metadata={"help": help, "low": low, "high": high})


@dataclass(frozen=True)
class Limits:
    """The bounds of ``qkv serve`` (refused requests get 413 or 422) and its batching."""

    max_texts: int = bound(64, "texts (or pairs) in one request", high=100_000)
    max_chars: int = bound(2000, "characters in one text", high=10**7)
    max_tokens: int = bound(256, "tokens in one text (and the model's own limit, where its positions end)",
                            high=10**6)
    max_beam: int = bound(16, "beam_size of one request", high=1024)
    max_nbest: int = bound(8, "n_best of one request (at most its beam_size too)", high=1024)
    max_new_tokens: int = bound(512, "tokens one /generate request may ask for", high=10**6)
    max_attention: int = bound(16, "hypotheses (texts × n_best) one request may ask the attention weights of "
                                    "(each is layers × heads × target × source numbers)", high=100_000)
    max_body_bytes: int = bound(1_000_000, "bytes in one request body (larger: 413)", low=64, high=10**9)
    max_queue: int = bound(4096, "requests waiting for a model at once (more: 503, try again)", high=10**7)
    batch_wait_ms: float = bound(5.0, "how long a batch waits for more requests after its first (ms)", low=0,
                                 high=10_000)
    max_batch_tokens: int = bound(4096, "source tokens per batch: requests are gathered up to this budget",
                                  high=10**7)
    header_timeout: float = bound(10.0, "seconds a client has to send a request's headers, from when it connects "
                                        "(or sends the first byte of its next request); later: the connection "
                                        "is closed", low=0.1, high=3600)
    keep_alive_timeout: float = bound(30.0, "seconds an idle connection is kept open after an answer, for the "
                                            "client's next request", low=0.1, high=3600)
    body_timeout: float = bound(30.0, "seconds a client has to send a request's whole body, from the end of its "
                                      "headers; later: 408 and the connection is closed", low=0.1, high=3600)

    def validate(self) -> "Limits":
        for f in fields(self):
            problem = Bound(float, f.metadata["low"], f.metadata["high"]).problem(getattr(self, f.name))
            if problem:
                raise ConfigError(f"--{f.name.replace('_', '-')} {problem}")
        return self


__all__ = ["Limits"]
