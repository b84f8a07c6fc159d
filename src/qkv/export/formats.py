"""What ``qkv export`` writes: its formats and CTranslate2's weight quantizations (names only, so that the
converters and the command line read them without importing one another)."""

FORMATS = ("ctranslate2", "hf")
QUANTIZATIONS = ("int8", "int8_float32", "float16")

__all__ = ["FORMATS", "QUANTIZATIONS"]
