"""The teacher's attention inputs and outputs, captured as Flax NNX intermediates
(``nnx.capture`` with ``method_outputs``: every module method's output is sown while the
model runs, no module edited): a layer's input is its block's ``attention_norm`` output,
its output the attention layer's own (before the residual)."""

from __future__ import annotations

import jax
from flax import nnx

from linattn_jax.models import LanguageModel


def check_capturable(model: LanguageModel, layers: tuple[int, ...]) -> None:
    """Raises ``ValueError`` unless each of ``layers`` is a pre-norm block whose attention
    reads its ``attention_norm``'s output as it is (no post-norm, short convolution, input
    multiplier or parallel mixer)."""
    for i in layers:
        block = model.blocks[i]
        (in_1, _), _ = block.branch_multipliers
        if block.post_norm or block.conv is not None or in_1 != 1.0 or block.parallel is not None:
            raise ValueError(
                f"layer {i}: its attention does not read its attention_norm's output as it is "
                "(post_norm, short_conv, an input multiplier or a parallel mixer)"
            )


def attention_io(
    model: LanguageModel, tokens: jax.Array, layers: tuple[int, ...], key_mask=None
) -> tuple[jax.Array, dict[int, tuple[jax.Array, jax.Array]]]:
    """``(logits [b, t, vocab], {layer: (attention input, attention output)})``, each
    ``[b, t, width]``, of one forward pass over ``tokens [b, t]``. Under ``jit`` the
    intermediates not returned are dropped by the compiler."""
    check_capturable(model, layers)
    forward = nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)
    logits, sown = forward(tokens, key_mask=key_mask)
    blocks = sown["blocks"]
    # Sown values are tuples, one item per call.
    output = lambda i, module: blocks[i][module]["__call__"].get_value()[0]
    return logits, {i: (output(i, "attention_norm"), output(i, "attention")) for i in layers}
