"""Decoding: greedy search and beam search over the incremental model interface.

A model offers ``start(src) -> state`` and ``step(tokens, state) -> (logits, state)``, and
the state offers ``reorder(indices)``; both decoders work for any such model. A state may also
offer ``expand_beams(k)`` (``k`` rows per sentence that share its source side, kept once per
sentence); beam search uses it when present, else ``k`` copies of each row by ``reorder``.

A model also states its limits: ``max_source_len()``, the longest source row ``start`` reads, and
``max_steps(src_lengths)``, how many ``step`` calls a state takes (None: no limit; learned
positions end at ``max_positions``). :func:`max_output_len` caps every budget at
``MAX_OUTPUT_LEN`` and, given ``limit``, at what the model can take; the front-ends
(:class:`qkv.frontends.Translator`, the language model) pass it.

No decoder emits a special token: every one takes ``banned``, the ids whose logits it sets to
-inf before it chooses (:func:`banned_ids` of the output tokenizer: PAD, UNK, BOS and, where the
tokenizer has them, ``<cls>``, ``[MASK]``, ``<sep>``); EOS only ends an output.
"""

from qkv.decoding.beam_search import Hypothesis, beam_search, length_penalty
from qkv.decoding.greedy import MAX_OUTPUT_LEN, NEVER_EMITTED, banned_ids, greedy, max_output_len

__all__ = ["greedy", "beam_search", "Hypothesis", "length_penalty", "max_output_len", "MAX_OUTPUT_LEN",
           "banned_ids", "NEVER_EMITTED"]
