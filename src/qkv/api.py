"""The Python API, kept under its first name: everything here lives in :mod:`qkv.frontends`."""

from qkv.frontends import (QUANTIZE_CHOICES, Int8TiedOutput, Translator, TruncationHandler, load,  # noqa: F401
                           load_ensemble, quantize_int8)

__all__ = ["Translator", "load", "load_ensemble", "quantize_int8", "Int8TiedOutput"]
