"""The export formats' packages are optional (``pip install -c constraints.txt -e ".[export]"``):
imported only when an export needs them, with an error that says how to install them."""

from __future__ import annotations

from types import ModuleType

from qkv.errors import require_package

INSTALL = 'pip install -c constraints.txt -e ".[export]"'
PINNED = {"ctranslate2": "4.8.5", "transformers": "5.23.0"}  # what pyproject.toml's export extra pins


def require(package: str, what: str) -> ModuleType:
    """Import ``package`` (needed by ``what``, e.g. "--format hf"), or a QkvError naming the install command."""
    return require_package(package, what, PINNED, INSTALL)


__all__ = ["require", "INSTALL", "PINNED"]
