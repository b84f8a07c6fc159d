"""The encoder front-end, kept under its first name: it lives in :mod:`qkv.frontends.encoder`."""

from qkv.frontends.encoder import Encoder, TruncationHandler  # noqa: F401

__all__ = ["Encoder"]
