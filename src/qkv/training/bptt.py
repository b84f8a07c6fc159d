"""Moved to :mod:`qkv.bptt` (inference reads checkpoints without the training package); this name
is the same module, kept so that code written against it still imports."""

import sys

from qkv import bptt as _module

sys.modules[__name__] = _module
