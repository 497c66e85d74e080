"""The models floor: complete models over ``linattn_jax.layers``, and sampling.

``LanguageModel`` (causal; ``generate``), ``SequenceClassifier`` (non-causal encoder),
``stack`` (their blocks: a layout of kinds, unrolled or scanned), ``options`` (what a
model was built from, recorded on it: ``model.options``),
and ``sampling`` (``generate``, the public ``decode_loop``, ``sample_logits``).
"""

from linattn_jax.models import options, sampling, stack
from linattn_jax.models.classifier import SequenceClassifier
from linattn_jax.models.language_model import LanguageModel
from linattn_jax.models.sampling import decode_loop, generate, sample_logits

__all__ = [
    "LanguageModel",
    "SequenceClassifier",
    "decode_loop",
    "generate",
    "options",
    "sample_logits",
    "sampling",
    "stack",
]
