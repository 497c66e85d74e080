"""RWKV-4 checkpoints in Hugging Face format (``RwkvForCausalLM``, ``model_type`` ``rwkv``)
<-> ``LanguageModel``: the config's fields as the model's options, and the one table of
weights.

An RWKV model is the embedding, a LayerNorm on it (``pre_ln``, held by the first block),
``num_hidden_layers`` blocks of ``x + time_mix(LayerNorm(x))`` then ``x +
channel_mix(LayerNorm(x))``, and a final LayerNorm: our ``TransformerBlock(attention="rwkv",
mlp="rwkv", norm="layer")`` (``layers.RWKVTimeMix``, ``layers.RWKVChannelMix``) in a
``LanguageModel(norm="layer", embedding_norm=True)``. Its conventions, each mapped to ours:

* ``attention_hidden_size`` (``hidden_size`` when null) is the time mix's ``wkv_width``,
  ``intermediate_size`` (``4 hidden_size`` when null) the channel mix's hidden width; the
  WKV's channels are laid out as one head;
* ``time_decay`` and ``time_first`` ``[C]`` are ours as they are (``w = -exp(time_decay)``,
  ``linattn_jax.ops.wkv``); the token-shift mixes ``time_mix_*`` ``[1, 1, C]`` are our
  vectors ``[C]``; ``nn.Linear`` weights ``[out, in]`` our kernels ``[in, out]``;
* the blocks' and ``pre_ln``'s epsilon is ``layer_norm_epsilon``, the final ``ln_out``'s
  torch's default 1e-5;
* ``rescale_every`` N > 0: at inference ``transformers`` halves the residual stream after
  every N-th block and divides block i's ``attention.output`` and ``feed_forward.value``
  weights by ``2^(i // N)``. The stream is then ``2^-(i // N)`` times the unscaled one, which
  every LayerNorm undoes but for its epsilon: ours is the unscaled model with block i's
  epsilons times ``4^(i // N)`` and ``ln_out``'s times ``4^(L // N)``, the same function
  (the weights are read and written unscaled, as the files hold them).

The head ``head.weight`` is its own unless ``tie_word_embeddings``; the rest lives under
``rwkv.``. RWKV has no attention mask in ``transformers``; our padded tokens (``key_mask``)
are skipped by the token shifts and leave the WKV's state as it is, so a left-padded row
equals the row alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, tables
from linattn_jax.hf.tables import COPY, LINEAR

PREFIX = "rwkv."
TORCH_LAYER_NORM_EPS = 1e-5  # ln_out: nn.LayerNorm's default, not layer_norm_epsilon


def _mix_shape(n: int) -> tuple[int, int, int]:
    return (1, 1, n)


MIX = tables.reshaped(_mix_shape, "mix")  # [1, 1, C] <-> our [C]

MODEL_RULES = tables.rules(
    ("embeddings.weight", "embed.embedding", COPY),
    ("blocks.0.pre_ln.weight", "embed_norm.scale", COPY),
    ("blocks.0.pre_ln.bias", "embed_norm.bias", COPY),
    ("ln_out.weight", "norm.scale", COPY),
    ("ln_out.bias", "norm.bias", COPY),
)
HEAD_RULE = tables.Rule("head.weight", ("head.kernel",), LINEAR)  # untied only; no prefix
BLOCK_RULES = tables.rules(
    ("ln1.weight", "attention_norm.scale", COPY),
    ("ln1.bias", "attention_norm.bias", COPY),
    ("ln2.weight", "mlp_norm.scale", COPY),
    ("ln2.bias", "mlp_norm.bias", COPY),
    ("attention.time_decay", "attention.time_decay", COPY),
    ("attention.time_first", "attention.time_first", COPY),
    ("attention.time_mix_key", "attention.time_mix_key", MIX),
    ("attention.time_mix_value", "attention.time_mix_value", MIX),
    ("attention.time_mix_receptance", "attention.time_mix_receptance", MIX),
    ("attention.key.weight", "attention.key.kernel", LINEAR),
    ("attention.value.weight", "attention.value.kernel", LINEAR),
    ("attention.receptance.weight", "attention.receptance.kernel", LINEAR),
    ("attention.output.weight", "attention.output.kernel", LINEAR),
    ("feed_forward.time_mix_key", "mlp.time_mix_key", MIX),
    ("feed_forward.time_mix_receptance", "mlp.time_mix_receptance", MIX),
    ("feed_forward.key.weight", "mlp.key.kernel", LINEAR),
    ("feed_forward.receptance.weight", "mlp.receptance.kernel", LINEAR),
    ("feed_forward.value.weight", "mlp.value.kernel", LINEAR),
)

# transformers' RwkvConfig defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=50277, context_length=1024, hidden_size=4096, num_hidden_layers=32,
    attention_hidden_size=None, intermediate_size=None, layer_norm_epsilon=1e-5,
    rescale_every=6, tie_word_embeddings=False,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "context_length", "hidden_size", "num_hidden_layers",
    "attention_hidden_size", "intermediate_size",
)  # fmt: skip


def widths(config: common.Config) -> None:
    """``attention_hidden_size`` (``hidden_size``) and ``intermediate_size`` (``4
    hidden_size``) where null, as ``transformers`` derives them."""
    width = config["hidden_size"]
    if config.get("attention_hidden_size") is None:
        config["attention_hidden_size"] = width
    if config.get("intermediate_size") is None and common.is_int(width):
        config["intermediate_size"] = 4 * width


def check_rescale(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless ``rescale_every`` is an int (<= 0: no rescaling)."""
    if not common.is_int(config["rescale_every"]):
        raise ValueError(
            f"config.json: rescale_every must be an int, got {config['rescale_every']!r}"
        )


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer an RWKV block: the time mix, the channel mix, LayerNorms."""
    return dict(
        num_heads=1,
        attention="rwkv",
        kind_options={"rwkv": dict(wkv_width=config["attention_hidden_size"])},
        mlp="rwkv",
        mlp_hidden=config["intermediate_size"],
        norm="layer",
        embedding_norm=True,
    )


def rescaled_eps(config: Mapping[str, Any], layer: int, eps: float) -> float:
    """``eps`` of a LayerNorm at the input of block ``layer`` (``num_hidden_layers``: the
    final norm) as ``transformers``' rescaling at inference makes it (module docstring)."""
    every = config["rescale_every"]
    return eps * 4.0 ** (layer // every) if every > 0 else eps


def finish(model, config: Mapping[str, Any]) -> None:
    """Sets the LayerNorms' epsilons (``rescaled_eps``).

    Raises:
      ValueError: a scanned model (``scan_layers``) whose layers' epsilons differ.
    """
    eps, depth = float(config["layer_norm_epsilon"]), config["num_hidden_layers"]
    if model.period is not None and rescaled_eps(config, depth - 1, eps) != eps:
        raise ValueError(
            f"rescale_every={config['rescale_every']} gives the {depth} layers different "
            "epsilons, which scan_layers cannot hold: use scan_layers=False"
        )
    model.embed_norm.epsilon = eps
    for i, block in enumerate(model.blocks):
        block.attention_norm.epsilon = block.mlp_norm.epsilon = rescaled_eps(config, i, eps)
    model.norm.epsilon = rescaled_eps(config, depth, TORCH_LAYER_NORM_EPS)


FORMAT = common.ModelFormat(
    name="RWKV",
    model_types=("rwkv",),
    architecture="RwkvForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=("attention_hidden_size", "intermediate_size")),
        widths,
        common.ints(INT_FIELDS),
        common.bools(("tie_word_embeddings",)),
        common.numbers(("layer_norm_epsilon",)),
        check_rescale,
    ),
    options=options,
    table=tables.layered(MODEL_RULES, lambda config, i: BLOCK_RULES, layers="blocks."),
    prefixes=(PREFIX,),
    finish=finish,
    head=HEAD_RULE,
)
