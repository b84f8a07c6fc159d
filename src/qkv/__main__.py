"""The ``qkv`` command: ``python -m qkv``, ``torchrun -m qkv`` and the installed ``qkv`` script.

Ctrl-C and SIGTERM are taken in hand before anything else is imported (:mod:`qkv.startup`), so that a
signal at any moment, during the imports of torch included, ends the command with status 130 and no
traceback; once the command is done, both are ignored while the interpreter shuts down.
"""

import sys


def main() -> int:
    from qkv import startup  # the standard library only: in place within milliseconds

    startup.install()
    try:
        from qkv.cli import main as run

        status = run()
    except BaseException as e:  # before the command's own handling began (imports, parsing) or after it ended
        if not (isinstance(e, KeyboardInterrupt) or startup.interrupted()):
            startup.finish()
            raise
        status = startup.report_interrupted()
    startup.finish()
    return status


if __name__ == "__main__":
    sys.exit(main())
