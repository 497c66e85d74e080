"""Mistral checkpoints (``MistralForCausalLM``, ``model_type`` ``mistral``): Llama
(``hf.llama``, no biases) whose every layer sees its last ``sliding_window`` tokens (null:
all of them); ``layer_types``, which ``transformers``' Mistral does not read, is not read.
"""

from __future__ import annotations

from linattn_jax.hf import common, llama, tables

# transformers' MistralConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
    max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, tie_word_embeddings=False,
    sliding_window=4096,
)  # fmt: skip


def window(config: common.Config) -> None:
    """Checks ``sliding_window``: an int >= 1, or null (no window)."""
    if config["sliding_window"] is not None:
        common.check_ints(config, ("sliding_window",))


FORMAT = llama.FORMAT.derive(
    name="Mistral",
    model_types=("mistral",),
    architecture="MistralForCausalLM",
    steps=llama.windowed_steps(DEFAULTS, 10000.0, window),
    options=lambda config: llama.layered_options(
        config,
        ["softmax"],
        {"softmax": llama.softmax_options(config, sliding_window=config["sliding_window"])},
    ),
    table=llama.table(lambda config: tables.ATTENTION_RULES),
)
