"""One small module per system measured by ``benchmarks/speed.py``.

Each module offers ``run(task, spec, threads) -> dict`` (``task``: train, greedy or beam) and is
imported only inside its own worker process. ``common`` imports nothing heavy; ``ct2`` never
imports torch (its worker asserts it).
"""
