"""Moved to :mod:`qkv.checkpoint` (inference reads checkpoints without the training package); this name
is the same module, kept so that code written against it still imports."""

import sys

from qkv import checkpoint as _module

sys.modules[__name__] = _module
