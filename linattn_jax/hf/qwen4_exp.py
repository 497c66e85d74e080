"""Qwen4-Exp text models in Hugging Face format <-> ``LanguageModel``.

``qwen4_exp_text`` (``Qwen4ExpForCausalLM``), or the text part of ``qwen4_exp``
(``Qwen4ExpForConditionalGeneration``), is Qwen3.5-MoE (``hf.qwen3_5_moe``: its Gated
DeltaNet, mixtures, zero-centred norms) whose residual stream is ``hc_count`` streams
(hyper-connections, ``layers.hyper``): each layer's two pre-norms
(``input_layernorm``, ``post_attention_layernorm``) are ``attn_hyper_connection`` and
``mlp_hyper_connection``, reading the mixer's and the MLP's input from the streams and
writing their outputs back; the final norm is ``hyper_connection_mixer``, a read-out.
Their rows, under ``layers.{i}.{attn,mlp}_hyper_connection.`` (our ``blocks.{i}.
{attention,mlp}_norm.``) and ``hyper_connection_mixer.`` (our ``norm.``):

* ``hc_norm.weight`` ``[n d]``: the streams' zero-centred RMSNorm (each stream's ``d``
  features normalised alone, ``rms_norm_eps``), our ``norm.scale``;
* ``input_mix_weight_down.weight`` ``[hc_lowrank, n d]``, ``input_mix_weight_up.weight``
  ``[n d, hc_lowrank]`` and (not the read-out's) ``block_inject_weight.weight``
  ``[n, n d]``: our ``down``, ``up`` and ``inject`` kernels (transposed).

The Gated DeltaNet's output gate is ``output_gate_type`` (``"silu"`` or ``"sigmoid"``;
null: ``hidden_act``), the routers renormalise their top-k by ``norm_topk_prob``. The
attention layers (``"indexed_attention"``, or ``"full_attention"``, as ``transformers``
reads both) are Qwen3.5's gated attention with the QSA indexer (``layers.indexed``:
``self_attn.indexer.index_qk_proj``, ``q_layernorm``, ``k_layernorm`` are our
``attention.index_proj``, ``index_q_norm``, ``index_k_norm``), which needs the
``indexer_*`` fields; the ``ple_layer_ids`` layers add the per-layer n-gram embeddings
(``layers.ngram``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, qwen3_5, qwen3_5_moe, tables
from linattn_jax.hf.tables import CONV, COPY, LINEAR, rules

MODEL_TYPES = ("qwen4_exp_text", "qwen4_exp")
# transformers' defaults (Qwen4ExpTextConfig) of the fields Qwen3.5-MoE lacks or sets
# otherwise.
DEFAULTS = dict(
    hc_count=4, hc_lowrank=320, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
    output_gate_type=None, ple_layer_ids=[], ple_embed_dim=None, ple_conv_kernel_size=4,
    ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
    make_ngram_vocab_size_divisible_by=128, seed=1234, split_ngram_parts=512,
    indexer_n_heads=None, indexer_kv_heads=None, indexer_head_dim=None, indexer_budget=None,
    indexer_compress_ratio=None,
)  # fmt: skip
QSA_FIELDS = (
    "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
    "indexer_compress_ratio",
)  # fmt: skip
INDEX_RULES = rules(
    ("self_attn.indexer.index_qk_proj.weight", "attention.index_proj.kernel", LINEAR),
    ("self_attn.indexer.q_layernorm.weight", "attention.index_q_norm.scale", COPY),
    ("self_attn.indexer.k_layernorm.weight", "attention.index_k_norm.scale", COPY),
)
NGRAM_INTS = (
    "ple_embed_dim", "ple_conv_kernel_size", "ngram_size", "heads_per_ngram",
    "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by", "split_ngram_parts",
)  # fmt: skip
PLE = "ple."  # a PLE layer's rows, under layers.{i}. (ours: blocks.{i}.ngrams.)
PLE_RULES = rules(
    ("key_proj.weight", "key_proj.kernel", LINEAR),
    ("value_proj.weight", "value_proj.kernel", LINEAR),
    ("norm_key.weight", "norm_key.scale", COPY),
    ("norm_query.weight", "norm_query.scale", COPY),
    ("norm_conv.weight", "norm_conv.scale", COPY),
    ("conv1d.weight", "conv", CONV),
)
# Buffers transformers saves and recomputes from the config (ngram_options).
PLE_BUFFERS = tuple(
    f"ple_embedding.{b}"
    for b in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
)
GATE_TYPES = ("silu", "sigmoid")

READ_RULES = rules(
    ("hc_norm.weight", "norm.scale", COPY),
    ("input_mix_weight_down.weight", "down.kernel", LINEAR),
    ("input_mix_weight_up.weight", "up.kernel", LINEAR),
)
HYPER_RULES = READ_RULES + rules(("block_inject_weight.weight", "inject.kernel", LINEAR))
LAYER_HYPER_RULES = tables.under(
    HYPER_RULES, "attn_hyper_connection.", "attention_norm."
) + tables.under(HYPER_RULES, "mlp_hyper_connection.", "mlp_norm.")
MODEL_RULES = tables.MODEL_RULES[:1] + tables.under(READ_RULES, "hyper_connection_mixer.", "norm.")


MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment and mixers, transformers' hash seeds


def splitmix64(value: int) -> int:
    value = (value + GAMMA) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def eos_id(config: Mapping[str, Any]) -> Any:
    """``eos_token_id``, the first where it lists several (PLE's segment end)."""
    eos = config.get("eos_token_id")
    return eos[0] if isinstance(eos, list) and eos else eos


def ngram_options(config: Mapping[str, Any], i: int) -> dict[str, Any] | None:
    """Layer ``i``'s ``layers.ngram.PerLayerNGrams`` options (None: not a PLE layer), as
    ``transformers`` derives them: the PLE layer ``k``'s odd multipliers (splitmix64 of
    ``seed + 10007 k``) and, for its heads, the next primes after ``ngram_vocab_size_base
    - 1`` (the ``k``-th PLE layer's heads after the earlier layers'), their offsets and the
    table's rows padded to ``make_ngram_vocab_size_divisible_by``."""
    if i + 1 not in config["ple_layer_ids"]:
        return None
    k, n = config["ple_layer_ids"].index(i + 1), config["ngram_size"]
    heads = (n - 1) * config["heads_per_ngram"]
    half = max(1, ((1 << 63) - 1) // config["vocab_size"] // 2)
    seed = config["seed"] + 10007 * k
    multipliers = [2 * (splitmix64((seed + GAMMA * (j + 1)) & MASK64) % half) + 1 for j in range(n)]
    sizes, prime = [], config["ngram_vocab_size_base"] - 1
    for _ in range((k + 1) * heads):
        prime += 1
        while not is_prime(prime):
            prime += 1
        sizes.append(prime)
    sizes = sizes[k * heads :]
    offsets = [sum(sizes[:h]) for h in range(heads)]
    divisor = config["make_ngram_vocab_size_divisible_by"]
    return dict(
        multipliers=multipliers, sizes=sizes, offsets=offsets,
        heads_per_ngram=config["heads_per_ngram"], head_dim=config["ple_embed_dim"] // heads,
        rows=-(-sum(sizes) // divisor) * divisor, eos=eos_id(config),
        conv_size=config["ple_conv_kernel_size"],
    )  # fmt: skip


def ple_rows(config: Mapping[str, Any], i: int) -> tuple[tables.Rule, ...]:
    """Layer ``i``'s PLE rows (none where it has no PLE): the table in
    ``split_ngram_parts`` shards as ``torch.chunk`` cuts it, then ``PLE_RULES``."""
    options = ngram_options(config, i)
    if options is None:
        return ()
    rows, parts = options["rows"], config["split_ngram_parts"]
    size = -(-rows // parts)
    table = "ngram_embedding.shard_{}.weight"
    shards = tuple(
        tables.Rule(
            PLE + "ple_embedding." + table.format(j),
            ("ngrams.table.embedding",),
            COPY,
            slice(j * size, min(rows, (j + 1) * size)),
        )
        for j in range(-(-rows // size))
    )
    return shards + tables.under(PLE_RULES, PLE, "ngrams.")


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """The embedding and read-out rows, then each layer's hyper-connections, mixture (per
    expert, or fused for a ``prefix`` ending in ``qwen3_5_moe.FUSED``) and mixer."""
    fused, prefix = prefix.endswith(qwen3_5_moe.FUSED), prefix.removesuffix(qwen3_5_moe.FUSED)
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    for i, layer_type in enumerate(config["layer_types"]):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        rows += tables.prefixed(ple_rows(config, i) + LAYER_HYPER_RULES, layer, block)
        rows += qwen3_5_moe.moe_rows(config, layer, block, fused)
        own = qwen3_5.LAYER_RULES[layer_type]
        rows += tables.prefixed(
            own + (INDEX_RULES if layer_type != "linear_attention" else ()), layer, block
        )
    return rows


def indexed_layers(config: common.Config) -> None:
    """``transformers``' name of the attention layers, ``"indexed_attention"``, as
    Qwen3.5's ``"full_attention"`` (which ``transformers`` reads as indexed)."""
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [
            "full_attention" if t == "indexed_attention" else t for t in config["layer_types"]
        ]


def check_indexer(config: common.Config) -> None:
    """The QSA indexer's fields, which every attention layer needs."""
    common.check_ints(config, QSA_FIELDS)
    common.check_choice(config, "indexer_kv_heads", (1,))
    budget, ratio = config["indexer_budget"], config["indexer_compress_ratio"]
    if budget % ratio:
        raise ValueError(
            f"config.json: indexer_budget={budget} must be a multiple of "
            f"indexer_compress_ratio={ratio}"
        )
    rotary = int(config["head_dim"] * config["rope_parameters"]["partial_rotary_factor"])
    if rotary > config["indexer_head_dim"]:
        raise ValueError(
            f"config.json: indexer_head_dim={config['indexer_head_dim']} must hold the "
            f"{rotary} rotary channels"
        )


def check_hyper(config: common.Config) -> None:
    """Checks the hyper-connections' sizes, ``norm_topk_prob``, ``output_gate_type`` and
    the PLE fields (reading ``eos``: the first ``eos_token_id``)."""
    common.check_ints(config, ("hc_count",), minimum=2)  # transformers: hc_count > 1
    common.check_ints(config, ("hc_lowrank",))
    common.check_bools(config, ("norm_topk_prob",))
    common.check_choice(config, "output_gate_type", (None, *GATE_TYPES))
    if "full_attention" in config["layer_types"]:
        check_indexer(config)
    if config["ple_embed_dim"] is None:
        config["ple_embed_dim"] = config["hidden_size"]
    common.check_ints(config, NGRAM_INTS)
    common.check_ints(config, ("ngram_size",), minimum=2)
    ids, depth = config["ple_layer_ids"], config["num_hidden_layers"]
    if not isinstance(ids, list) or not all(common.is_int(i) and 1 <= i <= depth for i in ids):
        raise ValueError(f"config.json: ple_layer_ids must list ints in [1, {depth}], got {ids!r}")
    config["ple_layer_ids"] = sorted(set(ids))
    if not ids:
        return
    heads = (config["ngram_size"] - 1) * config["heads_per_ngram"]
    if config["ple_embed_dim"] % heads:
        raise ValueError(
            f"config.json: ple_embed_dim={config['ple_embed_dim']} must be a multiple of the "
            f"n-gram heads (ngram_size - 1) * heads_per_ngram = {heads}"
        )
    if not common.is_int(eos_id(config)):
        raise ValueError(
            "config.json: eos_token_id must be set with ple_layer_ids, got "
            f"{config.get('eos_token_id')!r}"
        )


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE's options with ``hyper_connections``, the Gated DeltaNet's output gate
    and ``norm_topk_prob``."""
    base = qwen3_5_moe.options(config)
    indexed = dict(
        base["kind_options"]["softmax"], index_heads=config["indexer_n_heads"],
        index_head_dim=config["indexer_head_dim"], index_budget=config["indexer_budget"],
        index_block=config["indexer_compress_ratio"],
    )  # fmt: skip
    delta = dict(
        base["kind_options"]["gated_deltanet"],
        output_gate_activation=config["output_gate_type"] or config["hidden_act"],
    )
    return base | dict(
        attention=["indexed_softmax" if k == "softmax" else k for k in base["attention"]],
        kind_options={
            "gated_deltanet": delta,
            **({"indexed_softmax": indexed} if "softmax" in base["attention"] else {}),
        },
        moe=base["moe"] | dict(normalize=config["norm_topk_prob"]),
        hyper_connections=dict(streams=config["hc_count"], rank=config["hc_lowrank"]),
        ngrams=[ngram_options(config, i) for i in range(config["num_hidden_layers"])],
    )


FORMAT = qwen3_5_moe.FORMAT.derive(
    name="Qwen4-Exp",
    model_types=MODEL_TYPES,
    architecture="Qwen4ExpForCausalLM",
    steps=(
        qwen3_5.text_part("qwen4_exp", "qwen4_exp_text"),
        indexed_layers,
        common.defaults(DEFAULTS, keep_none=("output_gate_type",)),
        *qwen3_5_moe.FORMAT.steps[1:],  # Qwen3.5-MoE's, from its defaults on
        check_hyper,
    ),
    options=options,
    table=table,
    ignored=lambda config: (
        tuple(
            f"{prefix}layers.{i - 1}.{PLE}{b}"
            for prefix in qwen3_5.FORMAT.prefixes
            for i in config["ple_layer_ids"]
            for b in PLE_BUFFERS
        )
        + qwen3_5.IGNORED_PREFIXES
    ),
)
