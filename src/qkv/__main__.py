"""``python -m qkv`` (and ``torchrun -m qkv``) runs the CLI."""

import sys

from qkv.cli import main

sys.exit(main())
