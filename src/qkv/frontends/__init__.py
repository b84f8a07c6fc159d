"""Front-ends: a trained model with its tokenizers, as users call it. ``qkv.load(path)`` opens a
checkpoint as the front-end its task names (``Task.frontend``; :func:`load`):

======================  =====================  ======================================================
front-end               tasks                  methods
======================  =====================  ======================================================
:class:`Translator`     translate, prefix_lm   ``translate``, ``translate_nbest``, ``translate_scored``,
                                               ``translate_rich``, ``translate_lines``, ``score``,
                                               ``cross_attention``, ``alignment``
:class:`Encoder`        classify, mlm          ``classify``, ``probabilities``, ``classify_lines``,
                                               ``evaluate``, ``fill``, ``embed``, ``search``
:class:`LanguageModel`  lm                     ``generate`` (streaming), ``score`` (perplexity, bits/char)
======================  =====================  ======================================================

They share :class:`Frontend` (model, tokenizers, device, eval mode, what the model offers).
Front-ends sit above the tasks (they may use a task's data code; no task imports them) and never
import ``qkv.training``.
"""

from qkv.frontends.base import Frontend, TruncationHandler
from qkv.frontends.encoder import Encoder
from qkv.frontends.language_model import LanguageModel, Perplexity
from qkv.frontends.loading import (FRONTENDS, check_serves, checkpoint_task, frontend_for, load, load_ensemble,
                                  open_model)
from qkv.frontends.quantize import QUANTIZE_CHOICES, Int8TiedOutput, quantize_int8
from qkv.frontends.translator import Translator

__all__ = ["Frontend", "TruncationHandler", "Translator", "Encoder", "LanguageModel", "Perplexity", "load",
           "load_ensemble", "open_model", "check_serves", "checkpoint_task", "frontend_for", "FRONTENDS", "quantize_int8", "Int8TiedOutput", "QUANTIZE_CHOICES"]
