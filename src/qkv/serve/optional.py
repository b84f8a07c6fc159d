"""The serving packages are optional (``pip install -c constraints.txt -e ".[serve]"``): imported
only by ``qkv.serve``, with an error that says how to install them."""

from __future__ import annotations

from types import ModuleType

from qkv.errors import require_package

INSTALL = 'pip install -c constraints.txt -e ".[serve]"'
PINNED = {"fastapi": "0.165.0", "uvicorn": "0.54.0", "httpx": "0.28.1", "fastapi_offline": "1.7.7"}  # what pyproject.toml's serve extra pins


def require(package: str) -> ModuleType:
    """Import ``package``, or a QkvError naming the install command."""
    return require_package(package, "qkv serve", PINNED, INSTALL)


__all__ = ["require", "INSTALL", "PINNED"]
